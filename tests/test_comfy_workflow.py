"""ComfyUI API workflows on the demo model (sdlite/server/comfy/workflow.py, nodes.py): the node catalog,
validation with ComfyUI's error shapes, execution (text to image bit-equal to Engine.generate(noise="comfy"), LoRA, ControlNet,
image to image, inpainting, hires, KSamplerAdvanced's split run, model upscaling), the output cache, saving, interrupts,
and ComfyUI's schedulers against an independent computation of its published formulas."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.errors import StopSampling
from sdlite.pipeline import Request, RequestError
from sdlite.pipeline import validate as validate_request
from sdlite.pipeline.latents import LatentRun
from sdlite.sampling.comfy import comfy_sigmas
from sdlite.server.backend import Server
from sdlite.server.comfy.workflow import ComfyDirs, Executor, Interrupted, PromptError, object_info, validate

SIZE = 64
STEPS = 3


class Control:
    """A JobControl stand-in: counts steps and previews, interrupts after ``stop_after`` steps; ``watched``: what
    ``preview_wanted`` says (whether a client would see a preview)."""

    def __init__(self, stop_after: int | None = None, watched: bool = True):
        self.stop_after, self.steps, self.interrupted, self.watched, self.previews = stop_after, 0, False, watched, 0

    def begin(self, *a): pass
    def iteration(self, *a): pass
    def info(self, *a): pass

    def set_preview(self, *a):
        self.previews += 1

    def preview_wanted(self):
        return self.watched

    def step(self, step, total):
        self.steps += 1
        if self.stop_after is not None and self.steps >= self.stop_after:
            self.interrupted = True
            if step < total:
                raise StopSampling()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy")
    dirs = ComfyDirs(root / "input", root / "output", root / "temp")
    for folder in (dirs.input, dirs.output, dirs.temp):
        folder.mkdir()
    server = Server(preload=False)
    executor = Executor(server, dirs)
    engine = server.engines.get(server.checkpoints.current)
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    source.save(dirs.input / "source.png")
    rgba = source.convert("RGBA")
    alpha = np.full((SIZE, SIZE), 255, np.uint8)
    alpha[:, SIZE // 2:] = 0   # the right half transparent: LoadImage's mask (1 - alpha) repaints it
    rgba.putalpha(Image.fromarray(alpha))
    rgba.save(dirs.input / "holed.png")
    yield server, executor, engine, dirs
    server.jobs.stop(1)


def run(env, prompt, control=None, extra_data=None):
    server, executor, _, _ = env
    events = []
    outputs = validate(prompt, server)
    history = executor.run("pid", prompt, outputs, control or Control(),
                           lambda event, data: events.append((event, data)), extra_data=extra_data)
    return history, events


def txt2img(ckpt, seed=7, sampler="euler", scheduler="normal", prefix="t2i", batch=1):
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": batch}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": STEPS, "cfg": 6.0, "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0,
            "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}},
    }


def saved(dirs, entry) -> np.ndarray:
    folder = dirs.output if entry["type"] == "output" else dirs.temp
    with Image.open(folder / entry["subfolder"] / entry["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def ckpt_name(env) -> str:
    return env[0].checkpoints.current.name


def generate(env, **kw) -> np.ndarray:
    r = Request(prompt="a red circle", negative_prompt="blurry", width=SIZE, height=SIZE, steps=STEPS, cfg_scale=6.0,
                noise="comfy", **kw)
    return [np.asarray(im) for im in env[2].generate(r).images]


# --- the catalog ------------------------------------------------------------------------------------------

def test_object_info_describes_the_nodes_with_this_servers_lists(env):
    info = object_info(env[0])
    wanted = ("CheckpointLoaderSimple CLIPLoader DualCLIPLoader TripleCLIPLoader UNETLoader VAELoader LoraLoader "
              "LoraLoaderModelOnly ControlNetLoader UpscaleModelLoader CLIPSetLastLayer CLIPTextEncode "
              "ConditioningCombine ConditioningSetArea ConditioningSetAreaPercentage ConditioningSetAreaStrength "
              "ControlNetApplyAdvanced EmptyLatentImage EmptySD3LatentImage "
              "LatentUpscale LatentUpscaleBy SetLatentNoiseMask KSampler KSamplerAdvanced VAEDecode VAEEncode "
              "VAEEncodeForInpaint LoadImage LoadImageMask ImageScale ImageScaleBy ImageUpscaleWithModel SaveImage "
              "PreviewImage FluxGuidance ModelSamplingSD3 ModelSamplingFlux UnetLoaderGGUF CLIPLoaderGGUF "
              "DualCLIPLoaderGGUF TripleCLIPLoaderGGUF ModelSamplingAuraFlow ConditioningZeroOut "
              "EmptyFlux2LatentImage Flux2Scheduler ReferenceLatent SamplerCustomAdvanced SamplerCustom RandomNoise "
              "DisableNoise CFGGuider BasicGuider KSamplerSelect BasicScheduler FluxKontextImageScale ImageStitch "
              "LoadImageOutput FluxKontextMultiReferenceLatentMethod TextEncodeQwenImageEdit TextEncodeQwenImageEditPlus "
              "CFGNorm ImageScaleToTotalPixels").split()
    assert sorted(info) == sorted(wanted)
    ck = info["CheckpointLoaderSimple"]
    assert ck["input"]["required"]["ckpt_name"][0] == [ckpt_name(env)]
    assert ck["output"] == ["MODEL", "CLIP", "VAE"] and ck["output_node"] is False and ck["category"] == "loaders"
    ks = info["KSampler"]["input"]["required"]
    assert ks["steps"] == ["INT", {"default": 20, "min": 1, "max": 1000, "step": 1}]
    assert "euler_ancestral" in ks["sampler_name"][0] and "dpm_2" not in ks["sampler_name"][0]
    assert {"normal", "karras", "simple", "sgm_uniform"} <= set(ks["scheduler"][0])
    assert info["KSampler"]["input_order"]["required"][:3] == ["model", "seed", "steps"]
    assert "demo_teal.safetensors" in info["LoraLoader"]["input"]["required"]["lora_name"][0]
    assert "demo-4x.safetensors" in info["UpscaleModelLoader"]["input"]["required"]["model_name"][0]
    assert "demo-position" in info["ControlNetLoader"]["input"]["required"]["control_net_name"][0]
    assert {"holed.png", "source.png"} <= set(info["LoadImage"]["input"]["required"]["image"][0])
    assert info["SaveImage"]["output_node"] is True and info["SaveImage"]["input"]["hidden"]["prompt"] == "PROMPT"
    json.dumps(info)   # all of it JSON


# --- validation -----------------------------------------------------------------------------------------------

def refusal(env, prompt) -> dict:
    with pytest.raises(PromptError) as e:
        validate(prompt, env[0])
    return e.value.body()


def test_validation_errors_have_comfyuis_shapes(env):
    good = txt2img(ckpt_name(env))
    assert validate(good, env[0]) == ["9"]
    body = refusal(env, {**good, "10": {"class_type": "FancyUpscaler", "inputs": {}}})
    assert body["error"] == {"type": "invalid_prompt", "message": "Cannot execute because node FancyUpscaler does "
                             "not exist.", "details": "Node ID '#10'", "extra_info": {}}
    assert refusal(env, {"1": {"inputs": {}}})["error"]["type"] == "invalid_prompt"
    no_out = {k: v for k, v in good.items() if k != "9"}
    assert refusal(env, no_out)["error"]["type"] == "prompt_no_outputs"

    bad = copy.deepcopy(good)
    ks = bad["3"]["inputs"]
    del ks["seed"]
    ks.update(steps=0, cfg="strong", sampler_name="dpm_2", scheduler="karras", positive=["5", 0])
    bad["5"]["inputs"]["width"] = 10 ** 9
    body = refusal(env, bad)
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    errors = {e["extra_info"]["input_name"]: e for e in body["node_errors"]["3"]["errors"]}
    assert body["node_errors"]["3"]["class_type"] == "KSampler"
    assert body["node_errors"]["3"]["dependent_outputs"] == ["9"]
    assert errors["seed"]["type"] == "required_input_missing"
    assert errors["steps"]["type"] == "value_smaller_than_min"
    assert errors["cfg"]["type"] == "invalid_input_type"
    assert errors["sampler_name"]["type"] == "value_not_in_list" and "dpm_2" in errors["sampler_name"]["details"]
    assert errors["positive"]["type"] == "return_type_mismatch"
    assert errors["positive"]["extra_info"]["received_type"] == "LATENT"
    assert body["node_errors"]["5"]["errors"][0]["type"] == "value_bigger_than_max"

    looped = copy.deepcopy(good)
    looped["5"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["3", 0], "upscale_method": "area",
                                                                "scale_by": 1.0}}
    body = refusal(env, looped)
    assert body["error"]["message"] == "Dependency cycle detected" and "'#3'" in body["error"]["details"]

    dangling = copy.deepcopy(good)
    dangling["8"]["inputs"]["samples"] = ["99", 0]
    assert refusal(env, dangling)["node_errors"]["8"]["errors"][0]["type"] == "bad_linked_input"


@pytest.mark.parametrize("node,input_name,feeds", [
    ({"class_type": "LatentUpscale", "inputs": {"samples": ["5", 0], "upscale_method": "bislerp", "width": 128,
                                                "height": 128, "crop": "disabled"}}, "upscale_method",
     "latent_image"),
])
def test_what_sdlite_cannot_honour_is_refused_naming_the_input(env, node, input_name, feeds):
    prompt = txt2img(ckpt_name(env))
    node = copy.deepcopy(node)
    prompt["20"] = node
    prompt["3"]["inputs"][feeds] = ["20", 0]
    body = refusal(env, prompt)
    (error,) = body["node_errors"]["20"]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == input_name
    assert "sdlite" in error["details"] and body["node_errors"]["20"]["dependent_outputs"] == ["9"]


# --- running workflows ----------------------------------------------------------------------------------------

def test_txt2img_equals_generate_and_saves_as_comfyui(env):
    _, _, _, dirs = env
    (dirs.output / "t2i_00001_.png").write_bytes(b"someone else's")   # never overwritten
    prompt = txt2img(ckpt_name(env), batch=2)
    history, events = run(env, prompt, extra_data={"extra_pnginfo": {"workflow": {"nodes": [1]}}})
    entries = history["9"]["images"]
    assert [e["filename"] for e in entries] == ["t2i_00002_.png", "t2i_00003_.png"]
    assert (dirs.output / "t2i_00001_.png").read_bytes() == b"someone else's"
    expected = generate(env, seed=7, sampler="euler", schedule="normal", batch_size=2)
    for entry, want in zip(entries, expected):
        assert np.array_equal(saved(dirs, entry), want)
    with Image.open(dirs.output / entries[0]["filename"]) as im:
        assert json.loads(im.text["prompt"]) == prompt and json.loads(im.text["workflow"]) == {"nodes": [1]}
    names = [e for e, _ in events if e not in ("preview",)]
    assert names[:2] == ["execution_start", "execution_cached"] and names[-1] == "executed"
    progress = [d for e, d in events if e == "progress"]
    assert [p["value"] for p in progress] == [1, 2, 3] and progress[0]["node"] == "3"
    assert any(e == "preview" and isinstance(d["image"], Image.Image) for e, d in events)


def test_previews_are_made_only_while_someone_would_see_them(env):
    """KSampler makes a preview at each step while the control says a client would see it, and none otherwise."""
    for seed, watched in ((21, False), (22, True)):
        control = Control(watched=watched)
        _, events = run(env, txt2img(ckpt_name(env), seed=seed, prefix="watched"), control)
        previews = [data["image"] for event, data in events if event == "preview"]
        assert control.steps == STEPS and control.previews == len(previews) == (STEPS if watched else 0)
        assert all(image.size == (SIZE, SIZE) for image in previews)


def test_a_new_seed_reruns_only_the_sampler_onward(env):
    server, executor, _, dirs = env
    prompt = txt2img(ckpt_name(env), seed=11, sampler="euler_ancestral", scheduler="karras", prefix="cache")
    run(env, prompt)
    prompt["3"]["inputs"]["seed"] = 2**63 + 12   # ComfyUI's seeds are 64-bit
    history, events = run(env, prompt)
    assert executor.executed == ["3", "8", "9"]
    cached = next(d for e, d in events if e == "execution_cached")
    assert sorted(cached["nodes"]) == ["4", "5", "6", "7"]
    assert np.array_equal(saved(dirs, history["9"]["images"][0]),
                          generate(env, seed=2**63 + 12, sampler="euler_a", schedule="karras")[0])
    again, _ = run(env, prompt)          # nothing changed: nothing runs, the output is reported again
    assert executor.executed == [] and again == history


def test_comfy_noise_draws_the_batch_from_one_generator(env):
    engine = env[2]
    base = dict(prompt="a red circle", width=SIZE, height=SIZE, steps=2, sampler="euler")
    two = engine.generate(Request(seed=3, batch_size=2, noise="comfy", **base)).latents
    one = engine.generate(Request(seed=3, noise="comfy", **base)).latents
    next_seed = engine.generate(Request(seed=4, noise="comfy", **base)).latents
    assert torch.equal(two[:1], one) and not torch.allclose(two[1:], next_seed)
    for bad, words in ((dict(noise="numpy"), "noise 'numpy'"),
                       (dict(noise="comfy", init_image=Image.new("RGB", (8, 8))),
                        "init_image does not run with noise='comfy'"),
                       (dict(noise="comfy", schedule="kl_optimal"), "schedule 'kl_optimal'"),
                       (dict(noise="comfy", sampler="dpm_2"), "unknown sampler")):
        with pytest.raises(RequestError, match=words):
            validate_request(Request(prompt="a", **bad))


def test_step_noise_comes_from_a_generator_seeded_seed_plus_one_on_a_cpu(env, monkeypatch):
    import sdlite.pipeline.latents as latents

    made = []

    def recording(seed, device="cpu"):
        made.append(latents_step_generator(seed, device))
        return made[-1]

    latents_step_generator = latents.step_generator
    monkeypatch.setattr(latents, "step_generator", recording)
    r = Request(prompt="a red circle", steps=2, sampler="euler_a", schedule="normal", seed=40)
    out = env[2].sample_latents(r, LatentRun(torch.zeros(1, 4, SIZE // 8, SIZE // 8))).latents
    (generator,) = made
    assert generator.initial_seed() == 41 and generator.device.type == "cpu"
    fresh = torch.Generator().manual_seed(41)
    torch.randn(out.shape, generator=fresh)
    torch.randn(out.shape, generator=fresh)     # one whole-batch draw per step, two steps
    assert torch.equal(generator.get_state(), fresh.get_state())


def test_ksampler_advanced_split_equals_one_run(env):
    engine = env[2]
    r = Request(prompt="a red circle", steps=STEPS, cfg_scale=5.0, sampler="euler", schedule="simple", seed=9)
    zeros = torch.zeros(1, 4, SIZE // 8, SIZE // 8)
    whole = engine.sample_latents(r, LatentRun(zeros)).latents
    first = engine.sample_latents(r, LatentRun(zeros, start_step=0, last_step=2)).latents
    rest = engine.sample_latents(r, LatentRun(first, start_step=2, last_step=10000, add_noise=False,
                                              force_full_denoise=True)).latents
    assert torch.equal(rest, whole) and not torch.equal(first, whole)
    untouched = engine.sample_latents(r, LatentRun(first, start_step=STEPS, add_noise=False)).latents
    assert torch.equal(untouched, first)


def test_inpainting_keeps_the_unmasked_latents(env, monkeypatch):
    engine = env[2]
    r = Request(prompt="a red circle", steps=STEPS, cfg_scale=5.0, sampler="euler_a", schedule="normal", seed=2)
    source = torch.randn(2, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 1, SIZE, SIZE)
    mask[..., :, SIZE // 2:] = 1
    out = engine.sample_latents(r, LatentRun(source, mask=mask)).latents
    keep = slice(0, SIZE // 16 - 1)     # latent columns whose bilinear mask is 0
    assert torch.allclose(out[..., keep], source[..., keep], atol=1e-5)   # the last step's x - (x - x0): rounding
    assert not torch.allclose(out[..., -2:], source[..., -2:], atol=1e-2)
    monkeypatch.setattr(engine, "unet_piece_bytes", 1, raising=False)   # one image per UNet call: the same
    assert torch.equal(engine.sample_latents(r, LatentRun(source, mask=mask)).latents, out)


def test_img2img_inpaint_hires_lora_controlnet_and_upscale_workflows(env):
    _, _, engine, dirs = env
    ck = ckpt_name(env)
    prompt = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ck}},
        "10": {"class_type": "LoraLoader", "inputs": {"model": ["4", 0], "clip": ["4", 1], "lora_name":
                                                      "demo_teal.safetensors", "strength_model": 0.8,
                                                      "strength_clip": 0.8}},
        "11": {"class_type": "CLIPSetLastLayer", "inputs": {"clip": ["10", 1], "stop_at_clip_layer": -1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["11", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["11", 0]}},
        "12": {"class_type": "LoadImage", "inputs": {"image": "source.png"}},
        "13": {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}},
        # image to image at denoise 0.3
        "3": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": STEPS, "cfg": 5.0, "sampler_name": "dpmpp_2m",
                                                   "scheduler": "karras", "denoise": 0.3, "model": ["10", 0],
                                                   "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": ["13", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "sub/i2i", "images": ["8", 0]}},
        # inpainting: the transparent half
        "14": {"class_type": "LoadImage", "inputs": {"image": "holed.png"}},
        "15": {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": ["14", 0], "vae": ["4", 2],
                                                                "mask": ["14", 1], "grow_mask_by": 6}},
        "16": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": STEPS, "cfg": 5.0, "sampler_name": "euler",
                                                    "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                    "positive": ["26", 0], "negative": ["27", 0],
                                                    "latent_image": ["15", 0]}},
        "26": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
        "27": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "17": {"class_type": "VAEDecode", "inputs": {"samples": ["16", 0], "vae": ["4", 2]}},
        "18": {"class_type": "PreviewImage", "inputs": {"images": ["17", 0]}},
        # hires: the image-to-image latent upscaled 2x and sampled again at denoise 0.5
        "19": {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["3", 0], "upscale_method": "nearest-exact",
                                                           "scale_by": 2.0}},
        "20": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 2, "cfg": 5.0, "sampler_name": "euler",
                                                    "scheduler": "simple", "denoise": 0.5, "model": ["10", 0],
                                                    "positive": ["6", 0], "negative": ["7", 0],
                                                    "latent_image": ["19", 0]}},
        "21": {"class_type": "VAEDecode", "inputs": {"samples": ["20", 0], "vae": ["4", 2]}},
        "22": {"class_type": "PreviewImage", "inputs": {"images": ["21", 0]}},
        # ControlNet on text to image, and the model upscaler
        "30": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "demo-position"}},
        "31": {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["26", 0], "negative": ["27", 0], "control_net": ["30", 0], "image": ["12", 0],
            "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}},
        "32": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "33": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 2, "cfg": 5.0, "sampler_name": "euler",
                                                    "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                    "positive": ["31", 0], "negative": ["31", 1],
                                                    "latent_image": ["32", 0]}},
        "34": {"class_type": "VAEDecode", "inputs": {"samples": ["33", 0], "vae": ["4", 2]}},
        "35": {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "demo-4x.safetensors"}},
        "36": {"class_type": "ImageUpscaleWithModel", "inputs": {"upscale_model": ["35", 0], "image": ["34", 0]}},
        "37": {"class_type": "ImageScaleBy", "inputs": {"image": ["36", 0], "upscale_method": "area",
                                                        "scale_by": 0.5}},
        "38": {"class_type": "SaveImage", "inputs": {"filename_prefix": "cn", "images": ["37", 0]}},
    }
    history, _ = run(env, prompt)
    i2i = history["9"]["images"][0]
    assert i2i["subfolder"] == "sub" and i2i["type"] == "output"
    source = np.asarray(Image.open(dirs.input / "source.png")).astype(float)
    t2i = generate(env, seed=1, sampler="dpmpp_2m", schedule="karras")[0].astype(float)
    near = np.abs(saved(dirs, i2i).astype(float) - source).mean()
    assert near < np.abs(t2i - source).mean()          # a light image to image stays nearer its source
    inpainted = saved(dirs, history["18"]["images"][0]).astype(float)
    assert history["18"]["images"][0]["type"] == "temp"
    left, right = slice(0, SIZE // 2 - 8), slice(SIZE // 2 + 8, SIZE)   # away from the grown mask's edge
    assert np.abs(inpainted[:, left] - source[:, left]).mean() < np.abs(inpainted[:, right] - source[:, right]).mean()
    assert saved(dirs, history["22"]["images"][0]).shape == (2 * SIZE, 2 * SIZE, 3)
    assert saved(dirs, history["38"]["images"][0]).shape == (2 * SIZE, 2 * SIZE, 3)


def with_lora(prompt: dict, strength_model: float, strength_clip: float) -> dict:
    """``prompt`` with the demo LoRA's LoraLoader (node 10) between its checkpoint and its sampler and text encoders."""
    prompt["10"] = {"class_type": "LoraLoader", "inputs": {"model": ["4", 0], "clip": ["4", 1], "lora_name":
                                                           "demo_teal.safetensors", "strength_model": strength_model,
                                                           "strength_clip": strength_clip}}
    prompt["3"]["inputs"]["model"] = ["10", 0]
    for n in ("6", "7"):
        prompt[n]["inputs"]["clip"] = ["10", 1]
    return prompt


