"""The ``sdlite`` command: a thin adapter over the library, with no model logic of its own.

Every user-facing failure is an :class:`~sdlite.errors.SDLiteError`; it is printed as one line and the
command exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .errors import SDLiteError

FAMILY_NAMES = {
    "sd1": "Stable Diffusion 1.x",
    "sd2": "Stable Diffusion 2.x",
    "sd1-inpaint": "Stable Diffusion 1.x inpainting",
    "sd2-inpaint": "Stable Diffusion 2.x inpainting",
    "sdxl": "Stable Diffusion XL",
    "sdxl-refiner": "Stable Diffusion XL refiner",
    "sd-x4-upscaler": "Stable Diffusion x4 upscaler",
}


# what --turbo (or a model recognised as Turbo) changes where the command line leaves it unset: the settings the
# distilled models are made for (stabilityai/sdxl-turbo and sd-turbo model cards: 1-4 steps, no guidance)
TURBO_DEFAULTS = {"steps": 1, "cfg": 1.0, "sampler": "euler_a", "timestep_spacing": "trailing"}
TURBO_DEFAULTS_TEXT = "1 step, cfg 1 (no negative pass), Euler a, trailing timestep spacing"
PLAIN_DEFAULTS = {"steps": 20, "cfg": 7.5, "sampler": "dpmpp_2m_karras", "timestep_spacing": None}
DEFAULT_REFINER_SWITCH = 0.8   # A1111's "Refiner switch at" default

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
        from .tokenizers.wordpiece import is_cjk

        return demo_model_path("demo-zh" if prompt and any(map(is_cjk, prompt)) else "demo")
    if model in DEMO_MODELS and not Path(model).exists():
        return demo_model_path(model)
    return model


def family_name(spec) -> str:
    """How ``sdlite info`` names a model's family: "Stable Diffusion 1.x", or for Taiyi "Taiyi, Chinese BERT text
    encoder" (SD 1.x's UNet and VAE with a BERT text tower)."""
    from .config import is_bert

    if is_bert(spec.text):
        return "Taiyi, Chinese BERT text encoder"
    name = FAMILY_NAMES.get(spec.family, spec.family)
    if spec.turbo:
        return f"{name}, Turbo (distilled: 1-4 steps, no guidance)"
    return name


def _describe_component(name: str, spec) -> str:
    from .config import is_bert

    if name == "text_encoder" and is_bert(spec.text):
        t = spec.text
        return (f"BERT text encoder: {t.layers} layers, width {t.width}, {t.heads} heads, gelu, vocabulary "
                f"{t.vocab_size}, {t.max_positions} positions (the UNet reads all {t.max_positions}, padding "
                "included)")
    if name in ("text_encoder", "text_encoder_2"):
        t = spec.text if name == "text_encoder" else spec.text2
        kind = {768: "CLIP ViT-L/14 text tower", 1024: "OpenCLIP ViT-H text tower",
                1280: "OpenCLIP ViT-bigG text tower"}.get(t.width, "CLIP text tower")
        extra = ""
        if spec.is_sdxl:
            extra = ", penultimate layer" + (f", pooled output projected to {t.projection_dim}"
                                             if name == "text_encoder_2" else "")
        return f"{kind}: {t.layers} layers, width {t.width}, {t.heads} heads, {t.activation}{extra}"
    if name == "unet":
        u = spec.unet
        depth = u.transformer_depth
        return (f"UNet: {u.in_channels} in-channels, widths {list(u.block_channels)}, {u.layers_per_block} "
                f"res blocks/level, heads {list(u.heads)}, context {u.context_dim}, "
                f"{'linear' if u.linear_projection else 'conv'} projections"
                + (f", transformer depth {list(depth) if isinstance(depth, tuple) else depth}" if depth != 1 else "")
                + (f", added conditioning: pooled text + {(u.add_embed_in - spec.text2.projection_dim) // u.addition_time_embed_dim}"
                   f" {'size/crop/aesthetic' if spec.requires_aesthetics_score else 'size/crop'} ids"
                   if u.addition_embed == "text_time" and spec.text2 is not None else ""))
    v = spec.vae
    return f"AutoencoderKL: widths {list(v.block_channels)}, {v.latent_channels} latent channels, " \
           f"{v.downscale}x downsampling, scaling factor {v.scaling_factor}"


def _describe_schedule(cfg: dict) -> str:
    spacing = cfg.get("timestep_spacing") or "each sampler's default"
    betas = cfg.get("beta_schedule", "linear") if cfg.get("trained_betas") is None else "trained"
    return (f"{betas} betas {cfg.get('beta_start', 0.0001)}..{cfg.get('beta_end', 0.02)} over "
            f"{cfg.get('num_train_timesteps', 1000)} steps, timestep spacing {spacing}, steps offset "
            f"{cfg.get('steps_offset', 0)}" + (f" ({cfg['_class_name']})" if cfg.get("_class_name") else ""))


def cmd_info(args) -> int:
    from .loader import open_model, resolve_prediction_type

    if getattr(args, "system", False):
        from .engine.cpu import system_report
        from .engine.precision import precision_report

        print("\n".join(system_report() + precision_report()))
        if args.path is None:
            return 0
        print()
    with open_model(resolve_model(args.path), prediction_type=args.prediction_type) as ckpt:
        if ckpt.prediction_source == "unresolved":
            resolve_prediction_type(ckpt)
        spec = ckpt.spec
        layout = "diffusers folder" if ckpt.layout == "diffusers" else \
            f"original single file ({ckpt._stores[0].container})"
        print(f"path:        {ckpt.path}")
        print(f"layout:      {layout}")
        print(f"family:      {spec.family} ({family_name(spec)})")
        print(f"prediction:  {spec.prediction_type} ({ckpt.prediction_source})")
        print(f"storage:     {str(ckpt.storage_dtype).replace('torch.', '')}")
        print(f"image size:  {spec.default_size}x{spec.default_size} (native)")
        if spec.is_sdxl:
            print(f"negative:    {'zeros when no negative prompt is given' if spec.force_zeros_for_empty_prompt else 'encoded, also when empty'}"
                  f" (force_zeros_for_empty_prompt)")
        if spec.turbo:
            print(f"turbo:       defaults {TURBO_DEFAULTS_TEXT}")
        print(f"schedule:    {_describe_schedule(ckpt.scheduler_config)}")
        print(f"             from {ckpt.scheduler_source}")
        counts = ckpt.parameter_counts()
        print("components:")
        for name in ckpt.components:
            if name in counts:
                print(f"  {name:<15}{counts[name]:>14,} params  {_describe_component(name, spec)}")
        print(f"  {'total':<15}{sum(counts.values()):>14,} params")
        unusual = ckpt.problems() + ckpt.notes
        if ckpt.detection.has_ema:
            unusual.append("the file carries EMA copies of the UNet weights (model_ema.*); the non-EMA ones are used")
        ignored = sum(len(s.ignored) for s in ckpt.sources.values())
        if ignored:
            from .config import is_bert

            pooler = is_bert(spec.text) and any(k.startswith(("pooler.", "bert.pooler.", "cls."))
                                                for k in ckpt.sources["text_encoder"].ignored)
            unusual.append(f"{ignored} {'tensors' if pooler else 'buffers'} ignored (e.g. position_ids, schedule tensors"
                           + (", BERT's pooler, which Stable Diffusion does not use)" if pooler else ")"))
        print("unusual:" if unusual else "unusual:     nothing")
        for line in unusual:
            print(f"  - {line}")
    return 0


class ProgressBar:
    """Steps, it/s and ETA on one self-rewriting line of a terminal; silent when stderr is not a terminal."""

    def __init__(self, label: str = "sampling", stream=None, width: int = 28):
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label, self.width = label, width
        self.start = None

    def __call__(self, step: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.start is None or step <= 1:
            self.start = now if self.start is None else self.start
        elapsed = now - self.start
        rate = step / elapsed if elapsed > 0 else 0.0
        eta = (total - step) / rate if rate > 0 else 0.0
        filled = int(self.width * step / total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} {step:>3}/{total} [{bar}] {rate:5.2f} it/s  ETA {eta:5.1f}s")
        if step >= total:
            self.stream.write(f"\r{self.label} {total:>3}/{total} [{'#' * self.width}] {rate:5.2f} it/s  "
                              f"{elapsed:.1f}s   \n")
        self.stream.flush()


def cmd_samplers(args) -> int:
    from .sampling.samplers import A1111_NAMES, SAMPLERS

    by_sampler: dict[str, list[str]] = {}
    for alias, name in A1111_NAMES.items():
        by_sampler.setdefault(name, []).append(alias)
    print(f"{'name':<14}{'default schedule':<18}{'A1111 names':<28}reference")
    for name, info in SAMPLERS.items():
        aliases = ", ".join(by_sampler.get(name, []))
        print(f"{name:<14}{info.schedule:<18}{aliases:<28}{info.reference}")
    print("\nschedules: discrete, karras, exponential (--schedule, or a ' Karras'/' Exponential' suffix "
          "on an A1111 name: \"DPM++ 2M Karras\")")
    return 0


_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
           "bf16": "bfloat16", "bfloat16": "bfloat16"}

