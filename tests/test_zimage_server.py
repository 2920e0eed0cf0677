"""Z-Image on every front-end, on a tiny random Z-Image-Turbo written once as a diffusers folder and as the files
ComfyUI users have (the transformer in ComfyUI's names in diffusion_models/, Qwen3 in transformers' names under
``model.`` in text_encoders/, the VAE in LDM names in vae/; GGUF copies of the transformer and of Qwen3).

* A1111: the folder is listed, switched to, and its txt2img is the engine's image; steps, cfg and sampler left out
  are the family's (8 steps of Euler at cfg 1), ``cfg_scale`` is A1111's cfg, Forge's ``distilled_cfg_scale`` is
  ignored with a warning, a size Z-Image cannot draw is refused naming it; --max-steps checks the steps the model
  runs; a hires fix announces the steps the engine then runs (its flow schedule's second-pass rule).
* ``sdlite batch``: lines that leave steps, cfg and sampler out get the family's, in either vocabulary.
* OpenAI's ``/v1/images/generations`` and MCP's ``generate`` (in-process, through the SDK's client): the engine's
  image, with the family's defaults where the call leaves them out.
* ComfyUI: the stock Z-Image workflow (UNETLoader, CLIPLoader type lumina2, VAELoader, ModelSamplingAuraFlow,
  CLIPTextEncode, ConditioningZeroOut, EmptySD3LatentImage, KSampler, VAEDecode, SaveImage), with euler / simple
  or its own res_multistep / simple, gives sdlite's engine's image of the same files; at cfg 2 its zeroed negative
  is diffusers' zero embeddings; so do city96's GGUF loaders and UNETLoader's fp8 weight_dtype (the image of the
  transformer rounded to fp8); ModelSamplingAuraFlow's shift reaches the sampler; what does not fit is refused naming the node, input and value.
* Ray (a unit-level check): the ingress reads the width of Z-Image's LLM encoder as it reads CLIP's.
"""
from __future__ import annotations

