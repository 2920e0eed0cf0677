"""ComfyUI's separate-file loaders (sdlite/server/comfy/loaders.py) on a tiny FLUX.1 dev written as the files ComfyUI
users have (BFL's transformer in diffusion_models/, clip_l and T5 in text_encoders/, ae in vae/): UNETLoader +
DualCLIPLoader(flux) + VAELoader, and city96's GGUF loaders, give sdlite's own image of those files
(Engine.generate(noise="comfy")); UNETLoader's fp8 weight_dtype gives the image of the transformer file whose Linear
weights were cast to fp8 and back, from a transformer holding one byte a weight; VAELoader with a normal checkpoint;
the refusals of what does not fit."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image
import torch
from safetensors.torch import load_file, save_file

from sdlite.demo import model_path
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.server.backend import Server
from sdlite.server.comfy.workflow import ComfyDirs, Executor, PromptError, object_info, validate
from tests.test_comfy_workflow import Control, txt2img
from tests.test_flux_files import TEXT_L, TRANSFORMER, _parts, _write_gguf
from tests.test_flux_pipeline import SIZE, _pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 2
PROMPT = "a red circle"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A server whose --models-dir has ComfyUI's folders with the tiny FLUX.1 dev's files (and a GGUF copy of its
    transformer), the demo checkpoint as --model and a copy of the demo's VAE in vae/."""
    root = tmp_path_factory.mktemp("comfy-loaders")
    models = root / "models"
    for sub in ("diffusion_models", "text_encoders", "vae", "checkpoints"):
        (models / sub).mkdir(parents=True)
    parts = _parts(_pipeline(root, "dev", text_l=TEXT_L, save=False, **TRANSFORMER))
    save_file(parts["transformer"], models / "diffusion_models" / "flux1-dev.safetensors")
    _write_gguf(models / "diffusion_models" / "flux1-dev-Q8.gguf", parts["transformer"], "flux")
    save_file(parts["clip_l"], models / "text_encoders" / "clip_l.safetensors")
    save_file(parts["t5"], models / "text_encoders" / "t5xxl_fp16.safetensors")
    import gguf   # T5 in llama.cpp's names, as city96's T5 GGUF files hold it

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5ENCODER, 8)
    _write_gguf(models / "text_encoders" / "t5-Q8.gguf",
                {names.get_name(k.removesuffix(".weight")) + ".weight": v for k, v in parts["t5"].items()}, "t5encoder")
    save_file(parts["vae"], models / "vae" / "ae.safetensors")
    save_file(parts["vae"], models / "text_encoders" / "not_a_text_encoder.safetensors")
    demo = open_model(model_path())
    with demo:
        vae = demo.load("vae")
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, models / "vae" / "demo_vae.safetensors")
    dirs = ComfyDirs(root / "input", root / "output", root / "temp")
    for folder in (dirs.input, dirs.output, dirs.temp):
        folder.mkdir()
    server = Server(model_path(), models, preload=False)
    yield server, Executor(server, dirs), models, dirs
    server.jobs.stop(1)


def run(env, prompt):
    server, executor, _, dirs = env
    history = executor.run("pid", prompt, validate(prompt, server), Control(), lambda *a: None)
    with Image.open(dirs.output / history["9"]["images"][0]["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def flux_workflow(unet="UNETLoader", clip="DualCLIPLoader", unet_name="flux1-dev.safetensors", seed=5, width=SIZE,
                  height=SIZE):
    model = {"unet_name": unet_name} | ({"weight_dtype": "default"} if unet == "UNETLoader" else {})
    return {
        "1": {"class_type": unet, "inputs": model},
        "2": {"class_type": clip, "inputs": {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                                             "type": "flux"}},
        "10": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["2", 0]}},
        "11": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["6", 0], "guidance": 3.5}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}},
        "3": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "model": ["1", 0], "positive": ["11", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["10", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "flux", "images": ["8", 0]}},
    }


def own_engine(env, transformer: str, t5="t5xxl_fp16.safetensors") -> Engine:
    server, _, models, _ = env
    source = open_model(models / "diffusion_models" / transformer, text_encoders=[
        models / "text_encoders" / "clip_l.safetensors", models / "text_encoders" / t5,
        models / "vae" / "ae.safetensors"])
    return Engine.load(source, **server.engines.load_options)


