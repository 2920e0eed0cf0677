"""sdlite against diffusers at the real SD 1.5 / SD 2.1 shapes (random weights): the test suite's parity cases, run at
full size, with the largest PNG-pixel difference of each (the UNets: the largest relative error of the output).

    python bench/parity.py [SECTION ...] [--work DIR] [--json bench/parity.json] [--md bench/parity.md]

Sections (default: all of them):

* ``generate``: ``sdlite generate`` against StableDiffusionPipeline, every sampler, 128x128, 3 steps
  (tests/test_generate.py's ``reference_images`` and ``run_cli``);
* ``img2img``: image to image and inpainting with the 4- and 9-channel UNets, 128x128, batch 2
  (tests/test_img2img.py's ``PARITY_CASES`` through its ``parity_case``);
* ``hires``: the hires fix against the composition of diffusers' pipelines, 64 -> 128 px
  (tests/test_hires.py's ``PARITY_CASES`` / ``parity_case``);
* ``lora``: four LoRA layouts on a whole generation against load_lora_weights + fuse_lora, 128x128, 3 Euler steps,
  then the engine's no-LoRA image again (tests/test_lora.py's ``PARITY_CASES`` / ``parity_files`` / ``parity_case``);
* ``controlnet``: a 361M ControlNet in both layouts (diffusers folder, lllyasviel's fp16 single file), two units,
  image to image, 64x64 (tests/test_controlnet.py's ``PARITY_CASES`` / ``parity_case`` / ``parity_two`` /
  ``parity_img2img``), and the weights each layout loads;
* ``unet``: the SD 1.5 and SD 2.1 UNets against diffusers' with the same weights, a 16x16 latent at batch 2;
* ``zimage``: Z-Image at the released widths and reduced depth (the transformer 3840 wide with 30 heads, one refiner
  block each and 2 joint blocks; Qwen3-4B's layers, 2560 wide with its whole vocabulary, 2 of them; FLUX.1's VAE)
  against ZImagePipeline: batch 2 at 128x128 and 128x96, English and Chinese, CFG with a negative prompt
  (tests/test_zimage_pipeline.py's ``_pipeline``, its cases).

The tests run each of these cases on tiny models (and the real shapes' keys, layers and parameter counts on the
meta device); this script holds the full-size networks to the same bounds: 2/255 for pixels (0 for the un-merged
image), 1e-4 for the UNets' relative error. Exit status 1 when a case is outside its bound.

The full-size SD 1.5 folder (fp32, as tests.reference.write_sd15_folder writes the tests' one), its 9-channel
inpainting sibling and the ControlNet (bench/controlnet.py's ``build_controlnet``) go to ``--work`` (about 7 GB; a
temporary folder under bench/cache/ by default, removed at the end; a given one is kept and reused). Raw figures to
bench/parity.json, the table to bench/parity.md. About 15 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ["generate", "img2img", "hires", "lora", "controlnet", "unet", "zimage"]
PIXELS, UNET = "max pixel diff", "max rel err"


def _pipeline(cls, folder, **components):
    import torch

    pipe = cls.from_pretrained(folder, dtype=torch.float32, local_files_only=True, safety_checker=None,
                               requires_safety_checker=False, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pixel_diff(got, expected) -> int:
    import numpy as np

    assert got.shape == expected.shape, (got.shape, expected.shape)
    return int(np.abs(got.astype(int) - expected.astype(int)).max())


def section_generate(folders, work):
    from diffusers import StableDiffusionPipeline

    from tests.reference import SCHEDULERS
    from tests.test_generate import reference_images, run_cli

    pipe = _pipeline(StableDiffusionPipeline, folders["sd15"])
    for sampler in SCHEDULERS:
        expected = reference_images(pipe, sampler, steps=3, seed=42, size=128)
        _, got = run_cli(folders["sd15"], work / f"generate-{sampler}.png", sampler, steps=3, seed=42, size=128)
        yield f"{sampler}, 128x128, 3 steps", PIXELS, _pixel_diff(got, expected), 2


def section_img2img(folders, work):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    from sdlite.pipeline import Engine
    from tests.test_img2img import PARITY_CASES, parity_case

    # one model's pipelines and engine alive at a time (about 8 GB)
    for folder, modes in ((folders["sd15"], ("img2img", "inpaint_4ch")), (folders["sd15-inpaint"], ("inpaint_9ch",))):
        img = _pipeline(StableDiffusionImg2ImgPipeline, folder)
        inpaint = StableDiffusionInpaintPipeline(**img.components)
        inpaint.set_progress_bar_config(disable=True)
        pipes = {"img2img": img, "inpaint_4ch": inpaint, "inpaint_9ch": inpaint}
        engine = Engine.load(folder, precision="exact")
        for mode in modes:
            for sampler, strength in PARITY_CASES[mode]:
                got, expected = parity_case(pipes, dict.fromkeys(modes, engine), mode, sampler, strength, size=128)
                yield f"{mode}, {sampler}, strength {strength:g}, batch 2", PIXELS, _pixel_diff(got, expected), 2
        del img, inpaint, pipes, engine
        gc.collect()


def section_hires(folders, work):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

    from sdlite.pipeline import Engine
    from tests.test_hires import PARITY_CASES, parity_case

    txt = _pipeline(StableDiffusionPipeline, folders["sd15"])
    img = StableDiffusionImg2ImgPipeline(**txt.components)
    img.set_progress_bar_config(disable=True)
    engine = Engine.load(folders["sd15"], precision="exact")
    for sampler, upscaler, batch in PARITY_CASES:
        got, expected = parity_case((txt, img), engine, sampler, upscaler, batch)
        yield f"{sampler}, {upscaler}, batch {batch}, 64 -> 128", PIXELS, _pixel_diff(got, expected), 2


def section_lora(folders, work):
    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline

    from sdlite.config import SD15
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.pipeline import Engine
    from tests.test_lora import PARITY_CASES, layer_shapes, parity_case, parity_files, parity_request, pixels

    with torch.device("meta"):
        unet, te = UNet(SD15.unet), CLIPTextEncoder(SD15.text)
    (work / "loras").mkdir(exist_ok=True)
    files = parity_files(layer_shapes(unet), layer_shapes(te), work / "loras")
    engine = Engine.load(folders["sd15"], precision="exact")   # prepacked where this CPU gains from it, as by default
    pipe = _pipeline(StableDiffusionPipeline, folders["sd15"])
    base = pixels(engine.generate(parity_request(128)))
    for case in PARITY_CASES:
        got, expected = parity_case(engine, pipe, files[case], 128)
        change = float(np.abs(got - base).mean())
        yield f"{case} (mean change from no LoRA {change:.1f})", PIXELS, _pixel_diff(got, expected), 2
    after = pixels(engine.generate(parity_request(128)))
    yield "no LoRA after the cases, against before", PIXELS, _pixel_diff(after, base), 0


def section_controlnet(folders, work):
    import torch
    from diffusers import (ControlNetModel, MultiControlNetModel, StableDiffusionControlNetImg2ImgPipeline,
                           StableDiffusionControlNetPipeline, StableDiffusionPipeline)
    from safetensors.torch import save_file

    from sdlite.pipeline import Engine
    from sdlite.weights.controlnet import load_controlnet
    from sdlite.weights.unet_keys import controlnet_to_original, unet_structure_from_keys
    from tests.test_controlnet import PARITY_CASES, parity_case, parity_img2img, parity_two

    cn = ControlNetModel.from_pretrained(folders["controlnet"], dtype=torch.float32, local_files_only=True).eval()
    paths = {"folder": folders["controlnet"], "original": work / "control_v11p_sd15_random.safetensors"}
    if not paths["original"].is_file():
        state = cn.state_dict()
        keys = list(state)
        plan = controlnet_to_original(keys, unet_structure_from_keys(keys, "diffusers", prefix=""), 8)
        save_file({k: state[e.sources[0]].half().contiguous() for k, e in plan.entries.items()}, paths["original"])
        del state
    engine = Engine.load(folders["sd15"], precision="exact")
    reference = cn.state_dict()
    for layout, path in paths.items():
        loaded = load_controlnet(path, engine.spec.unet).state_dict()
        assert set(loaded) == set(reference), layout
        worst = max(float((loaded[k] - reference[k]).abs().max()) for k in reference)
        yield f"{layout} layout's weights against diffusers' (max abs)", "max abs diff", worst, 0
        del loaded
    del reference
    base = _pipeline(StableDiffusionPipeline, folders["sd15"])
    pipes = {name: cls(**base.components, controlnet=net) for name, cls, net in (
        ("one", StableDiffusionControlNetPipeline, cn),
        ("two", StableDiffusionControlNetPipeline, MultiControlNetModel([cn, cn])),
        ("img", StableDiffusionControlNetImg2ImgPipeline, cn))}
    for p in pipes.values():
        p.set_progress_bar_config(disable=True)
    for layout, sampler, weight, start, end in PARITY_CASES:
        got, expected, plain = parity_case(pipes["one"], engine, paths[layout], sampler, weight, start, end)
        yield (f"{layout}, {sampler}, weight {weight:g}, {start:g}-{end:g} (change from no control "
               f"{_pixel_diff(got, plain)})"), PIXELS, _pixel_diff(got, expected), 2
    got, expected = parity_two(pipes["two"], engine, paths["folder"])
    yield "two units, euler", PIXELS, _pixel_diff(got, expected), 2
    got, expected = parity_img2img(pipes["img"], engine, paths["folder"])
    yield "image to image, ddim, strength 0.7", PIXELS, _pixel_diff(got, expected), 2


def section_unet(folders, work):
    import torch

    from sdlite.config import SD15, SD21_V
    from sdlite.models.unet import UNet
    from tests.reference import diffusers_unet, max_rel_err

    for name, spec in (("SD 1.5", SD15), ("SD 2.1", SD21_V)):
        torch.manual_seed(0)
        ref = diffusers_unet(spec.unet)
        with torch.device("meta"):
            ours = UNet(spec.unet)
        ours.load_state_dict(ref.state_dict(), strict=True, assign=True)   # the very same tensors
        ours.eval()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 4, 16, 16, generator=g)
        ctx = torch.randn(2, 77, spec.unet.context_dim, generator=g)
        t = torch.tensor([981.0, 1.0])
        with torch.no_grad():
            err = max_rel_err(ours(x, t, ctx), ref(x, t, encoder_hidden_states=ctx).sample)
        yield f"{name} UNet, 16x16 latent, batch 2", UNET, err, 1e-4
        del ref, ours
        gc.collect()


# Z-Image at the released widths, reduced depth (sdlite.config.zimage.ZIMAGE_TURBO, sdlite.config.qwen.QWEN3_4B)
ZIMAGE_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=2,
                          n_refiner_layers=1, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                          rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
ZIMAGE_QWEN = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=2,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                   rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True)


def section_zimage(folders, work):
    import numpy as np
    import torch

    from sdlite.config.zimage import ZIMAGE_VAE
    from sdlite.pipeline import Engine, Request
    from tests.test_zimage_pipeline import NEGATIVE, PROMPT, PROMPT_ZH, _pipeline, _reference

    vae = dataclasses.replace(ZIMAGE_VAE, sample_size=128)
    # weights about 1/sqrt(width), so that 30 heads of 128 neither vanish nor blow up
    pipe = _pipeline(work / "zimage", transformer=ZIMAGE_TRANSFORMER, qwen=ZIMAGE_QWEN, vae=vae, scales=(0.02, 0.02),
                     contrast=3.0)
    engine = Engine.load(work / "zimage", precision="exact")
    cases = [("English, 128x128, batch 2, 4 steps", PROMPT, None, 1.0, 128, 128, 4),
             ("Chinese, 128x96, batch 2, 3 steps", PROMPT_ZH, None, 1.0, 128, 96, 3),
             ("CFG 3.5 (guidance_scale 2.5) with a negative prompt, 128x128, batch 2", PROMPT, NEGATIVE, 3.5, 128,
              128, 3)]
    for name, prompt, negative, cfg, width, height, steps in cases:
        kw = {"negative_prompt": negative} if negative else {}
        expected = _reference(pipe, width, height, prompt=prompt, num_inference_steps=steps, guidance_scale=cfg - 1,
                              num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (7, 8)],
                              **kw)
        got = engine.generate(Request(prompt=prompt, negative_prompt=negative or "", steps=steps, cfg_scale=cfg,
                                      seed=7, batch_size=2, width=width, height=height, sampler="euler"))
        got = np.stack([np.asarray(im, dtype=np.int16) for im in got.images])
        clipped = float(np.mean((got == 0) | (got == 255)))
        print(f"zimage     {name}: image std {got.std():.1f}, {clipped:.0%} of values at 0 or 255", file=sys.stderr,
              flush=True)
        yield name, PIXELS, _pixel_diff(got, expected), 2


def build_folders(work: Path, sections) -> dict[str, Path]:
    """The full-size folders the sections need, written into ``work`` where missing."""
    from tests.reference import write_sd15_folder, write_sd15_inpaint_folder

    folders = {"sd15": work / "sd15", "sd15-inpaint": work / "sd15-inpaint", "controlnet": work / "controlnet"}
    if set(sections) - {"unet", "zimage"} and not (folders["sd15"] / "model_index.json").is_file():
        shutil.rmtree(folders["sd15"], ignore_errors=True)
        print("writing the full-size SD 1.5 folder", file=sys.stderr, flush=True)
        write_sd15_folder(folders["sd15"])
    if "img2img" in sections and not (folders["sd15-inpaint"] / "model_index.json").is_file():
        shutil.rmtree(folders["sd15-inpaint"], ignore_errors=True)
        write_sd15_inpaint_folder(folders["sd15"], folders["sd15-inpaint"])
    if "controlnet" in sections:
        sys.path.insert(0, str(HERE))
        from controlnet import build_controlnet

        build_controlnet(folders["sd15"], folders["controlnet"])
    return folders


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(report: dict) -> str:
    lines = ["# Parity with diffusers at full size\n",
             f"`python bench/parity.py` on {report['machine']} ({report['threads']} threads), torch {report['torch']}, "
             f"diffusers {report['diffusers']}: the test suite's parity cases at the real SD 1.5 / SD 2.1 shapes "
             "(random weights). Pixels are 8-bit PNG levels.\n",
             "| section | case | figure | value | bound | within |", "|---|---|---|---|---|---|"]
    for c in report["cases"]:
        value = f"{c['value']:.2e}" if c["figure"] == UNET else f"{c['value']:g}"
        lines.append(f"| {c['section']} | {c['case']} | {c['figure']} | {value} | {c['bound']:g} | "
                     f"{'yes' if c['ok'] else '**no**'} |")
    seconds = ", ".join(f"{name} {s:.0f} s" for name, s in report["seconds"].items())
    return "\n".join(lines) + f"\nTime by section (models loaded, both sides run): {seconds}.\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"{', '.join(SECTIONS)} or all (the default)")
    ap.add_argument("--work", help="folder for the full-size models (kept and reused; default: a temporary one)")
    ap.add_argument("--json", default=str(HERE / "parity.json"))
    ap.add_argument("--md", default=str(HERE / "parity.md"))
    args = ap.parse_args()
    unknown = set(args.sections) - {*SECTIONS, "all"}
    if unknown:
        ap.error(f"unknown sections {', '.join(sorted(unknown))}: expected {', '.join(SECTIONS)} or all")
    sections = SECTIONS if not args.sections or "all" in args.sections else [s for s in SECTIONS if s in args.sections]
    sys.path.insert(0, str(ROOT))
    import diffusers
    import torch
    import transformers

    for library in (diffusers, transformers):
        library.utils.logging.disable_progress_bar()
        library.utils.logging.set_verbosity_error()

    if args.work:
        work, temporary = Path(args.work), False
        work.mkdir(parents=True, exist_ok=True)
    else:
        (HERE / "cache").mkdir(exist_ok=True)
        work, temporary = Path(tempfile.mkdtemp(prefix="parity-", dir=HERE / "cache")), True
    report = {"machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "diffusers": diffusers.__version__, "seconds": {}, "cases": []}
    try:
        folders = build_folders(work, sections)
        for section in sections:
            t0 = time.perf_counter()
            for case, figure, value, bound in globals()[f"section_{section}"](folders, work):
                ok = value <= bound
                report["cases"].append({"section": section, "case": case, "figure": figure, "value": value,
                                        "bound": bound, "ok": ok})
                print(f"{section:10} {case}: {figure} {value:g} (bound {bound:g}){'' if ok else '  OUTSIDE'}",
                      flush=True)
            report["seconds"][section] = round(time.perf_counter() - t0, 1)
            print(f"{section}: {report['seconds'][section]:.0f} s", file=sys.stderr, flush=True)
            gc.collect()
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    Path(args.md).write_text(markdown(report))
    return 0 if all(c["ok"] for c in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