import base64
import copy
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from sdlite.config.qwen import QwenConfig
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.weights.vae_keys import vae_to_original
from sdlite.weights.zimage_keys import zimage_to_comfy
from tests import test_zimage_pipeline as tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"
SIZE = 64
OPTIONS = {"precision": "exact"}
# the release's 128-wide heads and rotary split (32, 48, 48): a single file's shapes cannot tell them, so a file's
# model has the release's
TRANSFORMER = dict(tiny.TRANSFORMER, dim=128, n_heads=1, n_kv_heads=1, axes_dims=[32, 48, 48])
UNET, QWEN, AE = "z_image_turbo_bf16.safetensors", "qwen_3_4b.safetensors", "ae.safetensors"
UNET_GGUF, QWEN_GGUF = "z_image_turbo-Q8_0.gguf", "Qwen3-4B-Q8_0.gguf"
UNET_FP8 = "z_image_turbo_fp8-rounded.safetensors"
DEFAULTS = dict(steps=8, cfg_scale=1.0, sampler="euler")   # Z-Image-Turbo's (ZImageFamily.sampling_defaults)


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _write_gguf(path, tensors: dict, arch: str) -> None:
    """``tensors`` as city96's converter writes a transformer: the 2-D weights whose rows are whole Q8_0 blocks in
    Q8_0, the rest F32."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, t in tensors.items():
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[1] % 32 == 0 and name.endswith(".weight"):
            writer.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """ComfyUI's folders under --models-dir with the tiny model's files, the diffusers folder ``z-image-turbo`` beside
    them, the demo as --model; a server (not started) whose ComfyUI executor runs workflows on them."""
    from sdlite.demo import model_path
    from sdlite.server.backend import Server
    from sdlite.server.comfy.workflow import ComfyDirs, Executor
    from tests.test_qwen import _write_gguf as write_qwen_gguf

    root = tmp_path_factory.mktemp("zimage-server")
    models = root / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    pipe = tiny._pipeline(models / "z-image-turbo", transformer=TRANSFORMER)
    transformer = _state(pipe.transformer)
    comfy = {k: v.contiguous() for k, v in zimage_to_comfy(transformer.keys()).materialize(transformer).items()}
    save_file(comfy, models / "diffusion_models" / UNET)
    _write_gguf(models / "diffusion_models" / UNET_GGUF, comfy, "lumina2")
    qwen = _state(pipe.text_encoder)
    save_file({"model." + k: v for k, v in qwen.items()}, models / "text_encoders" / QWEN)
    write_qwen_gguf(models / "text_encoders" / QWEN_GGUF, qwen, QwenConfig(**tiny.QWEN), "qwen3",
                    q8=tuple(f"blk.{i}.ffn_{p}.weight" for i in range(3) for p in ("up", "gate")))
    vae = _state(pipe.vae)
    ldm = {k: v.contiguous() for k, v in vae_to_original(vae.keys(), prefix="").materialize(vae).items()}
    save_file(ldm, models / "vae" / AE)
    save_file(ldm, models / "text_encoders" / "not_a_text_encoder.safetensors")
    save_file({"model." + k: v for k, v in qwen.items() if "_norm." not in k},   # no q/k norms: a Gemma's, a Llama's
              models / "text_encoders" / "gemma_2_2b.safetensors")
    dirs = ComfyDirs(root / "input", root / "output", root / "temp")
    for folder in (dirs.input, dirs.output, dirs.temp):
        folder.mkdir()
    server = Server(model_path(), models, preload=False, engine_options=OPTIONS)
    yield SimpleNamespace(server=server, executor=Executor(server, dirs), models=models, dirs=dirs,
                          folder=models / "z-image-turbo", pipe=pipe)
    server.jobs.stop(1)


@pytest.fixture(scope="module")
def folder_engine(env):
    return Engine.load(env.folder, **OPTIONS)


def _files_engine(env, unet=UNET, qwen=QWEN):
    """sdlite's engine of ComfyUI's files, as ``sdlite generate --text-encoder`` opens them."""
    m = env.models
    source = open_model(m / "diffusion_models" / unet, text_encoders=[m / "text_encoders" / qwen, m / "vae" / AE])
    return Engine.load(source, **OPTIONS)


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _image(engine, **kw) -> np.ndarray:
    r = Request(**{"prompt": PROMPT, "width": SIZE, "height": SIZE, **DEFAULTS, **kw})
    return np.asarray(engine.generate(r).images[0])


# --- A1111, OpenAI and MCP ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(env):
    """The app (every protocol) over a server of the same models folder (the demo current until a test switches)."""
    from fastapi.testclient import TestClient

    from sdlite.demo import model_path
    from sdlite.server.app import build_app
    from sdlite.server.backend import Server

    server = Server(model_path(), env.models, preload=False, engine_options=OPTIONS)
    with TestClient(build_app(server)) as c:
        yield c, server


API = "/sdapi/v1"


def test_a1111_lists_switches_to_and_runs_zimage_with_its_defaults(client, folder_engine):
    """Listed, switched to; a txt2img that leaves steps, cfg and sampler out runs the Turbo's 8 steps of Euler at
    cfg 1 (its model card's), the engine's image, and says so in its info, parameters and infotext."""
    c, _ = client
    assert "z-image-turbo" in [m["model_name"] for m in c.get(f"{API}/sd-models").json()]
    assert c.post(f"{API}/options", json={"sd_model_checkpoint": "z-image-turbo"}).json() == {}
    assert c.get(f"{API}/options").json()["sd_model_checkpoint"].startswith("z-image-turbo")
    r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "seed": 8, "width": SIZE, "height": SIZE})
    assert r.status_code == 200, r.text
    got = _png(r.json()["images"][0])
    assert np.array_equal(got, _image(folder_engine, seed=8)) and got.std() > 10
    info = json.loads(r.json()["info"])
    assert (info["steps"], info["cfg_scale"], info["sampler_name"]) == (8, 1.0, "Euler")
    assert (r.json()["parameters"]["steps"], r.json()["parameters"]["cfg_scale"]) == (8, 1.0)
    assert "Steps: 8, Sampler: Euler" in info["infotexts"][0] and "CFG scale: 1," in info["infotexts"][0]


def test_a1111_cfg_scale_is_a1111s_cfg_and_forges_field_is_ignored(client, folder_engine):
    """Given steps and cfg_scale (A1111's cfg: diffusers' guidance_scale + 1) are used as given, with a negative
    prompt; Forge's distilled_cfg_scale, which its UI sends for every model, is ignored with a warning."""
    c, _ = client
    body = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": 3, "steps": 3, "cfg_scale": 3.5,
            "distilled_cfg_scale": 3.5, "sampler_name": "Euler", "width": SIZE, "height": SIZE,
            "override_settings": {"sd_model_checkpoint": "z-image-turbo"}}
    r = c.post(f"{API}/txt2img", json=body)
    assert r.status_code == 200, r.text
    got = _png(r.json()["images"][0])
    assert np.array_equal(got, _image(folder_engine, seed=3, steps=3, cfg_scale=3.5, negative_prompt=NEGATIVE))
    assert not np.array_equal(got, _image(folder_engine, seed=3, steps=3))   # the guidance is applied
    info = json.loads(r.json()["info"])
    assert info["steps"] == 3 and info["cfg_scale"] == 3.5
    assert any("distilled guidance scale" in w and "ignored" in w for w in info["warnings"])