def own_request(seed=5, width=SIZE, height=SIZE) -> Request:
    return Request(prompt=PROMPT, negative_prompt="", width=width, height=height, steps=STEPS, cfg_scale=1.0,
                   sampler="euler", schedule="simple", seed=seed, guidance=3.5, noise="comfy")


def own_image(env, transformer: str, seed=5, t5="t5xxl_fp16.safetensors") -> np.ndarray:
    return np.asarray(own_engine(env, transformer, t5).generate(own_request(seed)).images[0])


def refusal(env, prompt) -> dict:
    with pytest.raises(PromptError) as caught:
        validate(prompt, env[0])
    return caught.value.node_errors


def test_the_folders_make_the_combo_lists(env):
    info = object_info(env[0])
    assert info["UNETLoader"]["input"]["required"]["unet_name"][0] == ["flux1-dev.safetensors"]
    assert info["UnetLoaderGGUF"]["input"]["required"]["unet_name"][0] == ["flux1-dev-Q8.gguf"]
    assert info["DualCLIPLoader"]["input"]["required"]["clip_name1"][0] == [
        "clip_l.safetensors", "not_a_text_encoder.safetensors", "t5xxl_fp16.safetensors"]
    assert info["DualCLIPLoaderGGUF"]["input"]["required"]["clip_name2"][0] == [
        "clip_l.safetensors", "not_a_text_encoder.safetensors", "t5-Q8.gguf", "t5xxl_fp16.safetensors"]
    assert "flux" in info["DualCLIPLoader"]["input"]["required"]["type"][0]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0] == ["ae.safetensors", "demo_vae.safetensors"]
    from sdlite.server.comfy.routes import _models   # GET /models/{folder}

    assert _models(env[0], "unet") == ["flux1-dev-Q8.gguf", "flux1-dev.safetensors"]
    assert _models(env[0], "vae") == ["ae.safetensors", "demo_vae.safetensors"]


def test_unet_dual_clip_and_vae_loaders_give_sdlites_own_image(env):
    """UNETLoader + DualCLIPLoader(flux) + VAELoader + FluxGuidance: one engine of the three files, the image of
    sdlite's Engine on them; queued again with a new seed, nothing is loaded again."""
    got = run(env, flux_workflow())
    assert np.array_equal(got, own_image(env, "flux1-dev.safetensors"))
    engines = env[0].engines
    loaded = dict(engines._loaded)
    assert len(loaded) == 1 and next(iter(loaded))[1].endswith("ae.safetensors")
    again = run(env, flux_workflow(seed=6))
    assert dict(engines._loaded) == loaded and not np.array_equal(again, got)


def test_sides_of_multiples_of_8_are_padded_as_comfyui_pads_them(env):
    """EmptySD3LatentImage at 72 x 56 (a 9 x 7 latent): ComfyUI's FLUX pads such a latent to whole 2 x 2 patches and
    crops the output (the network's pad_to_patches, against diffusers in tests.test_flux_model), so the graph runs;
    its image is the engine's ComfyUI sampling at that size, and not the 64 x 48 corner of a larger image. The A1111
    sampling still refuses the size, naming the nearest."""
    from sdlite.errors import RequestError

    got = run(env, flux_workflow(width=72, height=56))
    engine = own_engine(env, "flux1-dev.safetensors")
    want = np.asarray(engine.generate(own_request(width=72, height=56)).images[0])
    assert got.shape == want.shape == (56, 72, 3) and got.std() > 5
    assert np.array_equal(got, want)
    smaller = np.asarray(engine.generate(own_request(width=64, height=48)).images[0])
    assert np.abs(got[:48, :64].astype(int) - smaller.astype(int)).max() > 2
    with pytest.raises(RequestError, match=r"multiples of 16 pixels .* 72x56 is not: the nearest that are: 64x48 or "
                                           "80x64"):
        engine.generate(own_request(width=72, height=56).replace(noise="a1111", schedule=None))


