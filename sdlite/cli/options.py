"""The options several sub-commands share, and their defaults: ``--model`` (the shipped demo models when none is
given), ``--precision``, ``--compile``, and the settings a Turbo model gets where the command line leaves them unset."""
from __future__ import annotations

from pathlib import Path

from ..errors import SDLiteError


# what --turbo (or a model recognised as Turbo) changes where the command line leaves it unset: the settings the
# distilled models are made for (stabilityai/sdxl-turbo and sd-turbo model cards: 1-4 steps, no guidance)
TURBO_DEFAULTS = {"steps": 1, "cfg": 1.0, "sampler": "euler_a", "timestep_spacing": "trailing"}
TURBO_DEFAULTS_TEXT = "1 step, cfg 1 (no negative pass), Euler a, trailing timestep spacing"
PLAIN_DEFAULTS = {"steps": 20, "cfg": 7.5, "sampler": "dpmpp_2m_karras", "timestep_spacing": None}

DEMO_MODELS = ("demo", "demo-zh")   # --model names of the shipped demo models (when no such path exists)


def demo_model_path(name: str = "demo") -> str:
    """A small demo model shipped inside the package: ``demo`` (English; the default when no --model is given)
    or ``demo-zh`` (its Chinese text encoder; the default for a prompt with Chinese characters)."""
    from importlib import resources

    folder = resources.files("sdlite") / "data" / name
    if not folder.joinpath("model_index.json").is_file():
        raise SDLiteError(f"the {name} model is not installed: pass --model PATH "
                          "(a diffusers folder or a .safetensors/.ckpt file)")
    return str(folder)


def resolve_model(model: str | None, prompt: str | None = None) -> str:
    """The model a command uses: ``--model`` as given, where ``demo`` and ``demo-zh`` name the shipped demo models
    (unless a file or folder of that name exists); without ``--model``, the demo model, or demo-zh when the prompt
    holds Chinese characters."""
    if model is None:
        from ..tokenizers.wordpiece import is_cjk

        return demo_model_path("demo-zh" if prompt and any(map(is_cjk, prompt)) else "demo")
    if model in DEMO_MODELS and not Path(model).exists():
        return demo_model_path(model)
    return model


def parse_numbers(flag: str, text: str | None, integers: bool = False) -> tuple | None:
    """``--timesteps 999,749,499,249`` / ``--sigmas 14.6,3,1,0``: the comma-separated numbers (None when not
    given); what they must be (descending, in range) the request checks."""
    if text is None:
        return None
    try:
        return tuple((int if integers else float)(part) for part in text.split(","))
    except ValueError:
        example = "999,749,499,249" if integers else "14.6,3,1,0"
        raise SDLiteError(f"{flag} {text!r} is not valid: expected {'integers' if integers else 'numbers'} "
                          f"separated by commas, e.g. {example}") from None


def check_list_steps(args) -> None:
    """``--steps`` given beside ``--timesteps`` / ``--sigmas`` must agree with the list, which sets the steps."""
    for flag, values, count in (("--timesteps", args.timesteps, len(args.timesteps or ())),
                                ("--sigmas", args.sigmas, len(args.sigmas or ()) - 1)):
        if values is not None and args.steps is not None and args.steps != count:
            raise SDLiteError(f"--steps {args.steps} disagrees with {flag} ({count} steps): leave --steps out, the "
                              "list sets the steps")


def check_precision_option(args, device: str) -> str:
    """``--precision`` checked before anything starts (a name we know, and one this CPU can run); returns the name
    to hand to the engines ("auto" stays "auto": each machine resolves it for itself)."""
    from ..engine.precision import check_precision, resolve

    name = check_precision(args.precision or "auto")
    resolve(name, device)
    return name


def add_compile_option(parser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="run the denoiser (the UNet or a transformer) through torch.compile: the first run of "
                             "an image shape compiles (about a minute), later processes find it in the user's cache "
                             "folder; eager, with one line saying why, where it cannot. Opt-in: on a CPU it measured "
                             "no faster than eager, or a few per cent (SD3.5)")


def add_precision_option(parser) -> None:
    parser.add_argument("--precision", default=None, metavar="P",
                        help="auto (default: bf16 on CPUs with native bf16, fp16 on a GPU, else exact), exact (fp32, the "
                             "diffusers-exact path), bf16, int8, int8-bf16, int4 (FLUX/SD3 transformers: weight-only "
                             "int8/int4) or fp16; `sdlite info --system` shows what auto picks here and why")
