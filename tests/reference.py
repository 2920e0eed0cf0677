"""Builders of the reference implementations (diffusers / transformers) from our configs, random weights.

Nothing here downloads anything: every reference model is constructed from a config dict.
"""
from __future__ import annotations

import weakref

import torch

from sdlite.config import TextEncoderConfig, UNetConfig, VAEConfig

# Tiny configs for every variant (channels like 32/64), as diffusers' own tests use.
TINY_TEXT_SD1 = TextEncoderConfig(vocab_size=1000, width=32, layers=3, heads=4, mlp_width=37)
TINY_TEXT_SD2 = TextEncoderConfig(vocab_size=1000, width=32, layers=3, heads=4, mlp_width=64,
                                  activation="gelu", pad_token_id=0)
TINY_UNET_SD1 = UNetConfig(block_channels=(32, 64), layers_per_block=2, attention=(True, False),
                           heads=(2, 2), context_dim=32, sample_size=16)
TINY_UNET_SD2 = UNetConfig(block_channels=(32, 64), layers_per_block=2, attention=(True, True),
                           heads=(2, 4), context_dim=32, linear_projection=True, sample_size=16)
TINY_UNET_INPAINT = UNetConfig(in_channels=9, block_channels=(32, 64), layers_per_block=1,
                               attention=(False, True), heads=(2, 2), context_dim=32, sample_size=16)
TINY_VAE = VAEConfig(block_channels=(32, 64), layers_per_block=1, sample_size=32)


def seed_all(module: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> torch.nn.Module:
    """Deterministic random weights, biases and norms included (so nothing sits at its neutral init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.state_dict().items()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def diffusers_unet(cfg: UNetConfig):
    from diffusers import UNet2DConditionModel

    d = cfg.to_diffusers()
    d.pop("_class_name")
    return UNet2DConditionModel(**d).eval()


def diffusers_vae(cfg: VAEConfig):
    from diffusers import AutoencoderKL

    d = cfg.to_diffusers()
    d.pop("_class_name")
    return AutoencoderKL(**d).eval()


def transformers_text(cfg: TextEncoderConfig):
    from transformers import CLIPTextConfig, CLIPTextModel

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    model = CLIPTextModel(CLIPTextConfig(**d, attn_implementation="eager")).eval()
    return model


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: the figure the issues hold us to."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# --- whole pipelines -----------------------------------------------------------------------------------------

# Text encoders at tiny width but with the real 49408-token vocabulary, so real prompts tokenize.
TINY_TEXT_SD1_FULLVOCAB = TextEncoderConfig(width=32, layers=3, heads=4, mlp_width=37, projection_dim=32)
TINY_TEXT_SD2_FULLVOCAB = TextEncoderConfig(width=32, layers=3, heads=4, mlp_width=64, activation="gelu",
                                            pad_token_id=0, projection_dim=32)


def write_hf_tokenizer_files(folder, pad_token: str = "<|endoftext|>"):
    """vocab.json / merges.txt / special tokens derived from the merge list shipped in the package."""
    import gzip
    import json
    from importlib import resources
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = resources.files("sdlite").joinpath("data/clip/bpe_simple_vocab_16e6.txt.gz").read_bytes()
    merges = gzip.decompress(raw).decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_chars = [chr(c) for c in cs]
    vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n",
                                       encoding="utf-8")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": pad_token}
    (folder / "special_tokens_map.json").write_text(json.dumps(special), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({**special, "model_max_length": 77}), encoding="utf-8")
    return folder


# A tiny SD 1.x model whose head counts follow the family conventions (UNet: 8 heads; text: 64-wide heads), as
# a single file without config metadata (every real one) must be read by shapes and conventions alone.
CONVENTIONAL_TEXT_SD1 = TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=96, projection_dim=64)
CONVENTIONAL_UNET_SD1 = UNetConfig(block_channels=(32, 64), layers_per_block=1, attention=(True, False),
                                   heads=(8, 8), context_dim=64, sample_size=16)


def diffusers_pipeline(family: str = "sd1", tmp_path=None, prediction_type: str = "epsilon", seed: int = 0,
                       conventional: bool = False):
    """A tiny diffusers StableDiffusionPipeline (random weights, real tokenizer) built from local configs."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    from transformers import CLIPTokenizer

    unet_cfg = {"sd1": TINY_UNET_SD1, "sd2": TINY_UNET_SD2, "sd1-inpaint": TINY_UNET_INPAINT}[family]
    text_cfg = TINY_TEXT_SD2_FULLVOCAB if family == "sd2" else TINY_TEXT_SD1_FULLVOCAB
    if conventional:
        assert family == "sd1"
        unet_cfg, text_cfg = CONVENTIONAL_UNET_SD1, CONVENTIONAL_TEXT_SD1
    torch.manual_seed(seed)
    unet = seed_all(diffusers_unet(unet_cfg), seed, scale=0.05)
    vae = seed_all(diffusers_vae(TINY_VAE), seed + 1, scale=0.05)
    text = seed_all(transformers_text(text_cfg), seed + 2, scale=0.2)
    tok_dir = write_hf_tokenizer_files(tmp_path / "hf_tokenizer", pad_token="!" if family == "sd2" else "<|endoftext|>")
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir))
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, set_alpha_to_one=False, skip_prk_steps=True,
                              steps_offset=1, prediction_type=prediction_type)
    return StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def with_contrast(pipe, gain: float = 30.0):
    """Scale the VAE decoder's output layer so the tiny random model's images span the 8-bit range (std about 70
    instead of 4): at 4, two different schedules can give PNGs within 2/255 of each other, and a pixel test
    could not tell them apart."""
    with torch.no_grad():
        pipe.vae.decoder.conv_out.weight.mul_(gain)
    return pipe