def test_a1111_refusal_names_the_size(client):
    c, _ = client
    r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "steps": 1, "width": 72, "height": SIZE,
                                       "override_settings": {"sd_model_checkpoint": "z-image-turbo"}})
    assert r.status_code == 422 and "multiples of 16" in r.text and "72x64" in r.text


class Progress:
    """What run_plan reports through (a JobControl stand-in): each iteration's announced total, each step's."""

    interrupted, stop_reason = False, None

    def __init__(self):
        self.announced, self.steps = [], []

    def begin(self, *a): pass
    def info(self, *a): pass
    def set_preview(self, *a): pass

    def preview_due(self, step, total):
        return False

    def iteration(self, job_no, total):
        self.announced.append(total)

    def step(self, step, total):
        self.steps.append((step, total))


def test_a1111_hires_progress_announces_the_steps_the_engine_runs(client):
    """A hires fix on Z-Image (flow matching) at 5 steps and denoising 0.5: the second pass runs 3 of its 5 planned
    steps (StableDiffusion3Img2ImgPipeline's rule, which truncates the steps skipped), where a DDPM model's rule gives
    2. The total the job announces before it runs is the 8 steps the engine then counts."""
    from sdlite.server.a1111 import api as a1111
    from sdlite.server.backend import run_plan

    _, server = client
    plan = server.build_plan(a1111.Txt2ImgRequest(
        prompt=PROMPT, seed=2, steps=5, width=SIZE, height=SIZE, enable_hr=True, hr_scale=1.5, hr_upscaler="Latent",
        denoising_strength=0.5))
    progress = Progress()
    outcome = run_plan(server.engines, server.find_checkpoint("z-image-turbo"), plan, progress)
    assert outcome.results[0].images[0].size == (96, 96)
    assert progress.steps == [(i, 8) for i in range(1, 9)]
    assert progress.announced == [8]


def _limited(env, max_steps: int):
    from fastapi.testclient import TestClient

    from sdlite.demo import model_path
    from sdlite.server.app import build_app
    from sdlite.server.backend import Server
    from sdlite.server.limits import Limits

    return TestClient(build_app(Server(model_path(), env.models, preload=False, engine_options=OPTIONS,
                                       limits=Limits(max_steps=max_steps))))