# options that mean nothing without a source image, and those that mean nothing without a mask (argparse dest, flag)
_SOURCE_OPTIONS = (("strength", "--strength"), ("resize_mode", "--resize-mode"))
_MASK_OPTIONS = (("mask_blur", "--mask-blur"), ("inpaint_fill", "--inpaint-fill"), ("inpaint_area", "--inpaint-area"),
                 ("inpaint_padding", "--inpaint-padding"), ("no_overlay", "--no-overlay"))


def parse_outpaint(text: str | None) -> tuple[int, int, int, int] | None:
    """``--outpaint "L,T,R,B"``: four whole numbers of pixels; whether they are multiples of 8 is
    :func:`~sdlite.pipeline.validate`'s to check."""
    from .pipeline import RequestError

    if text is None:
        return None
    parts = text.split(",")
    try:
        if len(parts) == 4:
            left, top, right, bottom = (int(part) for part in parts)
            return left, top, right, bottom
    except ValueError:
        pass
    raise RequestError(f"outpaint {text!r} is not valid: expected four whole numbers of pixels LEFT,TOP,RIGHT,BOTTOM, "
                       "multiples of 8 (e.g. 64,0,64,0)")


def _check_stray_options(args) -> None:
    """Image-to-image options given where they would be ignored: without a source image, or without a mask."""
    from .pipeline import RequestError

    def given(options) -> str:
        flags = [flag for dest, flag in options if getattr(args, dest) not in (None, False)]
        return f"{', '.join(flags)} need{'s' if len(flags) == 1 else ''}" if flags else ""

    if args.init_image is None:
        stray = given(_SOURCE_OPTIONS + _MASK_OPTIONS + (("invert_mask", "--invert-mask"),))
        if stray:
            raise RequestError(f"{stray} a source image: add --init-image PATH")
        return
    if args.invert_mask and args.mask is None and not args.mask_from_alpha:
        raise RequestError("--invert-mask needs a mask to invert: add --mask PATH or --mask-from-alpha")
    stray = given(_MASK_OPTIONS)
    if stray and args.mask is None and not args.mask_from_alpha and args.outpaint is None:
        raise RequestError(f"{stray} a mask: add --mask PATH, --mask-from-alpha or --outpaint L,T,R,B")


def check_sources(request) -> None:
    """Read the source image and mask once before the model load, so that a missing, unreadable or oversized file,
    or a mask that leaves nothing to repaint, fails fast with the file named (the engine reads them again)."""
    from . import sources
    from .pipeline import RequestError

    for path, what in ((request.init_image, "init image"), (request.mask, "mask")):
        if path is None:
            continue
        if not os.path.exists(path):
            raise RequestError(f"{what} {path}: no such file")
        if os.path.isdir(path):
            raise RequestError(f"{what} {path}: is a directory, not an image file")
        if not os.path.isfile(path):
            raise RequestError(f"{what} {path}: is not a regular file (a device, pipe or socket?)")
    try:
        image = sources.load_image(request.init_image, "init image")
        if request.mask_from_alpha:
            mask = sources.load_mask(image, f"init image {request.init_image}", from_alpha=True)
        elif request.mask is not None:
            mask = sources.load_mask(request.mask, "mask")
        else:
            return
    except sources.ImageInputError as e:
        raise RequestError(str(e)) from None
    repainted = sources.invert_mask(mask) if request.invert_mask else mask
    if request.outpaint is not None or repainted.getbbox() is not None:  # outpainting repaints the new border
        return
    if request.mask_from_alpha:
        which, where = ("opaque", "at least half") if request.invert_mask else ("transparent", "below half")
        raise RequestError(f"init image {request.init_image} has no {which} pixels to repaint (--mask-from-alpha"
                           f"{' --invert-mask' if request.invert_mask else ''} repaints where its alpha is {where})")
    if request.invert_mask:
        raise RequestError(f"mask {request.mask} is all white: inverted (--invert-mask), it leaves nothing to repaint")
    raise RequestError(f"mask {request.mask} is all black: nothing to repaint (white marks the area to repaint)")


def parse_lora(text: str) -> tuple[str, float]:
    """``--lora PATH[:WEIGHT]`` -> (path, weight); the weight defaults to 1 (a path may itself hold colons: only a
    number after the last one is a weight)."""
    from .pipeline import RequestError

    path, sep, tail = text.rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            if os.path.exists(text):
                return text, 1.0
            raise RequestError(f"--lora {text!r}: {tail!r} after the last colon is not a weight (PATH[:WEIGHT], "
                               "e.g. style.safetensors:0.8)") from None
    return text, 1.0


def check_addons(request) -> None:
    """LoRA files and the LoRA and embeddings folders exist (before the model load)."""
    from .pipeline import RequestError

    for path, _ in request.loras:
        if not os.path.isfile(path):
            raise RequestError(f"LoRA {path}: " + ("is a directory, not a LoRA file" if os.path.isdir(path)
                                                   else "no such file"))
    for folder, what in ((request.lora_dir, "--lora-dir"), (request.embeddings_dir, "--embeddings")):
        if folder is not None and not os.path.isdir(folder):
            raise RequestError(f"{what} {folder}: not a folder")



# the per-unit flags: (args attribute, flag, the ControlUnit field it sets)
_CONTROL_FLAGS = (("control_image", "--control-image", "image"), ("control_weight", "--control-weight", "weight"),
                  ("control_start", "--control-start", "guidance_start"),
                  ("control_end", "--control-end", "guidance_end"),
                  ("control_preprocessor", "--control-preprocessor", "preprocessor"),
                  ("control_mode", "--control-mode", "mode"), ("control_resize", "--control-resize", "resize_mode"),
                  ("control_threshold_a", "--control-threshold-a", "threshold_a"),
                  ("control_threshold_b", "--control-threshold-b", "threshold_b"),
                  ("control_processor_res", "--control-processor-res", "processor_res"),
                  ("control_hr_option", "--control-hr-option", "hr_option"))


def resolve_controlnet(path: str) -> str:
    """``--controlnet`` as given, where ``demo-position`` names the shipped demo ControlNet (unless a file or folder
    of that name exists)."""
    from .control import DEMO_CONTROLNETS, SHIPPED

    if path in DEMO_CONTROLNETS and not Path(path).exists():
        folder = SHIPPED / path
        if not folder.joinpath("config.json").is_file():
            raise SDLiteError(f"--controlnet {path}: the demo ControlNet is not installed")
        return str(folder)
    return path