def test_lora_workflow_equals_generate_with_the_lora(env):
    prompt = with_lora(txt2img(ckpt_name(env), seed=5, prefix="lora"), 1.0, 1.0)
    history, _ = run(env, prompt)
    from sdlite.adapters.lora_files import find_lora

    want = generate(env, seed=5, sampler="euler", schedule="normal", loras=((find_lora("demo_teal"), 1.0),))[0]
    got = saved(env[3], history["9"]["images"][0])
    assert np.array_equal(got, want)
    assert not np.array_equal(got, generate(env, seed=5, sampler="euler", schedule="normal")[0])


def test_lora_strengths_for_model_and_clip(env):
    """LoraLoader with strength_model != strength_clip, and LoraLoaderModelOnly: generate with the LoRA's weight per
    network ({"unet": strength_model, "text_encoder": strength_clip}, 0 for the CLIP of the model-only one)."""
    from sdlite.adapters.lora_files import find_lora

    lora = find_lora("demo_teal")
    prompt = with_lora(txt2img(ckpt_name(env), seed=5, prefix="lora2"), 0.9, 0.2)
    history, _ = run(env, prompt)
    got = saved(env[3], history["9"]["images"][0])
    kw = dict(seed=5, sampler="euler", schedule="normal")
    assert np.array_equal(got, generate(env, loras=((lora, {"unet": 0.9, "text_encoder": 0.2}),), **kw)[0])
    assert not np.array_equal(got, generate(env, loras=((lora, 0.9),), **kw)[0])
    model_only = txt2img(ckpt_name(env), seed=5, prefix="lora3")
    model_only["10"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["4", 0], "lora_name":
                                                                        "demo_teal.safetensors", "strength_model": 0.9}}
    model_only["3"]["inputs"]["model"] = ["10", 0]
    history, _ = run(env, model_only)
    got = saved(env[3], history["9"]["images"][0])
    assert np.array_equal(got, generate(env, loras=((lora, {"unet": 0.9, "text_encoder": 0.0}),), **kw)[0])
    assert not np.array_equal(got, generate(env, **kw)[0])


