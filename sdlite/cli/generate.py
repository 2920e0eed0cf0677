"""``sdlite generate``: text to image, image to image, inpainting, outpainting, with the hires fix, an SDXL refiner,
LoRAs, embeddings and ControlNets; the images are written with A1111's generation parameters."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..errors import SDLiteError
from .controlnet import add_controlnet_arguments, control_units
from .hires import add_hires_arguments, check_upscaler_name, hires_option
from .img2img import add_img2img_arguments, check_sources, check_stray_options, parse_outpaint
from .options import (PLAIN_DEFAULTS, TURBO_DEFAULTS, TURBO_DEFAULTS_TEXT, add_compile_option, add_precision_option,
                      check_list_steps, parse_numbers, resolve_model)
from .progress import ProgressBar


DEFAULT_REFINER_SWITCH = 0.8   # A1111's "Refiner switch at" default

_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
           "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_lora(text: str) -> tuple[str, float]:
    """``--lora PATH[:WEIGHT]`` -> (path, weight); the weight defaults to 1 (a path may itself hold colons: only a
    number after the last one is a weight)."""
    from ..pipeline import RequestError

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
    from ..pipeline import RequestError

    for path, _ in request.loras:
        if not os.path.isfile(path):
            raise RequestError(f"LoRA {path}: " + ("is a directory, not a LoRA file" if os.path.isdir(path)
                                                   else "no such file"))
    for folder, what in ((request.lora_dir, "--lora-dir"), (request.embeddings_dir, "--embeddings")):
        if folder is not None and not os.path.isdir(folder):
            raise RequestError(f"{what} {folder}: not a folder")


def cmd_generate(args) -> int:
    from ..pipeline import Engine, Request, RequestError, check_device, validate  # first: it imports torch fastest

    import torch

    from ..engine.memory import check_memory_mode
    from ..engine.precision import choose_precision
    from ..images import FORMATS, check_writable, infotext, model_hash, output_paths, save_image
    from ..sampling.samplers import img2img_start

    # the demo model with no size asked for: its 64x64 image is upscaled 4x by the shipped demo upscaler
    demo_upscale = (args.model is None and args.width is None and args.height is None and args.init_image is None
                    and not args.ref_image
                    and args.hires is None and args.hires_size is None)
    args.model = resolve_model(args.model, args.prompt)
    args.timesteps = parse_numbers("--timesteps", args.timesteps, integers=True)
    args.sigmas = parse_numbers("--sigmas", args.sigmas)
    check_list_steps(args)
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
                      noise=args.noise, seed=args.seed, batch_size=args.batch, clip_skip=args.clip_skip, eta=args.eta,
                      timestep_spacing=args.timestep_spacing, timesteps=args.timesteps, sigmas=args.sigmas,
                      init_image=args.init_image, mask=args.mask, reference_images=tuple(args.ref_image),
                      reference_resize=not args.no_ref_resize,
                      mask_from_alpha=args.mask_from_alpha, invert_mask=args.invert_mask,
                      overlay=not args.no_overlay, outpaint=parse_outpaint(args.outpaint), **image_options,
                      loras=tuple(parse_lora(v) for v in args.lora), lora_dir=args.lora_dir,
                      embeddings_dir=args.embeddings, controls=control_units(args),
                      refiner_switch_at=(args.refiner_switch or DEFAULT_REFINER_SWITCH) if args.refiner else None,
                      slg_layers=_parse_layers(args.slg), slg_scale=args.slg_scale, slg_start=args.slg_start,
                      slg_stop=args.slg_stop, guidance=args.guidance, **_cache_option(args.cache),
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
    check_stray_options(args)
    if request.is_img2img or request.reference_images:
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
    engine = Engine.load(opened or args.model, prediction_type=args.prediction_type,
                         text_encoders=args.text_encoder or (), **options)
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
        from ..upscalers.registry import demo_upscaler

        if demo_upscaler() is not None:
            from ..upscalers.extras import Extras, postprocess

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
        run = used.steps - img2img_start(used.steps, used.strength, engine.schedule)
        mode = f", {kind} strength {used.strength:g} ({run} steps run)"
    if used.hires is not None:
        big = result.images[0].size
        mode += f", hires {used.hires.upscaler} to {big[0]}x{big[1]} at denoise {used.hires.denoise:g}"
    print(f"seed {used.seed}" + (f" (images use {used.seed}..{used.seed + used.batch_size - 1})"
                                  if used.batch_size > 1 else "")
          + f", {used.width}x{used.height}, {used.steps} steps, {used.sampler} ({used.schedule}), "
            f"cfg {used.cfg_scale:g}{mode}; load {load_s:.2f}s, text {t['text']:.2f}s, "
            f"sampling {t['sampling']:.2f}s, decode {t['decode']:.2f}s"
          + (f", upscale {t['upscale']:.2f}s" if "upscale" in t else "")
          + (f"; upscaled to {result.images[0].width}x{result.images[0].height} by "
             f"{extra_info['Postprocess upscaler']}" if "Postprocess upscaler" in extra_info else ""),
          file=sys.stderr)
    for path in written:
        print(path)
    return 0


def _vae_decoder_option(value: str, path, spec=None, device="cpu"):
    """``--vae-decoder VALUE``: without ``spec``, the TAESD file or folder it names (checked before the model is
    loaded; the word ``taesd``: the one kept with the model at ``path``); with the model's ``spec``, the TAESD at
    ``path`` loaded for that model's latents. The word ``vae`` is the model's AutoencoderKL: None once loaded."""
    from ..weights.taesd import TAESDError, load_taesd, model_variant, resolve_taesd

    if value == "vae":
        return value if spec is None else None
    try:
        if spec is None:
            return resolve_taesd(value, path)
        return load_taesd(path, model_variant(spec), device=device)
    except TAESDError as e:
        raise SDLiteError(f"--vae-decoder {value}: {e}") from None


def _model_name(path: str) -> str:
    return Path(path).stem if Path(path).is_file() else Path(path).name


def _parse_layers(text: str | None) -> tuple[int, ...]:
    """``--slg 7,8,9``: block indices."""
    from ..pipeline import RequestError

    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise RequestError(f"--slg {text!r} is not valid: expected block indices separated by commas, e.g. 7,8,9") \
            from None


def _resolve_turbo_defaults(args):
    """Fill the sampling options the command line left unset (None): a Turbo model's settings with --turbo or when
    the model says it is one (its scheduler config or metadata; `sdlite info` shows it), A1111's otherwise.

    Returns the checkpoint opened (headers only) to find that out, for the load to use rather than open it again;
    None when it was not opened or could not be (the load then reports what is wrong with the model)."""
    unset = [key for key in TURBO_DEFAULTS if getattr(args, key) is None]
    turbo, ckpt, own = args.turbo, None, None
    if not turbo and unset:
        from ..adapters.lora_files import lora_names
        from ..families import family_for
        from ..loader import open_model

        try:
            ckpt = open_model(args.model, prediction_type=args.prediction_type, text_encoders=args.text_encoder or ())
            turbo = ckpt.spec.turbo
            # a family's own (SD3: 28 steps of Euler, its cfg), or a distilled LoRA's (Qwen-Image-Lightning's)
            loras = [parse_lora(v) for v in getattr(args, "lora", None) or ()]
            own = family_for(ckpt.spec).sampling_defaults_for(lora_names(getattr(args, "prompt", None) or "", loras))
        except SDLiteError:
            turbo = False
    for key in unset:
        setattr(args, key, (own or (TURBO_DEFAULTS if turbo else PLAIN_DEFAULTS))[key])   # a family's own first
    return ckpt


def _cache_option(text: str | None) -> dict:
    """``--cache [N[:B] | T]`` as the Request's ``cache_interval`` and ``cache_branch`` (DeepCache on a UNet; on a
    transformer any interval turns on the first-block cache at its default threshold), or with a decimal point its
    ``cache_threshold`` (the first-block cache's, transformers). Left out: the Request's, off."""
    from ..engine.blockcache import BlockCacheError, parse_threshold
    from ..engine.stepcache import StepCacheError, parse
    from ..pipeline import RequestError

    if text is None:
        return {}
    try:
        if "." in str(text):
            return {"cache_threshold": parse_threshold(text)}
        interval, branch = parse(text)
    except (StepCacheError, BlockCacheError) as e:
        raise RequestError(f"--cache: {e}") from None
    return {"cache_interval": interval, "cache_branch": branch}


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="text to image, image to image, inpainting, outpainting")
    g.add_argument("prompt")
    add_shared_arguments(g)
    add_image_arguments(g)
    g.set_defaults(func=cmd_generate)


def add_image_arguments(g) -> None:
    """``generate``'s own option groups, which ``edit`` does not take: the SDXL refiner, image to image (with
    ``--ref-image``), the hires fix, ControlNets."""
    x = g.add_argument_group("SDXL")
    x.add_argument("--refiner", metavar="PATH", default=None,
                   help="an SDXL refiner that takes the latents over for the last steps (A1111's refiner)")
    x.add_argument("--refiner-switch", metavar="F", type=float, default=None,
                   help=f"the fraction of the steps the base runs before the refiner (default {DEFAULT_REFINER_SWITCH})")
    x.add_argument("--aesthetic-score", metavar="S", type=float, default=None,
                   help="the refiner's aesthetic score conditioning of the prompt (default 6)")
    x.add_argument("--negative-aesthetic-score", metavar="S", type=float, default=None,
                   help="... of the negative prompt (default 2.5)")
    add_img2img_arguments(g)
    add_hires_arguments(g)
    add_controlnet_arguments(g)


def image_option_defaults() -> dict:
    """The defaults of :func:`add_image_arguments`' options but ``--ref-image``: what :func:`cmd_generate` reads of
    them on a command that does not offer them (``edit``)."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_image_arguments(scratch)
    return {dest: value for dest, value in vars(scratch.parse_args([])).items() if dest != "ref_image"}