def control_units(args) -> tuple:
    """The :class:`~sdlite.control.ControlUnit` of each ``--controlnet``, the n-th value of every ``--control-*``
    flag going to the n-th (a value given once goes to all). Each value is checked here, so that a bad one is named
    by its flag before the model load; files must exist."""
    from .control import CONTROL_MODES, HR_OPTIONS, RESIZE_MODES, ControlError, ControlUnit
    from . import sources
    from .control import preprocess
    from .control.units import MAX_WEIGHT
    from .pipeline import RequestError

    n = len(args.controlnet)
    if n == 0:
        stray = [flag for dest, flag, _ in _CONTROL_FLAGS if getattr(args, dest)]
        stray += ["--control-pixel-perfect"] if args.control_pixel_perfect else []
        if stray:
            raise RequestError(f"{', '.join(stray)} need{'s' if len(stray) == 1 else ''} a ControlNet: add "
                               "--controlnet PATH")
        return ()
    per_unit: list[dict] = [{} for _ in range(n)]
    for dest, flag, field in _CONTROL_FLAGS:
        values = getattr(args, dest)
        if len(values) not in (0, 1, n):
            raise RequestError(f"{flag} is given {len(values)} times for {n} --controlnet: give it once (for every "
                               f"ControlNet) or once per --controlnet, in the same order")
        for i in range(n if values else 0):
            per_unit[i][field] = values[i if len(values) == n else 0]

    def choice(value, table: dict, flag: str) -> str:
        v = str(value).strip().lower()
        for ours, theirs in table.items():
            if v in (ours, theirs.lower()):
                return ours
        raise RequestError(f"{flag} {value!r} is not valid: expected one of {', '.join(table)}")

    units, checked_images = [], set()
    for path, fields in zip(args.controlnet, per_unit):
        path = resolve_controlnet(path)
        if not Path(path).exists():
            raise RequestError(f"--controlnet {path}: no such file or folder")
        image = fields.get("image")
        if image is None and args.init_image is None:
            raise RequestError(f"--controlnet {path} needs a control image: add --control-image PATH (or "
                               "--init-image, which a ControlNet without one uses)")
        if image is not None and image not in checked_images:
            try:   # read once before the model load (the engine reads it again)
                sources.load_image(image, "--control-image")
            except sources.ImageInputError as e:
                raise RequestError(str(e)) from None
            checked_images.add(image)
        weight = fields.get("weight", 1.0)
        if not 0.0 <= weight <= MAX_WEIGHT:   # also NaN
            raise RequestError(f"--control-weight {weight:g} is not valid: expected 0 to {MAX_WEIGHT:g}")
        start, end = fields.get("guidance_start", 0.0), fields.get("guidance_end", 1.0)
        for value, flag in ((start, "--control-start"), (end, "--control-end")):
            if not 0.0 <= value <= 1.0:
                raise RequestError(f"{flag} {value:g} is not valid: expected a fraction of the steps, 0 to 1")
        if start > end:
            raise RequestError(f"--control-start {start:g} is after --control-end {end:g}")
        res = fields.get("processor_res", 512)
        if not 64 <= res <= 4096:
            raise RequestError(f"--control-processor-res {res} is not valid: expected 64 to 4096 pixels")
        for field, flag in (("threshold_a", "--control-threshold-a"), ("threshold_b", "--control-threshold-b")):
            if field in fields and fields[field] != fields[field]:   # NaN
                raise RequestError(f"{flag} {fields[field]} is not a number")
        name = fields.get("preprocessor", "none")
        try:
            name = preprocess.find(name).name
        except ControlError as e:
            raise RequestError(f"--control-preprocessor: {e}") from None
        unit = ControlUnit(path, image, weight=weight, guidance_start=start, guidance_end=end, preprocessor=name,
                           mode=choice(fields.get("mode", "balanced"), CONTROL_MODES, "--control-mode"),
                           resize_mode=choice(fields.get("resize_mode", "crop-and-resize"), RESIZE_MODES,
                                              "--control-resize"),
                           hr_option=choice(fields.get("hr_option", "both"), HR_OPTIONS, "--control-hr-option"),
                           pixel_perfect=args.control_pixel_perfect, processor_res=res,
                           threshold_a=fields.get("threshold_a"), threshold_b=fields.get("threshold_b"))
        units.append(unit)
    return tuple(units)


def cmd_tokens(args) -> int:
    """``sdlite tokens PROMPT``: how sdlite reads a prompt, as JSON (parsed pieces, chunks, edit schedule)."""
    import json

    from .conditioning import chunk_prompt, single_row
    from .embeddings import EmbeddingDB, rewrite_tags_without_db
    from .loader import open_model
    from .prompts import describe, extract_networks, parse_attention

    model = resolve_model(args.model, args.prompt)
    ckpt = open_model(model)
    tokenizer = ckpt.tokenizer()
    db = EmbeddingDB.from_dir(args.embeddings, tokenizer, ckpt.spec.context_text.width) if args.embeddings else None
    text = db.rewrite_tags(args.prompt) if db is not None else rewrite_tags_without_db(args.prompt)
    info = describe(text, args.steps)
    stripped, _ = extract_networks(text)
    schedule = []
    for entry in info["schedule"]:
        if tokenizer.kind == "wordpiece":   # one row of the model's length (see sdlite.conditioning)
            chunks, count, _ = single_row(tokenizer, entry["text"])
        else:
            chunks, count = chunk_prompt(tokenizer, entry["text"], db)
        schedule.append({**entry, "parsed": [[t, w] for t, w in parse_attention(entry["text"])],
                         "token_count": count,
                         "chunks": [{"tokens": c.tokens, "text": tokenizer.decode(c.tokens),
                                     "prompt_tokens": c.length,
                                     "weights": c.multipliers,
                                     "embeddings": [{"position": p, "name": e.name, "vectors": len(e)}
                                                    for p, e in c.fixes]}
                                    for c in chunks]})
    out = {"prompt": args.prompt, "text": stripped, "networks": info["networks"], "parsed": info["parsed"],
           "schedule": schedule}
    print(json.dumps(out, indent=1 if args.pretty else None, ensure_ascii=False))
    return 0


def cmd_generate(args) -> int:
    from .pipeline import Engine, Request, RequestError, check_device, validate  # first: it imports torch fastest

    import torch

    from .engine.memory import check_memory_mode
    from .engine.precision import choose_precision
    from .images import FORMATS, check_writable, infotext, model_hash, output_paths, save_image
    from .sampling.samplers import img2img_start

    # the demo model with no size asked for: its 64x64 image is upscaled 4x by the shipped demo upscaler
    demo_upscale = (args.model is None and args.width is None and args.height is None and args.init_image is None
                    and args.hires is None and args.hires_size is None)
    args.model = resolve_model(args.model, args.prompt)
    opened = _resolve_turbo_defaults(args)   # the checkpoint's headers, when they were read to decide, for the load
    if args.refiner_switch is not None and args.refiner is None:
        raise RequestError("--refiner-switch needs a refiner: add --refiner PATH")
    if args.refiner is not None and not Path(args.refiner).exists():
        raise RequestError(f"--refiner {args.refiner}: no such file or folder")
    taesd = _vae_decoder_option(args.vae_decoder, args.model) if args.vae_decoder is not None else None
    # left out: the Request's defaults (A1111's)
    image_options = {name: value for name, value in (
        ("strength", args.strength), ("mask_blur", args.mask_blur), ("inpaint_fill", args.inpaint_fill),
        ("inpaint_area", args.inpaint_area), ("inpaint_padding", args.inpaint_padding),
        ("resize_mode", args.resize_mode)) if value is not None}
    request = Request(prompt=args.prompt, negative_prompt=args.negative, width=args.width, height=args.height,
                      steps=args.steps, cfg_scale=args.cfg, sampler=args.sampler, schedule=args.schedule,
                      seed=args.seed, batch_size=args.batch, clip_skip=args.clip_skip, eta=args.eta,
                      timestep_spacing=args.timestep_spacing, init_image=args.init_image, mask=args.mask,
                      mask_from_alpha=args.mask_from_alpha, invert_mask=args.invert_mask,
                      overlay=not args.no_overlay, outpaint=parse_outpaint(args.outpaint), **image_options,
                      loras=tuple(parse_lora(v) for v in args.lora), lora_dir=args.lora_dir,
                      embeddings_dir=args.embeddings, controls=control_units(args),
                      refiner_switch_at=(args.refiner_switch or DEFAULT_REFINER_SWITCH) if args.refiner else None,
                      **{name: value for name, value in (("aesthetic_score", args.aesthetic_score),
                                                         ("negative_aesthetic_score", args.negative_aesthetic_score))
                         if value is not None})
    hires = hires_option(args)
    if hires is not None:
        request = request.replace(hires=hires)
    # everything that can be checked before the (slow) model load is checked first
    validate(request)
    if hires is not None:
        check_upscaler_name(hires.upscaler, args.upscaler_dir, latent_ok=True)
    check_addons(request)
    _check_stray_options(args)
    if request.is_img2img:
        check_sources(request)
    if args.format not in FORMATS:
        raise RequestError(f"format {args.format!r} is not valid: expected one of {', '.join(FORMATS)}")
    if args.dtype is not None and args.dtype not in _DTYPES:
        raise RequestError(f"dtype {args.dtype!r} is not valid: expected one of fp32, fp16, bf16")
    device = check_device(args.device)
    check_memory_mode(args.memory_mode)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    # auto resolved, and a precision this CPU cannot run refused, before the load
    precision = choose_precision(args.precision, dtype, args.quantize, device)
    vae_tile = None
    if args.vae_tile is not None:
        if args.vae_tile != 0 and (args.vae_tile < 64 or args.vae_tile % 8):
            raise RequestError(f"VAE tile {args.vae_tile} is not valid: expected 0 (no tiling) or a multiple of 8 "
                               "of at least 64 image pixels, e.g. 512")
        vae_tile = args.vae_tile // 8
    if args.weight_dtype is not None and args.weight_dtype not in _DTYPES:
        raise RequestError(f"weight dtype {args.weight_dtype!r} is not valid: expected one of fp32, fp16, bf16")
    check_writable(args.output)
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    options = dict(device=str(device), precision=precision.requested, memory_mode=args.memory_mode,
                   weight_dtype=getattr(torch, _DTYPES[args.weight_dtype]) if args.weight_dtype else None,
                   vae_tile=vae_tile, prepack=False if args.no_prepack else None,
                   winograd=False if args.no_winograd else None, compile=args.compile)
    engine = Engine.load(opened or args.model, prediction_type=args.prediction_type, **options)
    extra_info = {}
    if args.refiner is not None:
        engine.set_refiner(Engine.load(args.refiner, **options))
        extra_info = {"Refiner": f"{_model_name(args.refiner)} [{model_hash(args.refiner)}]",
                      "Refiner switch at": request.refiner_switch_at}
    if taesd is not None:
        engine.set_vae_decoder(_vae_decoder_option(args.vae_decoder, taesd, engine.spec, device))
    engine.upscaler_dir = args.upscaler_dir
    load_s = time.perf_counter() - t0
    result = engine.generate(request, callback=ProgressBar())
    for w in result.warnings:
        print(f"sdlite: warning: {w}", file=sys.stderr)
    used = result.request
    if demo_upscale and not result.interrupted:
        from .upscalers.registry import demo_upscaler

        if demo_upscaler() is not None:
            from .upscalers.extras import Extras, postprocess

            t_up = time.perf_counter()
            upscaled = [postprocess(im, Extras(upscaler_1=demo_upscaler().stem, scale=4.0)) for im in result.images]
            result.images = [im for im, _ in upscaled]
            extra_info.update(upscaled[0][1])
            result.timings["upscale"] = time.perf_counter() - t_up
    mhash = model_hash(args.model)
    name = _model_name(args.model)
    paths = output_paths(args.output, len(result.images), args.format, result.seeds)
    written = []
    try:
        for image, seed, path in zip(result.images, result.seeds, paths):
            written.append(save_image(image, path, infotext(used, seed, mhash, name, {**result.infotext, **extra_info}),
                                      args.format))
    except BaseException:
        for path in written:  # no partial batch left behind
            path.unlink(missing_ok=True)
        raise
    t = result.timings
    mode = ""
    if used.is_img2img:
        kind = "outpainting" if used.outpaint else "inpainting" if used.is_inpaint else "img2img"
        mode = (f", {kind} strength {used.strength:g} ({used.steps - img2img_start(used.steps, used.strength)} "
                "steps run)")
    if used.hires is not None:
        big = result.images[0].size
        mode += f", hires {used.hires.upscaler} to {big[0]}x{big[1]} at denoise {used.hires.denoise:g}"
    print(f"seed {used.seed}" + (f" (images use {used.seed}..{used.seed + used.batch_size - 1})"
                                  if used.batch_size > 1 else "")
          + f", {used.width}x{used.height}, {used.steps} steps, {used.sampler} ({used.schedule}), "
            f"cfg {used.cfg_scale:g}{mode}; load {load_s:.1f}s, text {t['text']:.1f}s, "
            f"sampling {t['sampling']:.1f}s, decode {t['decode']:.1f}s"
          + (f", upscale {t['upscale']:.1f}s" if "upscale" in t else "")
          + (f"; upscaled to {result.images[0].width}x{result.images[0].height} by "
             f"{extra_info['Postprocess upscaler']}" if "Postprocess upscaler" in extra_info else ""),
          file=sys.stderr)
    for path in written:
        print(path)
    return 0