def test_conditioning_combine_averages_the_predictions(env):
    """ConditioningCombine on both halves: one Euler step from noise ends at the denoised estimate, so the combined
    run's latents are the mean of the four single (prompt, negative) runs' (guidance is affine in each half's
    prediction); a workflow gives the engine's combined run's image."""
    from sdlite.families.base import latents_to_images

    engine = env[2]
    zeros = torch.zeros(1, engine.family.latent.channels, SIZE // 8, SIZE // 8)
    r = Request(prompt="a red circle", negative_prompt="blurry", width=SIZE, height=SIZE, steps=1, cfg_scale=6.0,
                sampler="euler", schedule="normal", seed=4)

    def latents(request, steps=1, **run):
        return engine.sample_latents(request.replace(steps=steps), LatentRun(zeros, **run)).latents
    combined = latents(r, prompts=("a blue square",), negative_prompts=("ugly",))
    singles = [latents(r.replace(prompt=p, negative_prompt=n)) for p in ("a red circle", "a blue square")
               for n in ("blurry", "ugly")]
    mean = sum(singles) / 4
    assert (combined - mean).abs().max() <= 1e-5 * mean.abs().max()
    assert (combined - singles[0]).abs().max() > 0.01 * mean.abs().max()

    prompt = txt2img(ckpt_name(env), seed=4, prefix="combined")
    prompt["20"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a blue square", "clip": ["4", 1]}}
    prompt["21"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "ugly", "clip": ["4", 1]}}
    prompt["22"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["6", 0],
                                                                    "conditioning_2": ["20", 0]}}
    prompt["23"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["7", 0],
                                                                    "conditioning_2": ["21", 0]}}
    prompt["3"]["inputs"].update(positive=["22", 0], negative=["23", 0])
    history, _ = run(env, prompt)
    want = latents(r, STEPS, prompts=("a blue square",), negative_prompts=("ugly",))
    image = latents_to_images(engine.decode_scaled(want))[0]
    assert np.array_equal(saved(env[3], history["9"]["images"][0]), np.asarray(image))