def add_shared_arguments(g) -> None:
    """The options ``generate`` and ``edit`` share: the model, the sampling, the output, the engine, the add-ons."""
    g.add_argument("--model", "-m", default=None,
                   help="a diffusers folder or a .safetensors/.ckpt single file, or demo / demo-zh (default: the "
                        "shipped demo model; demo-zh, its Chinese text encoder, when the prompt has Chinese characters)")
    g.add_argument("--text-encoder", action="append", metavar="PATH", default=None,
                   help="a part a single-file SD3, FLUX, Z-Image, FLUX.2 klein or Qwen-Image model lacks "
                        "(repeatable): ComfyUI's clip_l.safetensors, clip_g.safetensors (SD3), t5xxl_fp16.safetensors "
                        "or t5xxl_fp8_e4m3fn.safetensors, qwen_3_4b.safetensors or a Qwen3 GGUF (Z-Image, klein), "
                        "qwen_2.5_vl_7b.safetensors or its GGUF (Qwen-Image), and the VAE: ae.safetensors (FLUX, "
                        "Z-Image), flux2-vae.safetensors (klein), qwen_image_vae.safetensors (Qwen-Image); found "
                        "beside the model (its folder, text_encoders/, vae/, ComfyUI's models/text_encoders, "
                        "models/clip, models/vae) when not given")
    g.add_argument("--negative", "-n", default="", help="negative prompt")
    g.add_argument("--slg", default=None, metavar="LAYERS",
                   help="skip-layer guidance (SD3.5): the transformer blocks an extra pass skips, e.g. 7,8,9 (SD3.5 "
                        "Medium's recommendation); needs --cfg above 1")
    g.add_argument("--slg-scale", type=float, default=2.8, help="skip-layer guidance scale (default 2.8)")
    g.add_argument("--slg-start", type=float, default=0.01, help="fraction of the steps where it starts (0.01)")
    g.add_argument("--slg-stop", type=float, default=0.2, help="fraction of the steps where it stops (0.2)")
    g.add_argument("--guidance", type=float, default=None,
                   help="FLUX.1 dev's distilled guidance scale (Forge's \"Distilled CFG Scale\"; default 3.5); not "
                        "CFG, which --cfg is and which FLUX runs without (cfg 1)")
    g.add_argument("--steps", type=int, default=None, help="default 20 (Turbo models: 1; SD3: 28, SD3.5 Medium 40)")
    g.add_argument("--cache", nargs="?", const="on", default=None, metavar="N[:B]|T",
                   help="the step cache. UNet models (DeepCache): the whole UNet every N-th step and the last, the "
                        "steps between reuse its deep features and run only skip branch B (0, the shallowest, is the "
                        "fastest; higher is closer to the uncached image); --cache alone: N=3, B=0. Transformers "
                        "(SD3, FLUX, Z-Image: first-block cache): the blocks after the first are skipped on a step "
                        "whose first block changed less than T (a number with a decimal point, 0 to 1; --cache alone "
                        "or with N: 0.08). Faster, not exact: off by default (see docs/speed.md)")
    g.add_argument("--cfg", type=float, default=None,
                   help="classifier-free guidance scale (1 = off; default 7.5, Turbo models 1, SD3 7, SD3.5 Large 3.5, "
                        "SD3.5 Medium 4.5)")
    g.add_argument("--sampler", default=None,
                   help="see `sdlite samplers`; A1111 names work too (default: DPM++ 2M Karras; Turbo models: Euler a; "
                        "SD3: Euler, which is diffusers' FlowMatchEulerDiscreteScheduler)")
    g.add_argument("--schedule", default=None,
                   help="sigma schedule: discrete, karras or exponential (default: what the sampler name implies)")
    g.add_argument("--noise", choices=("a1111", "comfy"), default="a1111",
                   help="how the noise is drawn: a1111 (default: image i from seed + i, as diffusers and A1111) or "
                        "comfy (ComfyUI's KSampler: the batch from one generator, ComfyUI's schedulers, which "
                        "--schedule may then name: normal, karras, exponential, sgm_uniform, simple, ddim_uniform, "
                        "beta; the image a ComfyUI workflow gives on `sdlite serve`)")
    g.add_argument("--timestep-spacing", default=None,
                   help="leading, linspace or trailing: where the sampler's timesteps fall (default: what the "
                        "model's scheduler config says, `sdlite info` shows it; Turbo models: trailing)")
    g.add_argument("--timesteps", default=None, metavar="T,T,...",
                   help="explicit training timesteps, descending, e.g. 999,749,499,249 (DMD2): one step each (they "
                        "set --steps), as diffusers' timesteps=; samplers euler, heun, dpmpp_2m(_sde), ddpm, lcm, tcd, "
                        "on the discrete schedule")
    g.add_argument("--sigmas", default=None, metavar="S,S,...,0",
                   help="explicit sigmas, descending, ending with 0: one step fewer than values (they set --steps), "
                        "as diffusers' sigmas=; sampler euler (SD3/FLUX: euler, euler_a, heun, unipc, with the "
                        "values before the shift, in (0, 1])")
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
    g.add_argument("--eta", type=float, default=None,
                   help="noise of DDIM / ancestral / SDE samplers; TCD's gamma (default 0.3)")
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
                        "above 1024 px in memory mode 1 with a bf16 VAE, in memory mode 0 tiles of 256 above 256 px)")
    g.add_argument("--vae-decoder", metavar="taesd|vae|PATH", default=None,
                   help="decode the images with a TAESD (the tiny autoencoder) instead of the VAE: much faster, a "
                        "little less detail. PATH: a diffusers AutoencoderTiny folder, a taesd_decoder / "
                        "taesdxl_decoder file (.pth or .safetensors) or a folder of them; taesd: the one in the "
                        "model's folder, in its vae_tiny or taesd subfolder (or its vae/ where that is an "
                        "AutoencoderTiny, as in SDXS folders, which decode with it by default); vae: the model's "
                        "full VAE (an SDXS folder's vae_large/)")
    g.add_argument("--weight-dtype", default=None,
                   help="keep resident weights in fp16/bf16 and compute in --dtype, block by block")
    g.add_argument("--no-prepack", action="store_true",
                   help="leave fp32 CPU weights in PyTorch's layout instead of reordering them once for oneDNN "
                        "(by default they are where this CPU gains from it: see `sdlite info --system`)")
    g.add_argument("--no-winograd", action="store_true",
                   help="run every 3x3 convolution directly; by default, with fp32 on the CPU, the UNet's and VAE's "
                        "large-map ones use Winograd's F(2x2,3x3): 1.3-1.6x faster, the same result to fp32 rounding")
    a = g.add_argument_group("add-ons")
    a.add_argument("--lora", metavar="PATH[:WEIGHT]", action="append", default=[],
                   help="apply a LoRA (kohya/A1111 or diffusers/PEFT .safetensors) at WEIGHT (default 1); repeatable. "
                        "In the prompt, <lora:NAME:WEIGHT> does the same with NAME looked up in --lora-dir")
    a.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    a.add_argument("--embeddings", metavar="DIR", default=None,
                   help="textual-inversion embeddings (.pt/.safetensors): a prompt word equal to a file's stem, or "
                        "<embedding:NAME>, uses it")