def test_a1111_max_steps_checks_the_steps_the_model_runs(env, folder_engine):
    """--max-steps on a request that leaves steps out is checked against the steps the model runs: Z-Image's 8 pass
    a limit of 10 (A1111's default of 50 would not), and are refused under a limit of 5, naming them; given steps are
    checked as given, before the job is queued; on a model without defaults of its own, A1111's 50 are checked."""
    body = {"prompt": PROMPT, "seed": 8, "width": SIZE, "height": SIZE,
            "override_settings": {"sd_model_checkpoint": "z-image-turbo"}}
    with _limited(env, 10) as c:
        r = c.post(f"{API}/txt2img", json=body)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["info"])["steps"] == 8
        assert np.array_equal(_png(r.json()["images"][0]), _image(folder_engine, seed=8))
        r = c.post(f"{API}/txt2img", json={**body, "steps": 12})
        assert r.status_code == 422 and "steps=12 is over this server's limit of 10 steps" in r.text
        r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "width": SIZE, "height": SIZE})   # the demo model
        assert r.status_code == 422, r.text
        assert "steps=50 (the default, as the request leaves steps out) is over this server's limit of 10" in r.text
    with _limited(env, 5) as c:
        r = c.post(f"{API}/txt2img", json=body)
        assert r.status_code == 422, r.text
        assert ("steps=8 (the model's default, as the request leaves steps out) is over this server's limit of 5 "
                "steps (--max-steps)") in r.text


def test_batch_jobs_take_the_models_defaults_where_they_leave_them_out(env, folder_engine, tmp_path):
    """`sdlite batch` on the Z-Image folder: a line in either vocabulary that leaves steps, cfg and sampler out runs
    the Turbo's 8 steps of Euler at cfg 1, the engine's image; what a line gives is kept (3 steps, the family's
    sampler and cfg for the rest). Two lines of consecutive seeds, one giving A1111's 50 steps, are not batched
    together: the other runs the model's 8."""
    from sdlite.images import parse_infotext
    from sdlite.scale.batch import run_batch

    jobs = tmp_path / "jobs.jsonl"
    lines = [{"id": "api", "prompt": PROMPT, "seed": 8, "width": SIZE, "height": SIZE},
             {"id": "request", "prompt": PROMPT, "seed": 4, "width": SIZE, "height": SIZE, "schedule": "discrete"},
             {"id": "given", "prompt": PROMPT, "seed": 2, "width": SIZE, "height": SIZE, "steps": 3},
             {"id": "fifty", "prompt": PROMPT, "seed": 20, "width": SIZE, "height": SIZE, "steps": 50},
             {"id": "after", "prompt": PROMPT, "seed": 21, "width": SIZE, "height": SIZE}]
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    summary = run_batch(jobs, out, model=str(env.folder), engine_options=OPTIONS, progress=False)
    assert summary.done == 5 and not summary.failed, summary.failed

    def made(name):
        with Image.open(out / f"{name}.png") as im:
            return np.asarray(im.convert("RGB")), parse_infotext(im.info["parameters"])

    for name, seed, steps in (("api", 8, 8), ("request", 4, 8), ("given", 2, 3), ("after", 21, 8)):
        pixels, params = made(name)
        assert (params["Steps"], params["Sampler"], params["CFG scale"]) == (str(steps), "Euler", "1"), (name, params)
        assert np.array_equal(pixels, _image(folder_engine, seed=seed, steps=steps)), name
    assert made("fifty")[1]["Steps"] == "50"