def test_interrupt_stops_the_workflow(env):
    prompt = txt2img(ckpt_name(env), seed=21, prefix="stopped")
    control = Control(stop_after=2)
    with pytest.raises(Interrupted):
        run(env, prompt, control)
    assert control.steps == 2
    assert not any(p.name.startswith("stopped") for p in env[3].output.iterdir())


# --- ComfyUI's schedulers against its formulas, computed here independently (numpy, float64) ------------------

def reference_sigmas(alphas_cumprod: np.ndarray, name: str, steps: int) -> np.ndarray:
    table = np.sqrt((1 - alphas_cumprod) / alphas_cumprod)
    logs, n = np.log(table), len(table)

    def sigma_at(t):   # log-linear between neighbouring table entries
        lo = int(math.floor(t))
        hi = min(lo + 1, n - 1)
        return math.exp(logs[lo] + (t - lo) * (logs[hi] - logs[lo]))

    if name == "normal":
        ts = np.linspace(n - 1, 0, steps)
        return np.array([sigma_at(t) for t in ts] + [0.0])
    if name == "sgm_uniform":
        ts = np.linspace(n - 1, 0, steps + 1)[:-1]
        return np.array([sigma_at(t) for t in ts] + [0.0])
    if name == "simple":
        return np.array([table[n - 1 - int(i * n / steps)] for i in range(steps)] + [0.0])
    if name == "ddim_uniform":
        idx = list(range(1, n, n // steps))
        return np.array([table[i] for i in reversed(idx)] + [0.0])
    if name == "karras":
        lo, hi = table[0] ** (1 / 7), table[-1] ** (1 / 7)
        return np.array(list((hi + np.linspace(0, 1, steps) * (lo - hi)) ** 7) + [0.0])
    if name == "exponential":
        return np.array(list(np.exp(np.linspace(np.log(table[-1]), np.log(table[0]), steps))) + [0.0])
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["normal", "sgm_uniform", "simple", "ddim_uniform", "karras", "exponential"])
@pytest.mark.parametrize("steps", [1, 7, 20])
def test_comfy_schedulers_follow_the_published_formulas(env, name, steps):
    schedule = env[2].schedule_for(Request(prompt=""))
    got = comfy_sigmas(schedule, name, steps).double().numpy()
    want = reference_sigmas(schedule.alphas_cumprod.double().numpy(), name, steps)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def flow_reference(kind: str, shift: float, name: str, steps: int) -> np.ndarray:
    """ComfyUI's flow tables (SD3's ModelSamplingDiscreteFlow, FLUX's ModelSamplingFlux) and two schedulers on them."""
    n, per_unit = (10000, 1.0) if kind == "flux" else (1000, 1000.0)

    def sigma(t):   # t: the model's timestep
        s = t / per_unit
        return math.exp(shift) / (math.exp(shift) + 1 / s - 1) if kind == "flux" else shift * s / (1 + (shift - 1) * s)

    table = np.array([sigma(k / n * per_unit) for k in range(1, n + 1)])
    if name == "normal":
        ts = np.linspace(table[-1] * per_unit, table[0] * per_unit, steps)
        return np.array([sigma(t) for t in ts] + [0.0])
    return np.array([table[n - 1 - int(i * n / steps)] for i in range(steps)] + [0.0])   # simple


@pytest.mark.parametrize("name", ["normal", "simple"])
def test_comfy_schedulers_on_flow_tables(name):
    from sdlite.sampling.comfy import flux_shift
    from sdlite.sampling.flow import FlowSchedule

    sd3 = FlowSchedule.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0})
    flux = FlowSchedule.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
                                     "base_shift": 0.5, "max_shift": 1.15, "shift": 3.0})
    for schedule, kind, shift, given in ((sd3, "sd3", 3.0, None), (sd3, "sd3", 6.0, 6.0), (flux, "flux", 1.15, None),
                                         (flux, "flux", flux_shift(512, 768), flux_shift(512, 768))):
        got = comfy_sigmas(schedule, name, 9, given).double().numpy()
        np.testing.assert_allclose(got, flow_reference(kind, shift, name, 9), rtol=2e-5, atol=1e-6)
    assert math.isclose(flux_shift(1024, 1024), 1.15) and math.isclose(flux_shift(256, 256), 0.5)