def test_gguf_loaders_give_sdlites_own_image(env):
    """city96's UnetLoaderGGUF and DualCLIPLoaderGGUF with a GGUF transformer and a GGUF T5."""
    prompt = flux_workflow("UnetLoaderGGUF", "DualCLIPLoaderGGUF", "flux1-dev-Q8.gguf")
    prompt["2"]["inputs"]["clip_name2"] = "t5-Q8.gguf"
    assert np.array_equal(run(env, prompt), own_image(env, "flux1-dev-Q8.gguf", t5="t5-Q8.gguf"))


def test_vae_loader_with_a_checkpoint(env):
    """A normal checkpoint with an external VAE file (the demo's own VAE, copied): the checkpoint's image."""
    prompt = txt2img(env[0].checkpoints.current.name)
    plain = run(env, prompt)
    prompt["10"] = {"class_type": "VAELoader", "inputs": {"vae_name": "demo_vae.safetensors"}}
    prompt["8"]["inputs"]["vae"] = ["10", 0]
    assert np.array_equal(run(env, prompt), plain)


@pytest.fixture(scope="module")
def sd3(env, tmp_path_factory):
    """A tiny SD3.5 as Stability publishes it without its text encoders (checkpoints/, transformer and VAE) and its
    CLIP-L, CLIP-G and T5 files in text_encoders/; the server's list refreshed."""
    from tests.test_sd3_files import CLIP_G, CLIP_L, T5, T5_WIDTH, TEXT_G, _single_file_parts
    from tests.test_sd3_files import TEXT_L as SD3_TEXT_L
    from tests.test_sd3_pipeline import _pipeline as sd3_pipeline

    server, _, models, _ = env
    parts = _single_file_parts(sd3_pipeline(tmp_path_factory.mktemp("sd3"), text_l=SD3_TEXT_L, text_g=TEXT_G,
                                            t5_width=T5_WIDTH))
    save_file({**parts["transformer"], **parts["vae"]}, models / "checkpoints" / "sd3.5_medium.safetensors")
    names = {"clip_l": ("sd3_clip_l.safetensors", CLIP_L), "clip_g": ("sd3_clip_g.safetensors", CLIP_G),
             "t5": ("sd3_t5xxl.safetensors", T5)}
    for part, (name, prefix) in names.items():
        save_file({k[len(prefix):]: v for k, v in parts[part].items()}, models / "text_encoders" / name)
    server.checkpoints.refresh()
    yield [models / "text_encoders" / name for name, _ in names.values()]
    for name, _ in names.values():
        (models / "text_encoders" / name).unlink()


def test_sd35_checkpoint_with_triple_clip_loader(env, sd3):
    """SD3.5's ComfyUI workflow: CheckpointLoaderSimple (a file without text encoders; its CLIP output unused) +
    TripleCLIPLoader, decoded with the checkpoint's VAE: the image of sdlite's Engine on those files."""
    server, _, models, _ = env
    prompt = txt2img("checkpoints/sd3.5_medium.safetensors", seed=3, scheduler="simple", prefix="sd3")
    prompt["2"] = {"class_type": "TripleCLIPLoader", "inputs": {"clip_name1": sd3[0].name, "clip_name2": sd3[1].name,
                                                                "clip_name3": sd3[2].name}}
    prompt["5"]["class_type"] = "EmptySD3LatentImage"
    for n in ("6", "7"):
        prompt[n]["inputs"]["clip"] = ["2", 0]
    got = run(env, prompt)
    source = open_model(models / "checkpoints" / "sd3.5_medium.safetensors", text_encoders=sd3)
    engine = Engine.load(source, **server.engines.load_options)
    r = Request(prompt="a red circle", negative_prompt="blurry", width=64, height=64, steps=3, cfg_scale=6.0,
                sampler="euler", schedule="simple", seed=3, noise="comfy")
    assert np.array_equal(got, np.asarray(engine.generate(r).images[0]))


def test_a_vae_that_does_not_fit_the_model_is_an_error_naming_the_node(env):
    prompt = txt2img(env[0].checkpoints.current.name)
    prompt["10"] = {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}}
    prompt["8"]["inputs"]["vae"] = ["10", 0]
    with pytest.raises(Exception) as caught:
        run(env, prompt)
    assert "VAELoader (node 10) vae_name 'ae.safetensors'" in str(caught.value)
    assert "cannot be used with" in str(caught.value)