_HIRES_FLAGS = (("hires_upscaler", "--hires-upscaler"), ("hires_denoise", "--hires-denoise"),
                ("hires_steps", "--hires-steps"), ("hires_sampler", "--hires-sampler"), ("hires_cfg", "--hires-cfg"),
                ("hires_prompt", "--hires-prompt"), ("hires_negative", "--hires-negative"),
                ("hires_checkpoint", "--hires-checkpoint"))


def parse_wxh(text: str, flag: str) -> tuple[int, int]:
    """``WxH`` (either may be 0) -> (W, H)."""
    from .pipeline import RequestError

    try:
        w, h = (int(v) for v in text.lower().split("x"))
        if w >= 0 and h >= 0 and (w or h):
            return w, h
    except ValueError:
        pass
    raise RequestError(f"{flag} {text!r} is not valid: expected WIDTHxHEIGHT in pixels, e.g. 1024x768 (0 on one "
                       "side keeps the aspect)")


def hires_option(args):
    """The :class:`~sdlite.hires.Hires` of ``--hires`` / ``--hires-size`` and the other ``--hires-*`` flags."""
    from .hires import DEFAULT_DENOISE, DEFAULT_UPSCALER, Hires
    from .pipeline import RequestError

    if args.hires is None and args.hires_size is None:
        stray = [flag for dest, flag in _HIRES_FLAGS if getattr(args, dest) is not None]
        if stray:
            raise RequestError(f"{', '.join(stray)} need{'s' if len(stray) == 1 else ''} the hires fix: add --hires "
                               "SCALE or --hires-size WxH")
        return None
    if args.hires is not None and args.hires_size is not None:
        raise RequestError("give either --hires SCALE or --hires-size WxH, not both")
    if args.hires_checkpoint is not None and not Path(args.hires_checkpoint).exists():
        raise RequestError(f"--hires-checkpoint {args.hires_checkpoint}: no such file or folder")
    resize = parse_wxh(args.hires_size, "--hires-size") if args.hires_size else (0, 0)
    return Hires(scale=args.hires if args.hires is not None else 2.0, resize_x=resize[0], resize_y=resize[1],
                 upscaler=args.hires_upscaler or DEFAULT_UPSCALER, steps=args.hires_steps or 0,
                 denoise=DEFAULT_DENOISE if args.hires_denoise is None else args.hires_denoise,
                 sampler=args.hires_sampler, cfg_scale=args.hires_cfg, prompt=args.hires_prompt,
                 negative_prompt=args.hires_negative, checkpoint=args.hires_checkpoint)


def check_upscaler_name(name: str, folder, latent_ok: bool = False) -> None:
    """An upscaler name or file that cannot be found fails before the model load, naming what is available."""
    from .hires import LATENT_MODES
    from .pipeline import RequestError
    from .upscalers.registry import UpscalerError, resolve

    if latent_ok and name in LATENT_MODES:
        return
    try:
        resolve(name, folder)
    except UpscalerError as e:
        more = f" (or a latent mode: {', '.join(LATENT_MODES)})" if latent_ok else ""
        raise RequestError(f"{e}{more}") from None


def _upscale_output(output: str, source: Path, count: int) -> Path:
    """Where the upscale of ``source`` goes: into a folder (existing, or given with a trailing slash) as
    ``STEM-upscaled.png``, or to the file given (one input only); a name already taken gets ``-1``, ``-2`` ..."""
    from .images import _names_folder

    if _names_folder(output):
        target = Path(output) / f"{source.stem}-upscaled.png"
    elif count > 1:
        raise SDLiteError(f"--output {output} names one file, but {count} images were given: give a folder "
                          "(e.g. upscaled/)")
    else:
        target = Path(output) if Path(output).suffix else Path(output).with_suffix(".png")
    candidate, n = target, 1
    while candidate.exists():
        candidate = target.with_name(f"{target.stem}-{n}{target.suffix}")
        n += 1
    return candidate