def saved_pipeline(pipe, folder):
    """``pipe`` saved by diffusers and loaded back: the reference for what sdlite reads from that folder.

    diffusers writes a scheduler field it filled with its class default (``timestep_spacing``) into the file, so
    the reloaded pipeline keeps it when its scheduler is swapped, where the in-memory one falls back to the new
    class's default."""
    from diffusers import StableDiffusionPipeline

    pipe.save_pretrained(folder)
    return StableDiffusionPipeline.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False)


# our sampler name -> (diffusers scheduler class, its extra config)
SCHEDULERS = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2,
                                                         "use_karras_sigmas": True}),
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
}
# more of them, for the image-to-image tests
MORE_SCHEDULERS = {
    "heun": ("HeunDiscreteScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {"solver_type": "bh2", "solver_order": 2}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "ddpm": ("DDPMScheduler", {}),
}

_BASE_SCHEDULERS = weakref.WeakKeyDictionary()   # pipeline -> its own scheduler config (not keeping it alive)


def use_scheduler(pipe, sampler: str, spacing: str | None = None):
    """Give ``pipe`` the diffusers scheduler that our ``sampler`` follows, built from the pipeline's own
    scheduler config (plus ``timestep_spacing=spacing`` when given)."""
    import diffusers

    cls, extra = {**SCHEDULERS, **MORE_SCHEDULERS}[sampler]
    # Each swap starts from the pipeline's own scheduler config: a swapped-in scheduler lists the fields it
    # defaulted (``_use_default_values``), and the next from_config would drop them even when given explicitly
    # (use_karras_sigmas=True after Euler, say).
    if pipe not in _BASE_SCHEDULERS:
        _BASE_SCHEDULERS[pipe] = dict(pipe.scheduler.config)
    base = _BASE_SCHEDULERS[pipe]
    # real SD folders' scheduler configs say clip_sample: false (DDIM/DDPM would otherwise default to true)
    config = {**base, "clip_sample": False, **extra}
    if spacing is not None:
        config["timestep_spacing"] = spacing
        # a field listed as defaulted would be dropped by from_config, the spacing given here with it
        config["_use_default_values"] = [k for k in config.get("_use_default_values", []) if k != "timestep_spacing"]
    pipe.scheduler = getattr(diffusers, cls).from_config(config)
    return pipe


# --- full-size folders ---------------------------------------------------------------------------------------

def write_sd15_folder(folder):
    """A full-size SD 1.5 diffusers folder at ``folder`` (fp32, random weights at the real shapes: PyTorch's default
    initialisation after ``torch.manual_seed(0)``), written by sdlite. The tests' session fixture and
    bench/parity.py build it alike."""
    from pathlib import Path

    from sdlite.config import SD15
    from sdlite.export import save_diffusers
    from sdlite.loader import StableDiffusion
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer

    folder = Path(folder)
    torch.manual_seed(0)
    model = StableDiffusion(spec=SD15, tokenizer=CLIPTokenizer.from_package(), text_encoder=CLIPTextEncoder(SD15.text),
                            unet=UNet(SD15.unet), vae=AutoencoderKL(SD15.vae), scheduler_config=dict(SD15.scheduler))
    save_diffusers(model, folder)
    del model
    return folder


def write_sd15_inpaint_folder(sd15_folder, folder):
    """A full-size SD 1.5 inpainting diffusers folder (9-channel UNet) at ``folder``, made from ``sd15_folder``: its
    text encoder, VAE, tokenizer and scheduler are shared through symlinks, and its UNet is the same but for a
    9-channel ``conv_in``, stored in fp16 (half the size to write; both readers up-cast)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    sd15_folder, folder = Path(sd15_folder), Path(folder)
    folder.mkdir(parents=True)
    for sub in ("text_encoder", "vae", "tokenizer", "scheduler"):
        (folder / sub).symlink_to(sd15_folder.resolve() / sub, target_is_directory=True)
    (folder / "model_index.json").write_text((sd15_folder / "model_index.json").read_text())
    (folder / "unet").mkdir()
    config = json.loads((sd15_folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "in_channels": 9}))
    state = load_file(sd15_folder / "unet" / "diffusion_pytorch_model.safetensors")
    weight = state["conv_in.weight"]
    extra = torch.randn(weight.shape[0], 5, *weight.shape[2:], generator=torch.Generator().manual_seed(9))
    state["conv_in.weight"] = torch.cat([weight, extra * weight.std()], dim=1)
    save_file({k: v.half().contiguous() for k, v in state.items()},
              folder / "unet" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    del state
    return folder


# --- LoRA files and diffusers' fused LoRAs (the transformer families' LoRA tests) -----------------------------

LORA_RANK, LORA_ALPHA = 4, 2.0
LORA_SEEDS = (21, 22)   # diffusers' generators for a batch of 2, as sdlite's seed 21 seeds its two images


def lora_factors(modules, seed: int, shares: dict[str, str] | None = None, strength: float = 0.6,
                 rank: int = LORA_RANK) -> dict:
    """Module path -> (down (rank, in), up (out, rank)) for every Linear of ``modules`` ((name, module) pairs, drawn
    in their order from ``seed``). A layer whose last name is a key of ``shares`` takes the down factor of its sibling
    named by the value (q, k and v of an attention sharing one, so that a stacked qkv holds them); those come last."""
    shares = shares or {}
    shapes = {name: tuple(m.weight.shape) for name, m in modules if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, cols) in sorted(shapes.items(), key=lambda item: item[0].rpartition(".")[2] in shares):
        head, _, leaf = name.rpartition(".")
        if leaf in shares:
            down = out[f"{head}.{shares[leaf]}"][0]
        else:
            down = torch.randn(rank, cols, generator=g) / cols ** 0.5
        out[name] = (down, torch.randn(rows, rank, generator=g) * strength / rank ** 0.5)
    return out


def under(prefix: str, layers: dict) -> dict:
    """``layers`` with ``prefix`` before each name."""
    return {prefix + name: f for name, f in layers.items()}


def underscored(layers: dict) -> dict:
    """``layers`` on kohya's names: ``lora_unet_`` and the module path with its dots as underscores."""
    return {"lora_unet_" + name.replace(".", "_"): f for name, f in layers.items()}


def factors_on(to_names, factors: dict) -> dict:
    """The same ``factors`` on the names of another layout: ``to_names`` (diffusers' keys -> the plan that makes that
    layout's tensors of them: ``flux2_to_original``, ``zimage_to_comfy``). A stacked layer (q, k and v as one ``qkv``)
    takes its parts' ups stacked under their one shared down; a modulation whose halves the layout exchanges, its
    up's halves exchanged."""
    out = {}
    for target, entry in to_names([f"{name}.weight" for name in factors]).entries.items():
        names = [source.removesuffix(".weight") for source in entry.sources]
        down = factors[names[0]][0]
        if entry.transform.op == "cat":
            assert all(factors[n][0] is down for n in names), names
        up = torch.cat([factors[n][1] for n in names])
        if entry.transform.op == "swap_halves":
            half = up.shape[0] // 2
            up = torch.cat([up[half:], up[:half]])
        out[target.removesuffix(".weight")] = (down, up)
    return out


def write_lora(path, layers: dict, parts: str = "lora_A", alpha: float | None = LORA_ALPHA,
               metadata: dict | None = None) -> str:
    """``layers``: the file's name of a layer -> (down, up), written to ``path`` with ``lora_A``/``lora_B`` or
    (``parts`` "lora_down") ``lora_down``/``lora_up`` and an ``.alpha`` key each (none when ``alpha`` is None)."""
    from safetensors.torch import save_file

    down_part, up_part = ("lora_A", "lora_B") if parts == "lora_A" else ("lora_down", "lora_up")
    state = {}
    for name, (down, up) in layers.items():
        state[f"{name}.{down_part}.weight"] = down.clone()
        state[f"{name}.{up_part}.weight"] = up.clone()
        if alpha is not None:
            state[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(state, str(path), metadata=metadata)
    return str(path)


def peft_metadata(names, rank: int = LORA_RANK, alpha: float = LORA_ALPHA) -> dict:
    """The safetensors metadata diffusers writes for a PEFT LoRA of the transformer's ``names``: its adapter config."""
    import json

    from sdlite.adapters import lora as L

    config = {"transformer.r": rank, "transformer.lora_alpha": alpha, "transformer.alpha_pattern": {},
              "transformer.rank_pattern": {}, "transformer.use_dora": False, "transformer.use_rslora": False,
              "transformer.peft_type": "LORA", "transformer.target_modules": sorted(names)}
    return {"format": "pt", L.METADATA_KEY: json.dumps(config)}


def lora_files(folder, factors: dict) -> dict[str, str]:
    """The LoRA of ``factors`` (diffusers' module paths) in ``folder`` in the layouts every transformer family reads
    alike: diffusers / PEFT ``transformer.*`` with the alpha in the metadata ("peft"), ComfyUI's and ai-toolkit's
    ``diffusion_model.*`` with ``.alpha`` keys ("diffusion_model"), kohya's ``lora_unet_`` ("kohya")."""
    return {"peft": write_lora(folder / "peft.safetensors", under("transformer.", factors), alpha=None,
                               metadata=peft_metadata(factors)),
            "diffusion_model": write_lora(folder / "ai_toolkit.safetensors", under("diffusion_model.", factors)),
            "kohya": write_lora(folder / "kohya.safetensors", underscored(factors), parts="lora_down")}


def fused_lora_images(pipe, prompt: str, size: int, path=None, weight: float = 0.8, **call):
    """A diffusers pipeline's batch of 2 (3 steps, ``size`` x ``size``, the :data:`LORA_SEEDS`; ``call``: more of the
    call's arguments) with the LoRA at ``path`` loaded and fused into the transformer at ``weight`` (none: without a
    LoRA), as 8-bit values (int16). The pipeline is left without the LoRA."""
    import numpy as np

    kw = dict(prompt=prompt, num_inference_steps=3, num_images_per_prompt=2, height=size, width=size,
              output_type="np", **call)
    generators = [torch.Generator().manual_seed(s) for s in LORA_SEEDS]
    if path is None:
        out = pipe(generator=generators, **kw).images
    else:
        pipe.load_lora_weights(path, adapter_name="style")
        try:
            pipe.fuse_lora(lora_scale=weight, adapter_names=["style"], components=["transformer"])
            out = pipe(generator=generators, **kw).images
        finally:
            pipe.unfuse_lora(components=["transformer"])
            pipe.unload_lora_weights()
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def lora_and_base(pipe, prompt: str, size: int, path, weight: float, least: float, **call) -> tuple:
    """(:func:`fused_lora_images` with the LoRA at ``path``, and without it), the LoRA asserted to change the images
    by more than ``least`` (out of 255) on average."""
    import numpy as np

    base = fused_lora_images(pipe, prompt, size, None, weight, **call)
    with_lora = fused_lora_images(pipe, prompt, size, path, weight, **call)
    assert np.abs(with_lora - base).mean() > least, "the LoRA should change the image clearly"
    return with_lora, base


def lora_request(prompt: str, size: int, /, **kw):
    """sdlite's request for :func:`fused_lora_images`' images: 3 Euler steps without guidance, batch 2, seed 21
    (``kw``: other fields, or these replaced, the prompt too)."""
    from sdlite.pipeline import Request

    return Request(**{"prompt": prompt, "steps": 3, "cfg_scale": 1.0, "sampler": "euler", "seed": LORA_SEEDS[0],
                      "batch_size": 2, "width": size, "height": size, **kw})


def comfy_wrapped(x: torch.Tensor) -> torch.Tensor:
    """A latent (..., h, w) with an odd side padded as ComfyUI's ``pad_to_patch_size`` pads it before 2 x 2 patches
    (circular, one row at the bottom, one column at the right), by PyTorch's own padding, and checked to be that: the
    added row is row 0, the added column column 0. The reference input for sdlite's odd-latent tests."""
    import torch.nn.functional as F

    h, w = x.shape[-2:]
    wrapped = F.pad(x, (0, w % 2, 0, h % 2), mode="circular")
    if h % 2:
        assert torch.equal(wrapped[..., h, :w], x[..., 0, :])
    if w % 2:
        assert torch.equal(wrapped[..., :h, w], x[..., :, 0])
    return wrapped