@pytest.mark.parametrize("node,change,input_name,words", [
    ("2", {"clip_name2": "not_a_text_encoder.safetensors"}, "clip_name2", "holds a VAE"),
    ("2", {"clip_name2": "clip_l.safetensors"}, "clip_name2", "one CLIP-L and one T5"),
    ("2", {"type": "sdxl"}, "type", "SD3 (sd3) and FLUX.1 (flux) only"),
    ("10", {"vae_name": "ae.safetensors"}, None, None),
])
def test_files_that_do_not_fit_their_input_are_refused_naming_it(env, node, change, input_name, words):
    prompt = flux_workflow()
    prompt[node]["inputs"].update(change)
    if input_name is None:   # the unchanged workflow passes
        assert validate(copy.deepcopy(prompt), env[0]) == ["9"]
        return
    (error,) = refusal(env, prompt)[node]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == input_name
    assert words in error["details"]


# --- UNETLoader's fp8 weight_dtype ------------------------------------------------------------------------------

FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def fp8_files(env):
    """For each fp8 type, the independent reference: the transformer file with every 2-D weight (FLUX's are exactly
    its Linear weights) cast to that fp8 type and back by torch; and an SD 1.5 UNet file (the demo's), in
    diffusion_models/ for as long as these tests run."""
    server, _, models, _ = env
    folder = models / "diffusion_models"
    transformer = load_file(folder / "flux1-dev.safetensors")
    made = []
    for name, dtype in FP8.items():
        made.append(folder / f"flux1-dev-{name}-rounded.safetensors")
        save_file({k: v.to(dtype).to(v.dtype) if v.ndim == 2 and k.endswith(".weight") else v
                   for k, v in transformer.items()}, made[-1])
    demo = open_model(model_path())
    with demo:
        unet = demo.load("unet")
    made.append(folder / "sd15_unet.safetensors")
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, made[-1])
    yield {name: path.name for name, path in zip(FP8, made)}
    for path in made:
        path.unlink()