def test_openai_generation_with_zimage(client, folder_engine):
    """/v1/images/generations naming the Z-Image model: the engine's image at the family's defaults, and at the
    steps the request gives."""
    c, _ = client
    body = {"model": "z-image-turbo", "prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "seed": 4}
    r = c.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == f"{SIZE}x{SIZE}"
    assert np.array_equal(_png(r.json()["data"][0]["b64_json"]), _image(folder_engine, seed=4))
    r = c.post("/v1/images/generations", json={**body, "steps": 2, "cfg_scale": 2.0})
    assert r.status_code == 200, r.text
    assert np.array_equal(_png(r.json()["data"][0]["b64_json"]), _image(folder_engine, seed=4, steps=2,
                                                                          cfg_scale=2.0))


def test_mcp_generate_with_zimage(client, folder_engine):
    """MCP's generate tool, through the SDK's client in this process, naming the Z-Image model: the engine's image at
    the family's defaults, its infotext with them."""
    import anyio
    from mcp import Client

    from sdlite.server.mcp.server import mcp_app
    from sdlite.server.mcp.tools import Tools

    _, server = client

    async def call():
        async with Client(mcp_app(Tools(server))) as mcp:
            return await mcp.call_tool("generate", {"prompt": PROMPT, "model": "z-image-turbo", "seed": 6,
                                                    "width": SIZE, "height": SIZE})

    result = anyio.run(call)
    assert not result.is_error, result.content
    image = next(c for c in result.content if c.type == "image")
    assert np.array_equal(_png(image.data), _image(folder_engine, seed=6))
    assert result.structured_content["model"] == "z-image-turbo"
    assert "Steps: 8, Sampler: Euler" in result.structured_content["infotexts"][0]


# --- ComfyUI --------------------------------------------------------------------------------------------------------

def stock_workflow(seed=5, steps=4, cfg=1.0, shift=3.0, unet="UNETLoader", clip="CLIPLoader", unet_name=UNET,
                   clip_name=QWEN, sampler="euler"):
    """ComfyUI's stock Z-Image Turbo workflow (its node ids), in API format; euler in place of its res_multistep
    unless ``sampler`` says."""
    model = {"unet_name": unet_name} | ({"weight_dtype": "default"} if unet == "UNETLoader" else {})
    return {
        "16": {"class_type": unet, "inputs": model},
        "18": {"class_type": clip, "inputs": {"clip_name": clip_name, "type": "lumina2"}
               | ({"device": "default"} if clip == "CLIPLoader" else {})},
        "17": {"class_type": "VAELoader", "inputs": {"vae_name": AE}},
        "11": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["16", 0], "shift": shift}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["18", 0]}},
        "7": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["6", 0]}},
        "13": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "3": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": "simple", "denoise": 1.0,
            "model": ["11", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["13", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["17", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "z-image", "images": ["8", 0]}},
    }