def cmd_upscale(args) -> int:
    """``sdlite upscale``: A1111's extras upscale (an image upscaler: Lanczos, Nearest, an upscaler network), or the
    SD x4 upscaler with ``--model``; each output keeps the source's generation parameters and adds the
    "Postprocess ..." fields."""
    from .pipeline import RequestError, check_device  # first: it imports torch fastest

    from .images import check_writable, parameters_of, save_image
    from .sources import ImageInputError, load_image, to_rgb
    from .upscalers.extras import Extras, check, parameters_after, postprocess
    from .upscalers.registry import UpscalerError, network_scale

    device = check_device(args.device)
    precision = _check_precision_option(args, str(device))
    x4_flags = [flag for dest, flag in (("prompt", "--prompt"), ("negative", "--negative"),
                                        ("noise_level", "--noise-level"), ("steps", "--steps"), ("cfg", "--cfg"),
                                        ("sampler", "--sampler"), ("seed", "--seed"))
                if getattr(args, dest) is not None]
    if args.model is None and x4_flags:
        raise RequestError(f"{', '.join(x4_flags)} need{'s' if len(x4_flags) == 1 else ''} the SD x4 upscaler: "
                           "add --model X4_FOLDER")
    if args.model is not None and args.upscaler is not None:
        raise RequestError("give either --upscaler (an image upscaler) or --model (the SD x4 upscaler), not both")
    sources = []
    for name in args.images:
        try:
            sources.append((Path(name), load_image(name, "image")))
        except ImageInputError as e:
            raise RequestError(str(e)) from None
    check_writable(args.output)
    outputs = []
    if args.model is None:
        upscaler = args.upscaler or "Lanczos"
        try:
            scale = args.scale if args.scale is not None else (network_scale(upscaler, args.upscaler_dir) or 2.0)
            extras = check(Extras(upscaler_1=upscaler, scale=float(scale)), args.upscaler_dir)
        except UpscalerError as e:
            raise RequestError(f"--upscaler: {e}" if "upscaling_resize" not in str(e) else
                               f"--scale {args.scale}: a factor from 1 to 8") from None
        for path, image in sources:
            t0 = time.perf_counter()
            out, info = postprocess(image, extras, args.upscaler_dir, str(device))
            target = save_image(out, _upscale_output(args.output, path, len(sources)),
                                parameters_after(parameters_of(image), info))
            outputs.append(target)
            print(f"{path.name}: {image.width}x{image.height} -> {out.width}x{out.height} by "
                  f"{info['Postprocess upscaler']} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    else:
        from PIL.Image import Resampling

        from .upscalers.x4 import X4Upscaler

        LANCZOS = Resampling.LANCZOS
        if not Path(args.model).exists():
            raise RequestError(f"--model {args.model}: no such file or folder")
        t0 = time.perf_counter()
        model = X4Upscaler.load(args.model, device=str(device), precision=precision)
        print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s ({model.precision.label})", file=sys.stderr)
        x4_options = {k: v for k, v in (("prompt", args.prompt), ("negative_prompt", args.negative),
                                         ("noise_level", args.noise_level), ("steps", args.steps),
                                         ("cfg_scale", args.cfg), ("sampler", args.sampler), ("seed", args.seed))
                      if v is not None}
        for path, image in sources:
            result = model.upscale(to_rgb(image), callback=ProgressBar(), **x4_options)
            for w in result.warnings:
                print(f"sdlite: warning: {w}", file=sys.stderr)
            out = result.image
            info = {"Postprocess upscaler": f"SD x4 ({Path(args.model).name})", "Postprocess upscale by": 4,
                    **{f"x4 {k}": v for k, v in result.parameters().items() if k not in ("Size",)}}
            if result.prompt:
                info["x4 prompt"] = result.prompt
            if args.scale is not None and args.scale != 4:
                size = (int(image.width * args.scale), int(image.height * args.scale))
                out = out.resize(size, LANCZOS)
                info["Postprocess upscale by"] = args.scale
            target = save_image(out, _upscale_output(args.output, path, len(sources)),
                                parameters_after(parameters_of(image), info))
            outputs.append(target)
            print(f"{path.name}: {image.width}x{image.height} -> {out.width}x{out.height}, seed {result.seed}, "
                  f"{result.steps} steps, noise level {result.noise_level}; {result.timings.get('total', 0):.1f}s",
                  file=sys.stderr)
    for path in outputs:
        print(path)
    return 0


def _vae_decoder_option(value: str, path, spec=None, device="cpu"):
    """``--vae-decoder VALUE``: without ``spec``, the TAESD file or folder it names (checked before the model is
    loaded; the word ``taesd``: the one kept with the model at ``path``); with the model's ``spec``, the TAESD at
    ``path`` loaded for that model's latents."""
    from .weights.taesd import TAESDError, load_taesd, model_variant, resolve_taesd

    try:
        if spec is None:
            return resolve_taesd(value, path)
        return load_taesd(path, model_variant(spec), device=device)
    except TAESDError as e:
        raise SDLiteError(f"--vae-decoder {value}: {e}") from None


def _model_name(path: str) -> str:
    return Path(path).stem if Path(path).is_file() else Path(path).name


def _resolve_turbo_defaults(args):
    """Fill the sampling options the command line left unset (None): a Turbo model's settings with --turbo or when
    the model says it is one (its scheduler config or metadata; `sdlite info` shows it), A1111's otherwise.

    Returns the checkpoint opened (headers only) to find that out, for the load to use rather than open it again;
    None when it was not opened or could not be (the load then reports what is wrong with the model)."""
    unset = [key for key in TURBO_DEFAULTS if getattr(args, key) is None]
    turbo, ckpt = args.turbo, None
    if not turbo and unset:
        from .loader import open_model

        try:
            ckpt = open_model(args.model, prediction_type=args.prediction_type)
            turbo = ckpt.spec.turbo
        except SDLiteError:
            turbo = False
    for key in unset:
        setattr(args, key, (TURBO_DEFAULTS if turbo else PLAIN_DEFAULTS)[key])
    return ckpt


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise SDLiteError(f"sdlite serve needs FastAPI and uvicorn ({e.name} is not installed): "
                          "pip install 'sdlite[server]'") from None
    from .server.app import create_app, parse_auth
    from .server.limits import Limits, parse_size

    host = "0.0.0.0" if args.listen else args.host
    if not _is_loopback(host) and not args.api_auth and not args.insecure:
        raise SDLiteError(f"refusing to serve on {host} without authentication: give --api-auth USER:PASS "
                          "(HTTP Basic, as A1111), or --insecure to serve it open to the network anyway")
    if not 0 < args.port < 65536:
        raise SDLiteError(f"port {args.port} is not valid: expected 1..65535")
    if args.queue_size < 1:
        raise SDLiteError(f"queue size {args.queue_size} is not valid: it must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise SDLiteError(f"--threads {args.threads} is not valid: it must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.api_auth:
        try:
            parse_auth(args.api_auth)
        except ValueError as e:
            raise SDLiteError(str(e)) from None
    for option, path in (("--model", args.model), ("--models-dir", args.models_dir), ("--lora-dir", args.lora_dir),
                         ("--embeddings", args.embeddings), ("--taesd", args.taesd),
                         ("--upscaler-dir", args.upscaler_dir), ("--controlnet-dir", args.controlnet_dir)):
        if path is not None and not Path(path).exists():
            raise SDLiteError(f"{option} {path}: no such file or folder")
    if args.models_dir is not None and not Path(args.models_dir).is_dir():
        raise SDLiteError(f"--models-dir {args.models_dir}: not a folder")
    try:
        limits = Limits(max_pixels=parse_size(args.max_pixels), max_steps=args.max_steps, max_images=args.max_images,
                        max_prompt_chars=args.max_prompt_chars, job_timeout=args.job_timeout,
                        shutdown_grace=args.shutdown_grace, max_memory_mb=args.max_memory,
                        memory_margin_mb=args.memory_margin)
    except ValueError as e:
        raise SDLiteError(str(e)) from None
    precision = _check_precision_option(args, args.device)
    flags = {"listen": args.listen, "host": host, "port": args.port, "ckpt": args.model, "models_dir": args.models_dir,
             "lora_dir": args.lora_dir, "embeddings_dir": args.embeddings, "upscaler_dir": args.upscaler_dir,
             "controlnet_dir": args.controlnet_dir, "queue_size": args.queue_size,
             "device": args.device, "precision": precision, "nowebui": False}
    ray_options = [flag for flag, value in (("--address", args.address), ("--replicas", args.replicas),
                                            ("--autoscale", args.autoscale), ("--replica-cpus", args.replica_cpus),
                                            ("--replica-gpus", args.replica_gpus)) if value is not None]
    if ray_options and not args.ray:
        raise SDLiteError(f"{', '.join(ray_options)} need{'s' if len(ray_options) == 1 else ''} --ray")
    if args.ray:
        from .scale.ray_serve import serve_cli

        return serve_cli(args, host, flags, limits)
    try:
        app = create_app(model=args.model, models_dir=args.models_dir, api_auth=args.api_auth,
                         queue_size=args.queue_size, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                         engine_options={"device": args.device, "precision": precision, "taesd": args.taesd,
                                         "compile": args.compile},
                         flags=flags, limits=limits, upscaler_dir=args.upscaler_dir,
                         controlnet_dir=args.controlnet_dir)
    except FileNotFoundError as e:
        raise SDLiteError(str(e)) from None
    jobs = app.state.server.jobs
    GracefulServer = graceful_server_class()
    print(f"sdlite: serving the A1111 API on http://{host}:{args.port}/sdapi/v1 (web page: http://{host}:{args.port}/)"
          f"; {limits.describe()}", file=sys.stderr)
    server = GracefulServer(uvicorn.Config(app, host=host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=CONNECTIONS_WAIT_S),
                            drain=lambda: jobs.drain(limits.shutdown_grace),
                            stop_now=lambda: (jobs.close(), jobs.interrupt("stop")))
    server.run()
    status = 0 if server.started else 1
    if jobs.worker_alive():
        # a job still inside the engine (a shutdown at once, or one abandoned): the interpreter's own exit would
        # abort on the thread inside torch, so the process ends here, its answers sent and its output flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


CONNECTIONS_WAIT_S = 1.0   # after the jobs are answered: how long a shutdown waits for open connections to close


def graceful_server_class():
    """A uvicorn server that drains on SIGTERM. The first SIGTERM: new requests get 503 (``Retry-After``) and so do
    the queued ones, ``drain()`` gives the running job its grace and then interrupts it (its client gets the
    partial image), then the server stops with exit status 0. A second SIGTERM, or SIGINT at any time: queued
    jobs get 503, ``stop_now()`` interrupts the running one, and the process exits at once (status 0)."""
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        def __init__(self, config, drain, stop_now):
            super().__init__(config)
            self._drain, self._stop_now, self.draining = drain, stop_now, False

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.draining:
                self.draining = True
                threading.Thread(target=self._drain_then_exit, name="sdlite-drain", daemon=True).start()
                return
            # at once: no waiting for the job, the connections or the app's shutdown
            self._stop_now()
            self.should_exit = self.force_exit = True
            threading.Thread(target=_exit_soon, args=(EXIT_AT_ONCE_S,), daemon=True).start()

        def _drain_then_exit(self):
            print(f"sdlite: {SHUTDOWN_OUTCOMES[self._drain()]}; stopping", file=sys.stderr)
            self.should_exit = True

    # handle_exit records no signal, so uvicorn does not raise it again when it is done (which would end the
    # process with SIGTERM's status, or a KeyboardInterrupt, instead of 0)
    return GracefulServer


SHUTDOWN_OUTCOMES = {"idle": "shutting down: no job was running",
                     "interrupted": "shutting down: the running job was interrupted after the grace",
                     "abandoned": "shutting down: the running job did not stop in time; its client got a 503"}

EXIT_AT_ONCE_S = 2.0   # SIGINT / a second SIGTERM: the process ends within this, whatever is still running


def _exit_soon(seconds: float) -> None:
    import time

    time.sleep(seconds)
    sys.stderr.flush()
    os._exit(0)


def cmd_batch(args) -> int:
    from .scale.batch import run_batch

    ray_only = [flag for flag, value in (("--address", args.address), ("--workers", args.workers),
                                         ("--worker-cpus", args.worker_cpus), ("--worker-gpus", args.worker_gpus))
                if value is not None]
    if ray_only and not args.ray:
        raise SDLiteError(f"{', '.join(ray_only)} need{'s' if len(ray_only) == 1 else ''} --ray")
    engine_options = {"device": args.device} if args.device else {}
    engine_options["precision"] = _check_precision_option(args, args.device or "cpu")
    engine_options["compile"] = args.compile
    summary = run_batch(args.jobs, args.output, model=args.model, use_ray=args.ray, address=args.address,
                        workers=args.workers, threads=args.threads, engine_options=engine_options,
                        worker_cpus=args.worker_cpus if args.worker_cpus is not None else 1.0,
                        worker_gpus=args.worker_gpus or 0.0, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                        controlnet_dir=args.controlnet_dir, max_batch=args.max_batch,
                        shutdown_grace=args.shutdown_grace)
    for job_id, message in summary.failed.items():
        print(f"sdlite: job {job_id} failed: {message}", file=sys.stderr)
    where = f"{summary.workers} Ray worker{'s' if summary.workers != 1 else ''}" if args.ray else "locally"
    print(f"{summary.total} jobs: {summary.done} done now ({summary.images} images, {summary.images_per_min:.1f} "
          f"images/min, {where}), {summary.skipped} already in the manifest, {len(summary.failed)} failed; "
          f"manifest: {Path(args.output) / 'manifest.jsonl'}", file=sys.stderr)
    if summary.stopped:   # SIGTERM / SIGINT: a clean stop, exit status 0
        def jobs(n):
            return f"{n} job{'s' if n != 1 else ''}"

        interrupted = (f"; {summary.interrupted} interrupted after the grace and not written" if summary.interrupted
                       else "")
        print(f"sdlite: stopped by {summary.stopped}: {jobs(summary.done)} done by this run, "
              f"{summary.skipped + summary.done} of {summary.total} in the manifest{interrupted}; run the same "
              f"command again to resume (the {jobs(summary.remaining)} left)", file=sys.stderr)
    return 1 if summary.failed else 0


def _check_precision_option(args, device: str) -> str:
    """``--precision`` checked before anything starts (a name we know, and one this CPU can run); returns the name
    to hand to the engines ("auto" stays "auto": each machine resolves it for itself)."""
    from .engine.precision import check_precision, resolve

    name = check_precision(args.precision or "auto")
    resolve(name, device)
    return name


def add_compile_option(parser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="run the UNet through torch.compile: the first run of an image shape compiles (about a "
                             "minute for SD 1.5), later processes find it in the user's cache folder; eager, with one "
                             "line saying why, where it cannot. Opt-in: it measured no faster than eager on a CPU")


def add_precision_option(parser) -> None:
    parser.add_argument("--precision", default=None, metavar="P",
                        help="auto (default: bf16 on CPUs with native bf16, fp16 on a GPU, else exact), exact (fp32, the "
                             "diffusers-exact path), bf16, int8, int8-bf16 or fp16; `sdlite info --system` shows what "
                             "auto picks here and why")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdlite", description="Stable Diffusion inference, offline and lean.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="describe a checkpoint (family, layout, dtype, parameters, anything unusual)")
    p.add_argument("path", nargs="?", default=None,
                   help="a diffusers folder or a .safetensors/.ckpt single file (default: the shipped demo model)")
    p.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default=None,
                   help="override what the checkpoint says (SD 2.x single files)")
    p.add_argument("--system", action="store_true",
                   help="describe this machine instead (CPU, ISA flags and caps, torch, and the engine's choices: "
                        "prepacking, int8 activation range, quantize modes); with a PATH, the checkpoint too")
    p.set_defaults(func=cmd_info)

    g = sub.add_parser("generate", help="text to image, image to image, inpainting, outpainting")
    g.add_argument("prompt")
    g.add_argument("--model", "-m", default=None,
                   help="a diffusers folder or a .safetensors/.ckpt single file, or demo / demo-zh (default: the "
                        "shipped demo model; demo-zh, its Chinese text encoder, when the prompt has Chinese characters)")
    g.add_argument("--negative", "-n", default="", help="negative prompt")
    g.add_argument("--steps", type=int, default=None, help="default 20 (Turbo models: 1)")
    g.add_argument("--cfg", type=float, default=None,
                   help="classifier-free guidance scale (1 = off; default 7.5, Turbo models 1)")
    g.add_argument("--sampler", default=None,
                   help="see `sdlite samplers`; A1111 names work too (default: DPM++ 2M Karras; Turbo models: Euler a)")
    g.add_argument("--schedule", default=None,
                   help="sigma schedule: discrete, karras or exponential (default: what the sampler name implies)")
    g.add_argument("--timestep-spacing", default=None,
                   help="leading, linspace or trailing: where the sampler's timesteps fall (default: what the "
                        "model's scheduler config says, `sdlite info` shows it; Turbo models: trailing)")
    g.add_argument("--turbo", action="store_true",
                   help=f"use a Turbo model's settings where not given: {TURBO_DEFAULTS_TEXT} (automatic for "
                        "models recognised as SDXL-Turbo / SD-Turbo)")
    g.add_argument("--seed", type=int, default=-1, help="-1 = random (the seed used is printed)")
    g.add_argument("--width", type=int, default=None,
                   help="default: the model's native size; with --init-image the source's (rounded down to a multiple "
                        "of 8, plus any --outpaint borders). The shipped demo model with no size given draws 64x64 "
                        "and upscales it 4x with its demo upscaler (--width 64 for the plain image)")
    g.add_argument("--height", type=int, default=None, help="default: as for --width")
    g.add_argument("--batch", type=int, default=1, help="images; image i uses seed+i")
    g.add_argument("--clip-skip", type=int, default=1, help="1 = last text-encoder layer (A1111 numbering)")
    g.add_argument("--eta", type=float, default=None, help="noise of DDIM / ancestral / SDE samplers")
    g.add_argument("--output", "-o", default="outputs/", help="a file name, or a folder (numbered names)")
    g.add_argument("--format", default="png", help="png or jpg")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    g.add_argument("--dtype", default=None, help="(older form of --precision) fp32 (= exact), fp16 or bf16")
    g.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default=None)
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    g.add_argument("--memory-mode", type=int, default=1,
                   help="0 = low (sub-models loaded when needed, UNet weights streamed), 1 = all resident "
                        "(default, fastest), 2 = balanced (UNet resident)")
    add_precision_option(g)
    add_compile_option(g)
    g.add_argument("--quantize", default=None,
                   help="(older form of --precision) UNet weights: none, int8, int8-bf16 or bf16")
    g.add_argument("--vae-tile", type=int, default=None,
                   help="decode in tiles of this many image pixels (0 = never; default: tiles of 512 above 768 px, "
                        "in memory mode 0 tiles of 256 above 256 px)")
    g.add_argument("--vae-decoder", metavar="taesd|PATH", default=None,
                   help="decode the images with a TAESD (the tiny autoencoder) instead of the VAE: much faster, a "
                        "little less detail. PATH: a diffusers AutoencoderTiny folder, a taesd_decoder / "
                        "taesdxl_decoder file (.pth or .safetensors) or a folder of them; taesd: the one in the "
                        "model's folder, in its vae_tiny or taesd subfolder")
    g.add_argument("--weight-dtype", default=None,
                   help="keep resident weights in fp16/bf16 and compute in --dtype, block by block")
    g.add_argument("--no-prepack", action="store_true",
                   help="leave fp32 CPU weights in PyTorch's layout instead of reordering them once for oneDNN "
                        "(by default they are where this CPU gains from it: see `sdlite info --system`)")
    g.add_argument("--no-winograd", action="store_true",
                   help="run every 3x3 convolution directly; by default, with fp32 on the CPU, the UNet's and VAE's "
                        "large-map ones use Winograd's F(2x2,3x3): 1.3-1.6x faster, the same result to fp32 rounding")
    x = g.add_argument_group("SDXL")
    x.add_argument("--refiner", metavar="PATH", default=None,
                   help="an SDXL refiner that takes the latents over for the last steps (A1111's refiner)")
    x.add_argument("--refiner-switch", metavar="F", type=float, default=None,
                   help=f"the fraction of the steps the base runs before the refiner (default {DEFAULT_REFINER_SWITCH})")
    x.add_argument("--aesthetic-score", metavar="S", type=float, default=None,
                   help="the refiner's aesthetic score conditioning of the prompt (default 6)")
    x.add_argument("--negative-aesthetic-score", metavar="S", type=float, default=None,
                   help="... of the negative prompt (default 2.5)")
    a = g.add_argument_group("add-ons")
    a.add_argument("--lora", metavar="PATH[:WEIGHT]", action="append", default=[],
                   help="apply a LoRA (kohya/A1111 or diffusers/PEFT .safetensors) at WEIGHT (default 1); repeatable. "
                        "In the prompt, <lora:NAME:WEIGHT> does the same with NAME looked up in --lora-dir")
    a.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    a.add_argument("--embeddings", metavar="DIR", default=None,
                   help="textual-inversion embeddings (.pt/.safetensors): a prompt word equal to a file's stem, or "
                        "<embedding:NAME>, uses it")
    i = g.add_argument_group("image to image, inpainting, outpainting (defaults: A1111's)")
    i.add_argument("--init-image", metavar="PATH", default=None,
                   help="source image: image to image, or inpainting with a mask")
    i.add_argument("--strength", metavar="S", type=float, default=None,
                   help="how much of the source is repainted, above 0 up to 1 (runs int(steps x S) of the steps; "
                        "default 0.75)")
    i.add_argument("--mask", metavar="PATH", default=None,
                   help="inpainting mask: white = repaint, black = keep (a mask with transparency: opaque = repaint)")
    i.add_argument("--mask-from-alpha", action="store_true",
                   help="the init image's transparent pixels are the mask (repainted)")
    i.add_argument("--invert-mask", action="store_true", help="repaint what the mask leaves black instead")
    i.add_argument("--mask-blur", metavar="PX", type=int, default=None,
                   help="Gaussian blur of the mask's edge: its standard deviation in pixels (default 4)")
    i.add_argument("--inpaint-fill", metavar="FILL", default=None,
                   help="what the masked area starts from: original, fill (colours from around it), latent-noise, "
                        "latent-nothing (default: original; fill when outpainting)")
    i.add_argument("--inpaint-area", metavar="AREA", default=None,
                   help="whole: generate the whole picture; masked: only a crop around the mask, at the full size, "
                        "pasted back (default whole)")
    i.add_argument("--inpaint-padding", metavar="PX", type=int, default=None,
                   help="pixels kept around the mask's box with --inpaint-area masked (default 32)")
    i.add_argument("--no-overlay", action="store_true",
                   help="keep the generated pixels outside the mask too (default: the source is pasted back there)")
    i.add_argument("--outpaint", metavar="L,T,R,B", default=None,
                   help="extend the canvas by these many pixels left, top, right, bottom (multiples of 8, e.g. "
                        "64,0,64,0) and paint the new border")
    i.add_argument("--resize-mode", metavar="MODE", default=None,
                   help="fitting a source to another --width/--height: just-resize (stretch), crop (cover, crop the "
                        "overflow), fill (fit, fill the bands with the edge pixels) (default just-resize)")
    h = g.add_argument_group("hires fix (A1111's two-pass text to image)")
    h.add_argument("--hires", metavar="SCALE", type=float, default=None,
                   help="generate at the size asked, upscale by SCALE (e.g. 2), then repaint at that size")
    h.add_argument("--hires-size", metavar="WxH", default=None,
                   help="upscale to this size instead (A1111's hr_resize_x/y: 0 on one side keeps the aspect; both "
                        "set: fitted, then cropped)")
    h.add_argument("--hires-upscaler", metavar="NAME", default=None,
                   help="Latent (default), Latent (antialiased), Latent (bicubic), Latent (bicubic antialiased), "
                        "Latent (nearest), Latent (nearest-exact), None, Lanczos, Nearest, an upscaler network's name "
                        "(--upscaler-dir) or file")
    h.add_argument("--hires-denoise", metavar="F", type=float, default=None,
                   help="denoising strength of the second pass (default 0.7)")
    h.add_argument("--hires-steps", metavar="N", type=int, default=None,
                   help="second-pass steps (default: the first pass's); int(N x denoise) of them run")
    h.add_argument("--hires-sampler", metavar="NAME", default=None, help="second-pass sampler (default: the same)")
    h.add_argument("--hires-cfg", metavar="X", type=float, default=None, help="second-pass CFG scale (default: the same)")
    h.add_argument("--hires-prompt", metavar="TEXT", default=None, help="second-pass prompt (default: the same)")
    h.add_argument("--hires-negative", metavar="TEXT", default=None,
                   help="second-pass negative prompt (default: the same)")
    h.add_argument("--hires-checkpoint", metavar="PATH", default=None,
                   help="another model of the same family for the second pass")
    h.add_argument("--upscaler-dir", metavar="DIR", default=None,
                   help="where upscaler networks (.pth/.safetensors: ESRGAN, Real-ESRGAN, ...) are found by name")
    c = g.add_argument_group("ControlNet (A1111's ControlNet extension; defaults: its own)",
                             "The n-th of each --control-* flag goes with the n-th --controlnet; a flag given once "
                             "applies to every --controlnet.")
    c.add_argument("--controlnet", metavar="PATH", action="append", default=[],
                   help="a ControlNet: lllyasviel's .pth/.safetensors, a bare or diffusers-keyed file, or a diffusers "
                        "folder; demo-position: the shipped demo model's; repeatable (their residuals are summed)")
    c.add_argument("--control-image", metavar="PATH", action="append", default=[],
                   help="the control image (default: the --init-image)")
    c.add_argument("--control-weight", metavar="W", type=float, action="append", default=[],
                   help="the ControlNet's weight, 0 to 10 (default 1)")
    c.add_argument("--control-start", metavar="F", type=float, action="append", default=[],
                   help="the fraction of the steps where the control begins (default 0)")
    c.add_argument("--control-end", metavar="F", type=float, action="append", default=[],
                   help="the fraction of the steps where it ends (default 1)")
    c.add_argument("--control-preprocessor", metavar="NAME", action="append", default=[],
                   help="run on the control image first: none (default: the image is the control map), canny, "
                        "invert, threshold, scribble_xdog, tile_resample, blur_gaussian, inpaint")
    c.add_argument("--control-mode", metavar="MODE", action="append", default=[],
                   help="balanced (default); prompt: \"My prompt is more important\"; control: \"ControlNet is more "
                        "important\"")
    c.add_argument("--control-resize", metavar="MODE", action="append", default=[],
                   help="fitting the control image to the output: just-resize, crop-and-resize (default), "
                        "resize-and-fill")
    c.add_argument("--control-threshold-a", metavar="X", type=float, action="append", default=[],
                   help="the preprocessor's first parameter (canny: low threshold, 100; default: the preprocessor's)")
    c.add_argument("--control-threshold-b", metavar="X", type=float, action="append", default=[],
                   help="its second parameter (canny: high threshold, 200)")
    c.add_argument("--control-processor-res", metavar="PX", type=int, action="append", default=[],
                   help="the short side the preprocessor works at (default 512)")
    c.add_argument("--control-pixel-perfect", action="store_true",
                   help="every preprocessor works at the output's resolution instead of --control-processor-res")
    c.add_argument("--control-hr-option", metavar="WHICH", action="append", default=[],
                   help="with --hires: both (default), low-res-only or high-res-only passes are controlled")
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("upscale", help="upscale images: Lanczos, Nearest, an upscaler network (ESRGAN, Real-ESRGAN, "
                                       "the demo's), or the SD x4 upscaler (--model)")
    u.add_argument("images", nargs="+", metavar="IMAGE")
    u.add_argument("--upscaler", metavar="NAME|PATH", default=None,
                   help="Lanczos (default), Nearest, an upscaler network's name (--upscaler-dir; demo-4x: the shipped "
                        "demo's) or its .pth/.safetensors file")
    u.add_argument("--scale", metavar="F", type=float, default=None,
                   help="upscale by F (default: the network's own scale; 2 for Lanczos/Nearest; 4 for --model)")
    u.add_argument("--upscaler-dir", metavar="DIR", default=None, help="where upscaler networks are found by name")
    u.add_argument("--output", "-o", default="outputs/",
                   help="a folder (STEM-upscaled.png in it) or, for one image, a file name")
    u.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_precision_option(u)
    x4 = u.add_argument_group("the SD x4 upscaler (defaults: diffusers' for its pipeline)")
    x4.add_argument("--model", metavar="X4_FOLDER", default=None,
                    help="a stable-diffusion-x4-upscaler diffusers folder or x4-upscaler-ema.safetensors")
    x4.add_argument("--prompt", default=None, help="what the image shows (default: empty)")
    x4.add_argument("--negative", "-n", default=None, help="negative prompt")
    x4.add_argument("--noise-level", type=int, default=None, help="noise added to the input (default 20)")
    x4.add_argument("--steps", type=int, default=None, help="sampler steps (default 20)")
    x4.add_argument("--cfg", type=float, default=None, help="guidance scale (default 9)")
    x4.add_argument("--sampler", default=None, help="default: the model's scheduler (DDIM for the published folder)")
    x4.add_argument("--seed", type=int, default=None, help="-1 (default) = random; the seed used is printed")
    u.set_defaults(func=cmd_upscale)

    s = sub.add_parser("samplers", help="list the samplers, their default schedules and A1111 names")
    s.set_defaults(func=cmd_samplers)

    v = sub.add_parser("serve", help="an HTTP server with AUTOMATIC1111's /sdapi/v1 API (and a web page)")
    v.add_argument("--model", "-m", default=None,
                   help="the checkpoint to start with (default: the shipped demo model, or with --models-dir the "
                        "first checkpoint there)")
    v.add_argument("--models-dir", metavar="DIR", default=None,
                   help="checkpoints a client can list (/sd-models) and switch to (options sd_model_checkpoint)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=7860)
    v.add_argument("--listen", action="store_true",
                   help="bind 0.0.0.0 (every interface); needs --api-auth or --insecure")
    v.add_argument("--api-auth", metavar="USER:PASS", default=None,
                   help="HTTP Basic credentials for the API (several: USER:PASS,USER2:PASS2)")
    v.add_argument("--insecure", action="store_true", help="allow serving beyond this machine without --api-auth")
    v.add_argument("--queue-size", type=int, default=32,
                   help="jobs that may wait behind the running one; more get 503 with Retry-After (default 32)")
    v.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    v.add_argument("--embeddings", metavar="DIR", default=None, help="textual-inversion embeddings")
    v.add_argument("--upscaler-dir", metavar="DIR", default=None,
                   help="upscaler networks (.pth/.safetensors: ESRGAN, Real-ESRGAN, ...) for the hires fix and the "
                        "extras, by file stem")
    v.add_argument("--controlnet-dir", metavar="DIR", default=None,
                   help="ControlNet models (files and diffusers folders) for A1111's ControlNet units "
                        "(alwayson_scripts), named by file stem or folder name, as /controlnet/model_list lists them")
    v.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_precision_option(v)
    add_compile_option(v)
    v.add_argument("--taesd", metavar="PATH", default=None,
                   help="TAESDs for the 'TAESD' live previews (option show_progress_type): a folder of "
                        "taesd_decoder / taesdxl_decoder files (A1111's models/VAE-approx), one such file, or a "
                        "diffusers AutoencoderTiny folder; each model uses the one for its latents")
    v.add_argument("--threads", type=int, default=None,
                   help="CPU threads for generation (default: PyTorch's; 1 is fastest for the tiny demo model)")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (debug also logs every request)")
    lim = v.add_argument_group("limits (each refusal is a 422 naming the field, its value and the limit; see "
                               "docs/server.md)")
    lim.add_argument("--max-pixels", metavar="N|WxH", default="2048x2048",
                     help="width x height of one image at most (default 2048x2048)")
    lim.add_argument("--max-steps", metavar="N", type=int, default=150, help="sampler steps at most (default 150)")
    lim.add_argument("--max-images", metavar="N", type=int, default=16,
                     help="images a request at most, batch_size x n_iter (default 16)")
    lim.add_argument("--max-prompt-chars", metavar="N", type=int, default=10_000,
                     help="characters of a prompt or negative prompt at most (default 10000)")
    lim.add_argument("--job-timeout", metavar="S", type=float, default=0.0,
                     help="seconds a job may run; past it, it is interrupted and its client gets the partial image "
                          "with a warning (default 0: no limit)")
    lim.add_argument("--max-memory", metavar="MB", type=int, default=0,
                     help="the most memory the server may use; a job whose estimated peak does not fit in what is "
                          "free now gets 503, one that never could 422 (default 0: the machine's or its cgroup's)")
    lim.add_argument("--memory-margin", metavar="MB", type=int, default=0,
                     help="memory kept free beside every job (default 0: 5%% of the memory, at least 256 MB)")
    lim.add_argument("--shutdown-grace", metavar="S", type=float, default=30.0,
                     help="on SIGTERM, seconds the running job has to finish before it is interrupted (default 30)")
    r = v.add_argument_group("on a Ray cluster (the ray extra; see docs/scaling.md)")
    r.add_argument("--ray", action="store_true", help="serve with Ray Serve: the same API, one engine per replica")
    r.add_argument("--address", default=None,
                   help="the Ray cluster: auto (the one this machine belongs to), HOST:PORT or ray://HOST:PORT "
                        "(default: start a Ray instance on this machine)")
    r.add_argument("--replicas", type=int, default=None, help="generator replicas, one engine each (default 1)")
    r.add_argument("--autoscale", metavar="MIN,MAX", default=None,
                   help="let Ray Serve scale the replicas between MIN and MAX with the load (instead of --replicas)")
    r.add_argument("--replica-cpus", type=float, default=None, help="CPUs reserved per replica (default 1)")
    r.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default 0); above 0 the replicas run on CUDA in fp16")
    v.set_defaults(func=cmd_serve)

    b = sub.add_parser("batch", help="generate every job of a JSONL file into a folder, resumably (locally or "
                                     "on a Ray cluster)")
    b.add_argument("jobs", metavar="JOBS.jsonl",
                   help="one job per line: the API's txt2img fields or the Python Request's, plus an optional id")
    b.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="where the images and manifest.jsonl go; jobs already in the manifest are skipped")
    b.add_argument("--model", "-m", default=None, help="the checkpoint for every job (default: the demo model)")
    b.add_argument("--ray", action="store_true", help="run over a pool of Ray actors, each loading the model once")
    b.add_argument("--address", default=None,
                   help="with --ray: auto, HOST:PORT or ray://HOST:PORT (default: a Ray instance on this machine)")
    b.add_argument("--workers", type=int, default=None,
                   help="with --ray: actors (default: the cluster's CPUs / --worker-cpus)")
    b.add_argument("--worker-cpus", type=float, default=None, help="with --ray: CPUs per actor (default 1)")
    b.add_argument("--worker-gpus", type=float, default=None,
                   help="with --ray: GPUs per actor (default 0); above 0 the actors run on CUDA in fp16")
    b.add_argument("--max-batch", type=int, default=4,
                   help="jobs differing only in consecutive seeds run as one batch of up to this many (default 4; "
                        "1: never)")
    b.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C no new job starts and the running ones get this long to finish before "
                        "they are interrupted (not written: they run again on resume); then exit 0 (default 30; "
                        "0: interrupt at once). A second signal exits at once")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads per process / actor (default: PyTorch's locally, --worker-cpus with --ray)")
    b.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default cpu)")
    add_precision_option(b)
    add_compile_option(b)
    b.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    b.add_argument("--embeddings", metavar="DIR", default=None, help="textual-inversion embeddings")
    b.add_argument("--controlnet-dir", metavar="DIR", default=None,
                   help="where ControlNet models named in the jobs' units are found (else they name paths)")
    b.set_defaults(func=cmd_batch)

    t = sub.add_parser("tokens", help="how a prompt is read, as JSON: parsed (text, weight) pieces, 75-token "
                                      "chunks with their token ids, prompt edits per step, LoRA tags")
    t.add_argument("prompt")
    t.add_argument("--model", "-m", default=None, help="whose tokenizer (default: the shipped demo model, demo-zh for "
                   "a prompt with Chinese characters)")
    t.add_argument("--steps", type=int, default=20, help="for the schedule of prompt edits")
    t.add_argument("--embeddings", metavar="DIR", default=None)
    t.add_argument("--pretty", action="store_true", help="indent the JSON")
    t.set_defaults(func=cmd_tokens)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SDLiteError as e:
        print(f"sdlite: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdlite: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