def _transformer(engine):
    with engine.models.use("transformer") as transformer:
        return transformer


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_unet_loader_fp8_weight_dtype_keeps_fp8_weights(env, fp8_files, weight_dtype):
    """UNETLoader weight_dtype fp8: the image of the file whose Linear weights were rounded to fp8 by torch (loaded
    by default), from an engine of its own whose transformer holds every Linear weight as one fp8 byte: those
    rounded weights, half the bytes of the reference's bf16 ones (a quarter of fp32)."""
    from sdlite.engine.lowbit import LowBitLinear

    engines = env[0].engines
    prompt = flux_workflow()
    prompt["1"]["inputs"]["weight_dtype"] = weight_dtype
    got = run(env, prompt)
    (key,) = [k for k in engines._loaded if k[-1] == weight_dtype]
    fp8 = _transformer(engines._loaded[key])
    assert engines._loaded[key].precision.name == "bf16"   # auto's int8 layers give way to fp8 storage
    want = _in_bf16(env, flux_workflow(unet_name=fp8_files[weight_dtype]))
    assert np.array_equal(got, want)
    (reference,) = [_transformer(e) for k, e in engines._loaded.items() if k[0].name == fp8_files[weight_dtype]]
    dense = {name: m for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    stored = {name: m for name, m in fp8.named_modules() if isinstance(m, (LowBitLinear, torch.nn.Linear))}
    assert dense and stored.keys() == dense.keys()
    assert all(isinstance(m, LowBitLinear) and m.weight.dtype == torch.uint8 for m in stored.values())
    assert {m.qtype for m in stored.values()} == {"F8_E4M3" if weight_dtype == "fp8_e4m3fn" else "F8_E5M2"}
    values = sum(m.weight.numel() for m in dense.values())
    assert sum(m.weight.numel() * m.weight.element_size() for m in stored.values()) == values   # a byte a weight
    assert sum(m.weight.numel() * m.weight.element_size() for m in dense.values()) >= 2 * values
    for name, m in stored.items():
        held = m.weight.view(FP8[weight_dtype]).view(m.out_features, m.in_features)
        assert torch.equal(held.float(), dense[name].weight.float()), name


def _in_bf16(env, prompt):
    """The workflow's image from engines loaded in bf16 (what an fp8-stored transformer computes in: auto's int8
    layers give way to the storage), the server's options otherwise."""
    options = env[0].engines.load_options
    before = dict(options)
    options["precision"] = "bf16"
    try:
        return run(env, prompt)
    finally:
        options.clear()
        options.update(before)


def test_the_fast_variant_is_the_same_storage(env, fp8_files):
    """fp8_e4m3fn_fast (fp8 matrix products on GPUs, in ComfyUI) is the fp8_e4m3fn engine here: the same image as
    the reference, and its engine's key says fp8_e4m3fn."""
    prompt = flux_workflow()
    prompt["1"]["inputs"]["weight_dtype"] = "fp8_e4m3fn_fast"
    got = run(env, prompt)
    assert [k[-1] for k in env[0].engines._loaded] == ["fp8_e4m3fn"]
    assert np.array_equal(got, _in_bf16(env, flux_workflow(unet_name=fp8_files["fp8_e4m3fn"])))


@pytest.mark.parametrize("unet_name,options,words", [
    ("sd15_unet.safetensors", {}, "Z-Image and Qwen-Image transformers; 'sd15_unet.safetensors' is none of them"),
    ("flux1-dev.safetensors", {"memory_mode": 0}, "memory mode 0"),
    ("flux1-dev.safetensors", {"precision": "int4"}, "precision 'int4' keeps the transformer's weights"),
])
def test_fp8_weight_dtype_refused_where_it_cannot_be_kept(env, fp8_files, unet_name, options, words):
    engines = env[0].engines
    saved = dict(engines.load_options)
    engines.load_options.update(options)
    try:
        prompt = flux_workflow(unet_name=unet_name)
        prompt["1"]["inputs"]["weight_dtype"] = "fp8_e5m2"
        (error,) = refusal(env, prompt)["1"]["errors"]
    finally:
        engines.load_options.clear()
        engines.load_options.update(saved)
    assert error["extra_info"]["input_name"] == "weight_dtype" and error["type"] == "custom_validation_failed"
    assert "'fp8_e5m2'" in error["details"] and words in error["details"]


def test_engine_weight_storage_refusals(env):
    """Engine.load's weight_storage: a UNet model, an unknown name, memory mode 0 and an int8 precision are refused
    saying why."""
    from sdlite.engine.memory import MemoryModeError
    from sdlite.engine.precision import PrecisionError

    models = env[2]
    with pytest.raises(PrecisionError, match="this model .* has a UNet"):
        Engine.load(model_path(), weight_storage="fp8_e4m3fn")
    with pytest.raises(PrecisionError, match="weight storage 'fp16' is not valid: expected one of default, fp8_e4m3fn"):
        Engine.load(model_path(), weight_storage="fp16")
    with pytest.raises(PrecisionError, match="weight storage 'fp8_e4m3fn' and precision 'int8' both"):
        Engine.load(models / "diffusion_models" / "flux1-dev.safetensors", precision="int8",
                    weight_storage="fp8_e4m3fn")
    source = open_model(models / "diffusion_models" / "flux1-dev.safetensors", text_encoders=[
        models / "text_encoders" / "clip_l.safetensors", models / "text_encoders" / "t5xxl_fp16.safetensors"])
    with pytest.raises(MemoryModeError, match="weight storage 'fp8_e5m2' keeps the transformer's weights"):
        Engine.load(source, memory_mode=0, weight_storage="fp8_e5m2")


def test_sd35_transformer_in_fp8(env, sd3, tmp_path):
    """SD3.5's MMDiT kept in fp8 (Engine.load's weight_storage, what UNETLoader's weight_dtype asks for): the image of
    the checkpoint whose transformer Linear weights were cast to fp8 and back by torch; every Linear one byte a
    weight."""
    from sdlite.engine.lowbit import LowBitLinear

    models = env[2]
    checkpoint = models / "checkpoints" / "sd3.5_medium.safetensors"
    rounded = tmp_path / "sd3.5_medium_rounded.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn).to(v.dtype)
               if k.startswith("model.diffusion_model.") and k.endswith(".weight") and v.ndim == 2 else v
               for k, v in load_file(checkpoint).items()}, rounded)
    r = Request(prompt="a red circle", negative_prompt="blurry", width=64, height=64, steps=2, cfg_scale=6.0,
                sampler="euler", schedule="simple", seed=3, noise="comfy")

    def image(path, **options):
        engine = Engine.load(open_model(path, text_encoders=sd3), **{**env[0].engines.load_options, **options})
        return engine, np.asarray(engine.generate(r).images[0])

    fp8, got = image(checkpoint, weight_storage="fp8_e4m3fn")
    assert fp8.precision.name == "bf16"   # the fp8 weights computed in bf16 (auto's int8 layers give way)
    assert np.array_equal(got, image(rounded, precision="bf16")[1])
    linears = [m for m in _transformer(fp8).modules() if isinstance(m, (LowBitLinear, torch.nn.Linear))]
    assert linears and all(isinstance(m, LowBitLinear) and m.qtype == "F8_E4M3" and m.nbytes == m.weight.numel()
                           == m.in_features * m.out_features for m in linears)