def run(env, prompt) -> np.ndarray:
    from sdlite.server.comfy.workflow import validate
    from tests.test_comfy_workflow import Control

    history = env.executor.run("pid", prompt, validate(prompt, env.server), Control(), lambda *a: None)
    with Image.open(env.dirs.output / history["9"]["images"][0]["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def own_image(engine, seed=5, steps=4) -> np.ndarray:
    """sdlite's engine on the files, with ComfyUI's KSampler conventions (the simple scheduler, its noise)."""
    return _image(engine, seed=seed, steps=steps, schedule="simple", negative_prompt="", noise="comfy")


def refusal(env, prompt) -> dict:
    from sdlite.server.comfy.workflow import PromptError, validate

    with pytest.raises(PromptError) as caught:
        validate(prompt, env.server)
    return caught.value.node_errors


def test_the_folders_make_the_combo_lists(env):
    from sdlite.server.comfy.workflow import object_info

    info = object_info(env.server)
    assert info["UNETLoader"]["input"]["required"]["unet_name"][0] == [UNET]
    assert info["UnetLoaderGGUF"]["input"]["required"]["unet_name"][0] == [UNET_GGUF]
    assert info["CLIPLoader"]["input"]["required"]["clip_name"][0] == [
        "gemma_2_2b.safetensors", "not_a_text_encoder.safetensors", QWEN]
    assert QWEN_GGUF in info["CLIPLoaderGGUF"]["input"]["required"]["clip_name"][0]
    assert "lumina2" in info["CLIPLoader"]["input"]["required"]["type"][0]
    assert info["ModelSamplingAuraFlow"]["input"]["required"]["shift"][1]["default"] == 1.73
    assert info["ConditioningZeroOut"]["output"] == ["CONDITIONING"]


def test_stock_workflow_gives_sdlites_own_image(env):
    """The stock workflow (euler for its res_multistep, cfg 1 with a zeroed negative, shift 3: the model's own) is one
    engine of the three files and sdlite's engine's image of them; queued again with a new seed, nothing loads."""
    got = run(env, stock_workflow())
    engine = _files_engine(env)
    assert np.array_equal(got, own_image(engine)) and got.std() > 10
    engines = env.server.engines
    loaded = dict(engines._loaded)
    (key,) = loaded
    assert key[1].endswith(AE) and [p.rsplit("/", 1)[-1] for p in key[2]] == [QWEN]
    again = run(env, stock_workflow(seed=6))
    assert dict(engines._loaded) == loaded and np.array_equal(again, own_image(engine, seed=6))


def test_checkpoint_loader_with_the_diffusers_folder(env, folder_engine):
    """The folder as a checkpoint (CheckpointLoaderSimple: its MODEL, CLIP and VAE) in the same graph: the engine's
    image of the folder."""
    prompt = stock_workflow(seed=9)
    for node in ("16", "17", "18"):
        del prompt[node]
    prompt["4"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "z-image-turbo"}}
    prompt["11"]["inputs"]["model"], prompt["8"]["inputs"]["vae"] = ["4", 0], ["4", 2]
    prompt["6"]["inputs"]["clip"] = ["4", 1]
    assert np.array_equal(run(env, prompt), own_image(folder_engine, seed=9))


def test_model_sampling_aura_flow_shifts_the_sampler(env):
    """ModelSamplingAuraFlow's shift is the flow shift of ComfyUI's sigma table (its multiplier 1 changes only what
    the network is given): shift 2 is the engine's run at shift 2, another image than the model's own 3."""
    from sdlite.pipeline.latents import LatentRun
    from sdlite.server.comfy import images as comfy_images

    got = run(env, stock_workflow(seed=7, shift=2.0))
    (engine,) = env.server.engines._loaded.values()
    r = Request(prompt=PROMPT, negative_prompt="", steps=4, cfg_scale=1.0, sampler="euler", schedule="simple", seed=7)
    empty = torch.zeros(1, 16, SIZE // 8, SIZE // 8)
    latents = engine.sample_latents(r, LatentRun(empty, shift=2.0)).latents
    want = np.asarray(comfy_images.to_pil(comfy_images.decoded_to_image(engine.decode_scaled(latents)))[0])
    assert np.array_equal(got, want)
    assert not np.array_equal(got, run(env, stock_workflow(seed=7)))


def test_gguf_loaders_give_sdlites_own_image(env):
    """city96's UnetLoaderGGUF and CLIPLoaderGGUF (type lumina2) with a Q8_0 transformer and a Q8_0 Qwen3 in
    llama.cpp's names: sdlite's engine's image of those files."""
    got = run(env, stock_workflow(unet="UnetLoaderGGUF", clip="CLIPLoaderGGUF", unet_name=UNET_GGUF,
                                  clip_name=QWEN_GGUF))
    assert np.array_equal(got, own_image(_files_engine(env, UNET_GGUF, QWEN_GGUF)))


def test_unet_loader_fp8_weight_dtype(env):
    """UNETLoader's weight_dtype fp8_e4m3fn on the Z-Image file: the image of the file whose Linear weights (every 2-D
    weight) were cast to fp8 and back by torch, from a transformer that keeps them one byte each."""
    from sdlite.engine.lowbit import LowBitLinear

    folder = env.models / "diffusion_models"
    save_file({k: v.to(torch.float8_e4m3fn).to(v.dtype) if v.ndim == 2 and k.endswith(".weight") else v
               for k, v in load_file(folder / UNET).items()}, folder / UNET_FP8)
    try:
        prompt = stock_workflow()
        prompt["16"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
        got = run(env, prompt)
        (key, engine), = env.server.engines._loaded.items()
        assert key[-1] == "fp8_e4m3fn"
        with engine.models.use("transformer") as transformer:
            linears = [m for m in transformer.modules() if isinstance(m, (LowBitLinear, torch.nn.Linear))]
        assert linears and all(isinstance(m, LowBitLinear) and m.qtype == "F8_E4M3" for m in linears)
        assert np.array_equal(got, run(env, stock_workflow(unet_name=UNET_FP8)))
    finally:
        (folder / UNET_FP8).unlink()


def test_stock_workflow_with_its_res_multistep(env):
    """The stock workflow as ComfyUI ships it, with its res_multistep sampler: the engine's own res_multistep run
    with ComfyUI's noise on the same files, another image than euler's."""
    got = run(env, stock_workflow(sampler="res_multistep"))
    engine = _files_engine(env)
    want = _image(engine, seed=5, steps=4, sampler="res_multistep", schedule="simple", negative_prompt="",
                  noise="comfy")
    assert np.array_equal(got, want) and got.std() > 10
    assert not np.array_equal(got, own_image(engine))


def test_the_workflow_with_a_custom_sampler_is_ksamplers(env):
    """SamplerCustomAdvanced with RandomNoise, CFGGuider, KSamplerSelect (res_multistep) and BasicScheduler over
    ModelSamplingAuraFlow's model (shift 2): the KSampler workflow's image (:mod:`sdlite.server.comfy.custom`)."""
    prompt = stock_workflow(seed=4, shift=2.0, sampler="res_multistep")
    want = run(env, prompt)
    prompt.update({
        "30": {"class_type": "RandomNoise", "inputs": {"noise_seed": 4}},
        "31": {"class_type": "CFGGuider", "inputs": {"model": ["11", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                     "cfg": 1.0}},
        "32": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
        "33": {"class_type": "BasicScheduler", "inputs": {"model": ["11", 0], "scheduler": "simple", "steps": 4,
                                                          "denoise": 1.0}},
        "3": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["30", 0], "guider": ["31", 0],
                                                                "sampler": ["32", 0], "sigmas": ["33", 0],
                                                                "latent_image": ["13", 0]}}})
    assert np.array_equal(run(env, prompt), want) and want.std() > 10


@pytest.mark.parametrize("node,change,input_name,words", [
    ("18", {"clip_name": "not_a_text_encoder.safetensors"}, "clip_name", "holds a VAE"),
    ("18", {"clip_name": "gemma_2_2b.safetensors"}, "clip_name", "holds an LLM that is no Qwen"),
    ("18", {"type": "sd3"}, "clip_name", "is a Qwen LLM: load it with type 'lumina2' (Z-Image)"),
    ("18", {"type": "wan"}, "type", "'wan': sdlite takes separate text-encoder files for Z-Image (lumina2)"),
    ("16", {"weight_dtype": "fp8_e4m3fn"}, None, None),
])
def test_loader_inputs_that_do_not_fit_are_refused_naming_them(env, node, change, input_name, words):
    prompt = stock_workflow()
    prompt[node]["inputs"].update(change)
    if input_name is None:   # passes
        assert validate_ok(env, prompt)
        return
    (error,) = refusal(env, prompt)[node]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == input_name
    assert words in error["details"]


def validate_ok(env, prompt) -> bool:
    from sdlite.server.comfy.workflow import validate

    return validate(copy.deepcopy(prompt), env.server) == ["9"]


def _spy_guidance(monkeypatch) -> list[dict]:
    """The conditioning every guided denoiser call gets (CFGDenoiser's keyword arguments), recorded."""
    from sdlite.sampling.denoisers import CFGDenoiser

    calls, original = [], CFGDenoiser.__call__

    def spy(self, x, sigma, **kw):
        calls.append({"scale": self.scale, **kw})
        return original(self, x, sigma, **kw)

    monkeypatch.setattr(CFGDenoiser, "__call__", spy)
    return calls


def test_a_zeroed_negative_at_cfg_above_1_is_zeros_of_the_positives_shape(env, monkeypatch):
    """The stock workflow at cfg 2: ConditioningZeroOut's negative is what ComfyUI makes of the positive, zeros of its
    shape: a caption of the positive's length, all zeros, beside the positive's own encoding. The image is diffusers'
    ZImagePipeline's given those zeros as its negative embeddings, another than at cfg 1 and than with an empty
    negative prompt at cfg 2."""
    calls = _spy_guidance(monkeypatch)
    got = run(env, stock_workflow(cfg=2.0))
    assert len(calls) == 4 and all(kw["scale"] == 2.0 for kw in calls)
    for kw in calls:
        context, uncond = kw["context"], kw["uncond"]
        assert uncond.shape == context.shape and not uncond.any() and context.abs().sum() > 0
        assert torch.equal(kw["uncond_added"]["context_lengths"], kw["added"]["context_lengths"])
        assert int(kw["added"]["context_lengths"][0]) == context.shape[1]   # the positive's caption, unpadded
    # diffusers' ZImagePipeline given the same zeros as its negative embeddings (guidance_scale 1: cfg 2)
    embeds, _ = env.pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False)
    expected = tiny._reference(env.pipe, SIZE, SIZE, prompt_embeds=embeds, guidance_scale=1.0,
                               negative_prompt_embeds=[torch.zeros_like(e) for e in embeds], num_inference_steps=4,
                               generator=torch.Generator().manual_seed(5))
    assert np.abs(got.astype(np.int16) - expected[0]).max() <= tiny.MAX_PIXEL_DIFF and got.std() > 10
    (engine,) = env.server.engines._loaded.values()
    empty_negative = _image(engine, seed=5, steps=4, cfg_scale=2.0, schedule="simple", negative_prompt="",
                            noise="comfy")
    assert not np.array_equal(got, empty_negative) and not np.array_equal(got, run(env, stock_workflow()))


def test_a_zeroed_positive_is_zeros_too(env, monkeypatch):
    """ConditioningZeroOut as the positive (the prompt as the negative): ComfyUI guides from zeros; so does sdlite."""
    calls = _spy_guidance(monkeypatch)
    prompt = stock_workflow(cfg=2.0, steps=2)
    prompt["3"]["inputs"].update(positive=["7", 0], negative=["6", 0])
    run(env, prompt)
    assert len(calls) == 2
    for kw in calls:
        assert not kw["context"].any() and kw["uncond"].abs().sum() > 0


def test_a_side_of_a_multiple_of_8_runs_as_comfyui_runs_it(env):
    """A latent of 72 pixels' width (an odd latent side: ComfyUI pads it to whole patches and crops back) is drawn at
    that size, not refused."""
    prompt = stock_workflow()
    prompt["13"]["inputs"].update(width=72)
    assert run(env, prompt).shape[:2] == (prompt["13"]["inputs"]["height"], 72)


@pytest.mark.parametrize("change,words", [
    ({"11": {"class_type": "ModelSamplingFlux"}}, "ModelSamplingFlux: UNETLoader (node 16) unet_name "
                                                  f"'{UNET}' has a fixed shift (3)"),
])
def test_what_does_not_fit_at_run_time_is_an_error_naming_the_node(env, change, words):
    prompt = stock_workflow()
    for node, inputs in change.items():
        if "class_type" in inputs:   # ModelSamplingFlux in place of ModelSamplingAuraFlow
            prompt[node] = {"class_type": inputs["class_type"], "inputs": {
                "model": ["16", 0], "max_shift": 1.15, "base_shift": 0.5, "width": SIZE, "height": SIZE}}
        else:
            prompt[node]["inputs"].update(inputs)
    with pytest.raises(Exception) as caught:
        run(env, prompt)
    assert words in str(caught.value)


# --- Ray ------------------------------------------------------------------------------------------------------------

def test_ray_ingress_reads_the_llm_encoders_width(env):
    """`sdlite serve --ray`'s ingress reads the current model's text width without loading it (for /embeddings): the
    width of Z-Image's Qwen3 as of a CLIP, from the spec's encoder of the prompts."""
    from sdlite.scale.ingress import ClusterServer

    checkpoint = SimpleNamespace(path=env.folder)
    stub = SimpleNamespace(checkpoints=SimpleNamespace(current=checkpoint), _widths={})
    assert ClusterServer.text_width(stub) == tiny.TEXT_WIDTH