def test_beta_scheduler_uses_the_beta_quantiles(env):
    from scipy.stats import beta

    schedule = env[2].schedule_for(Request(prompt=""))
    table = np.sqrt((1 - schedule.alphas_cumprod.double().numpy()) / schedule.alphas_cumprod.double().numpy())
    ts = [round(beta.ppf(1 - i / 10, 0.6, 0.6) * 999) for i in range(10)]
    want = [table[t] for k, t in enumerate(ts) if k == 0 or t != ts[k - 1]] + [0.0]
    np.testing.assert_allclose(comfy_sigmas(schedule, "beta", 10).double().numpy(), want, rtol=2e-5)


def test_load_image_gives_frames_as_a_batch_and_alpha_as_the_mask(tmp_path):
    from sdlite.server.comfy.images import ImageFileError, load_image, load_mask

    frames = [Image.new("RGB", (16, 8), (i * 50, 0, 0)) for i in range(3)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    pixels, mask = load_image(tmp_path, "anim.gif")
    assert pixels.shape == (3, 8, 16, 3) and mask.shape == (3, 64, 64) and not mask.any()
    assert [round(float(v) * 255) for v in pixels[:, 0, 0, 0]] == [0, 50, 100]
    Image.new("RGBA", (8, 8), (1, 2, 3, 51)).save(tmp_path / "half.png")
    pixels, mask = load_image(tmp_path, "half.png [input]")
    assert pixels.shape == (1, 8, 8, 3) and torch.allclose(mask, torch.full((1, 8, 8), 0.8))
    assert torch.allclose(load_mask(tmp_path, "half.png", "alpha"), mask)
    assert torch.allclose(load_mask(tmp_path, "half.png", "blue"), torch.full((1, 8, 8), 3 / 255))
    with pytest.raises(ImageFileError, match="not inside the input folder"):
        load_image(tmp_path, "../x.png")


def test_advanced_sampler_noise_mask_and_scaling_workflow(env):
    _, _, _, dirs = env
    ck = ckpt_name(env)
    sampler = {"cfg": 5.0, "sampler_name": "euler", "scheduler": "normal", "model": ["4", 0], "positive": ["6", 0],
               "negative": ["7", 0], "steps": STEPS, "end_at_step": 10000}
    prompt = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ck}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "12": {"class_type": "LoadImage", "inputs": {"image": "source.png"}},
        "13": {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}},
        "14": {"class_type": "LoadImageMask", "inputs": {"image": "holed.png", "channel": "alpha"}},
        "15": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["13", 0], "mask": ["14", 0]}},
        "16": {"class_type": "KSamplerAdvanced", "inputs": {
            **sampler, "add_noise": "enable", "noise_seed": 3, "start_at_step": 0, "end_at_step": 2,
            "return_with_leftover_noise": "enable", "latent_image": ["15", 0]}},
        "17": {"class_type": "KSamplerAdvanced", "inputs": {
            **sampler, "add_noise": "disable", "noise_seed": 3, "start_at_step": 2,
            "return_with_leftover_noise": "disable", "latent_image": ["16", 0]}},
        "18": {"class_type": "LatentUpscale", "inputs": {"samples": ["17", 0], "upscale_method": "bilinear",
                                                         "width": 2 * SIZE, "height": 0, "crop": "disabled"}},
        "19": {"class_type": "VAEDecode", "inputs": {"samples": ["18", 0], "vae": ["4", 2]}},
        "20": {"class_type": "ImageScale", "inputs": {"image": ["19", 0], "upscale_method": "area", "width": SIZE,
                                                      "height": SIZE, "crop": "center"}},
        "21": {"class_type": "PreviewImage", "inputs": {"images": ["20", 0]}},
    }
    history, events = run(env, prompt)
    out = saved(dirs, history["21"]["images"][0]).astype(float)
    assert out.shape == (SIZE, SIZE, 3)
    assert [d["value"] for e, d in events if e == "progress"] == [1, 2, 1]   # steps 0-2, then step 2-3
    source = np.asarray(Image.open(dirs.input / "source.png")).astype(float)
    kept, repainted = slice(0, SIZE // 2 - 8), slice(SIZE // 2 + 8, SIZE)
    assert np.abs(out[:, kept] - source[:, kept]).mean() < np.abs(out[:, repainted] - source[:, repainted]).mean()