def test_model_sampling_flux_shifts_the_sampler_and_loads_no_engine_of_its_own(env, monkeypatch):
    """ModelSamplingFlux after a UNETLoader: the sampler runs ComfyUI's flow table at the node's mu (the image of
    sdlite's engine sampling at that shift), and no engine of the bare transformer file is loaded for the node."""
    from sdlite.pipeline.latents import LatentRun
    from sdlite.server.comfy import images as comfy_images
    from sdlite.server.comfy.nodes import flux_shift

    engines = env[0].engines
    asked, get = [], engines.get
    monkeypatch.setattr(engines, "get", lambda checkpoint, *a, **k: asked.append((checkpoint, a, k)) or
                        get(checkpoint, *a, **k))
    prompt = flux_workflow(seed=7)
    prompt["12"] = {"class_type": "ModelSamplingFlux", "inputs": {"model": ["1", 0], "max_shift": 2.0,
                                                                  "base_shift": 0.3, "width": SIZE, "height": SIZE}}
    prompt["3"]["inputs"]["model"] = ["12", 0]
    got = run(env, prompt)
    assert asked and all(a for _, a, _ in asked)   # each engine asked for names its text encoders and VAE
    checkpoint, a, k = asked[-1]
    engine = get(checkpoint, *a, **k)
    latent = engine.family.latent
    r = Request(prompt=PROMPT, negative_prompt="", steps=STEPS, cfg_scale=1.0, sampler="euler", schedule="simple",
                seed=7, guidance=3.5)
    empty = torch.zeros(1, latent.channels, SIZE // latent.downscale, SIZE // latent.downscale)
    latents = engine.sample_latents(r, LatentRun(empty, shift=flux_shift(SIZE, SIZE, 0.3, 2.0))).latents
    want = np.asarray(comfy_images.to_pil(comfy_images.decoded_to_image(engine.decode_scaled(latents)))[0])
    assert np.array_equal(got, want)
    assert not np.array_equal(got, run(env, flux_workflow(seed=7)))   # ComfyUI's default mu (1.15) differs


@pytest.mark.parametrize("node, inputs, flux, words", [
    ("ModelSamplingSD3", {"shift": 3.0}, True, "shifts its schedule by image size (FLUX.1 dev): use ModelSamplingFlux"),
    ("ModelSamplingFlux", {"max_shift": 1.15, "base_shift": 0.5, "width": 64, "height": 64}, False,
     "is no flow-matching model"),
])
def test_model_sampling_that_does_not_fit_the_model_is_an_error_naming_the_node(env, node, inputs, flux, words):
    prompt = flux_workflow() if flux else txt2img(env[0].checkpoints.current.name)
    model = ["1", 0] if flux else ["4", 0]
    prompt["12"] = {"class_type": node, "inputs": {"model": model, **inputs}}
    prompt["3"]["inputs"]["model"] = ["12", 0]
    with pytest.raises(Exception) as caught:
        run(env, prompt)
    assert f"{node}: " in str(caught.value) and words in str(caught.value)
