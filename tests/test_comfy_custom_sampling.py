"""ComfyUI's custom sampling nodes (:mod:`sdlite.server.comfy.custom`) on the tiny FLUX.2 [klein] of
:mod:`tests.test_flux2_server`, written as ComfyUI's files (UNETLoader, CLIPLoader type flux2, VAELoader):

* the klein template's SamplerCustomAdvanced graph (RandomNoise, CFGGuider, KSamplerSelect, BasicScheduler,
  EmptyFlux2LatentImage) gives the KSampler graph's image with the same seed, scheduler and sampler; so does
  SamplerCustom; DisableNoise gives KSamplerAdvanced's image without added noise; with ReferenceLatent on both
  conditionings it is the KSampler edit graph's image;
* with Flux2Scheduler (and BasicGuider) the sampler is given Flux2Scheduler's sigmas unchanged, and the image is the
  engine's run on those sigmas (another image than the simple scheduler's);
* ``denoised_output`` is the last step's estimate (at a last sigma of 0, the output itself);
* sigmas that are no schedule, and a BasicScheduler over another model's file, are errors naming the node and input.
"""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_flux2_server import AE, PROMPT, QWEN, UNET, comfy, env, workflow  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE = 64


def custom_workflow(seed=5, sigmas="basic", guider="cfg", noise="random", scheduler="simple", edit=False,
                    sampler="euler"):
    """The klein template's SamplerCustomAdvanced graph in API format, on the KSampler graph's loaders and
    conditionings (:func:`tests.test_flux2_server.workflow`): node 7 is the sampler, 20 saves its denoised output."""
    prompt = workflow(seed=seed, edit=edit, width=SIZE, height=SIZE)
    positive, negative = prompt["7"]["inputs"]["positive"], prompt["7"]["inputs"]["negative"]
    prompt.update({
        "30": ({"class_type": "RandomNoise", "inputs": {"noise_seed": seed}} if noise == "random"
               else {"class_type": "DisableNoise", "inputs": {}}),
        "31": ({"class_type": "CFGGuider", "inputs": {"model": ["1", 0], "positive": positive, "negative": negative,
                                                      "cfg": 1.0}} if guider == "cfg"
               else {"class_type": "BasicGuider", "inputs": {"model": ["1", 0], "conditioning": positive}}),
        "32": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}},
        "33": ({"class_type": "BasicScheduler", "inputs": {"model": ["1", 0], "scheduler": scheduler, "steps": 4,
                                                          "denoise": 1.0}} if sigmas == "basic"
               else {"class_type": "Flux2Scheduler", "inputs": {"steps": 4, "width": SIZE, "height": SIZE}}),
        "7": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["30", 0], "guider": ["31", 0], "sampler": ["32", 0], "sigmas": ["33", 0],
            "latent_image": ["6", 0]}},
        "19": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 1], "vae": ["3", 0]}},
        "20": {"class_type": "SaveImage", "inputs": {"filename_prefix": "denoised", "images": ["19", 0]}},
    })
    return prompt


def run(comfy, prompt, output="9") -> np.ndarray:  # noqa: F811
    from sdlite.server.comfy.workflow import validate
    from tests.test_comfy_workflow import Control

    executor, dirs, _ = comfy
    history = executor.run("pid", prompt, validate(prompt, executor.server), Control(watched=False), lambda *a: None)
    with Image.open(dirs.output / history[output]["images"][0]["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def runs(comfy, prompt) -> tuple[np.ndarray, np.ndarray]:  # noqa: F811
    """The output's image and the denoised output's, of one execution."""
    from sdlite.server.comfy.workflow import validate
    from tests.test_comfy_workflow import Control

    executor, dirs, _ = comfy
    history = executor.run("pid", prompt, validate(prompt, executor.server), Control(watched=False), lambda *a: None)
    out = []
    for node in ("9", "20"):
        with Image.open(dirs.output / history[node]["images"][0]["filename"]) as im:
            out.append(np.asarray(im.convert("RGB")))
    return out[0], out[1]


def test_sampler_custom_advanced_is_ksamplers_image(comfy):  # noqa: F811
    got, denoised = runs(comfy, custom_workflow(seed=5))
    assert got.shape == (SIZE, SIZE, 3) and got.std() > 5
    assert np.array_equal(got, run(comfy, workflow(seed=5)))
    # euler's last step to sigma 0 lands on its estimate: the denoised output is the output, to float rounding
    assert np.abs(got.astype(int) - denoised.astype(int)).max() <= 1
    assert not np.array_equal(got, run(comfy, custom_workflow(seed=6)))


def test_other_scheduler_and_sampler_are_ksamplers_too(comfy):  # noqa: F811
    prompt = workflow(seed=3)
    prompt["7"]["inputs"].update(scheduler="beta", sampler_name="dpmpp_2m")
    assert np.array_equal(run(comfy, custom_workflow(seed=3, scheduler="beta", sampler="dpmpp_2m")),
                          run(comfy, prompt))


def test_sampler_custom_is_ksamplers_image(comfy):  # noqa: F811
    prompt = custom_workflow(seed=5)
    prompt["7"] = {"class_type": "SamplerCustom", "inputs": {
        "model": ["1", 0], "add_noise": True, "noise_seed": 5, "cfg": 1.0, "positive": ["4", 0],
        "negative": ["5", 0], "sampler": ["32", 0], "sigmas": ["33", 0], "latent_image": ["6", 0]}}
    assert np.array_equal(run(comfy, prompt), run(comfy, workflow(seed=5)))


def test_disable_noise_is_ksampler_advanceds_without_noise(comfy):  # noqa: F811
    from sdlite.server.comfy.nodes import NODES

    prompt = workflow(seed=0)
    inputs = dict(prompt["7"]["inputs"])
    inputs.pop("denoise")
    inputs.pop("seed")
    inputs.update(add_noise="disable", noise_seed=0, start_at_step=0, end_at_step=10000,
                  return_with_leftover_noise="disable")
    prompt["7"] = {"class_type": "KSamplerAdvanced", "inputs": inputs}
    assert set(inputs) == set(NODES["KSamplerAdvanced"].inputs)
    got = run(comfy, custom_workflow(seed=9, noise="disable"))
    assert np.array_equal(got, run(comfy, prompt))
    assert not np.array_equal(got, run(comfy, custom_workflow(seed=9)))


def test_the_edit_graph_is_ksamplers_edit(comfy):  # noqa: F811
    got = run(comfy, custom_workflow(seed=7, edit=True))
    assert np.array_equal(got, run(comfy, workflow(seed=7, edit=True)))
    assert not np.array_equal(got, run(comfy, custom_workflow(seed=7)))


def test_flux2_schedulers_sigmas_reach_the_sampler(comfy, monkeypatch):  # noqa: F811
    from sdlite.families.base import latents_to_images
    from sdlite.pipeline import Request
    from sdlite.pipeline.latents import LatentRun
    from sdlite.sampling.samplers import SAMPLERS
    from sdlite.server.comfy.flux2 import flux2_sigmas

    seen = []
    info = SAMPLERS["euler"]

    @functools.wraps(info.fn)
    def spy(model, x, sigmas, *args, **kw):
        seen.append(sigmas.clone())
        return info.fn(model, x, sigmas, *args, **kw)

    monkeypatch.setitem(SAMPLERS, "euler", dataclasses.replace(info, fn=spy))
    got = run(comfy, custom_workflow(seed=5, sigmas="flux2", guider="basic"))
    want_sigmas = flux2_sigmas(4, SIZE, SIZE)
    assert len(seen) == 1 and torch.equal(seen[0], want_sigmas)

    engine = comfy[2]
    latent = engine.family.latent
    empty = torch.zeros(1, latent.channels, SIZE // latent.downscale, SIZE // latent.downscale)
    result = engine.sample_latents(Request(prompt=PROMPT, steps=4, cfg_scale=1.0, sampler="euler", seed=5),
                                   LatentRun(empty, sigmas=want_sigmas))
    assert torch.equal(seen[1], want_sigmas)
    want = np.asarray(latents_to_images(engine.decode_scaled(result.latents))[0])
    assert np.array_equal(got, want) and got.std() > 5
    assert not np.array_equal(got, run(comfy, custom_workflow(seed=5)))   # the simple scheduler's: other sigmas


def test_bad_sigmas_are_errors_naming_the_node_and_input():
    from sdlite.errors import RequestError
    from sdlite.server.comfy.custom import Guider, Noise, SamplerChoice, run_custom
    from sdlite.server.comfy.nodes import ClipRef, Cond, ModelRef

    model = ModelRef(checkpoint=SimpleNamespace(path="a.safetensors", name="a"))
    guider = Guider(model, [Cond("a cat", ClipRef(None))], None, 1.0)
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    for sigmas, words in [(torch.tensor([1.0, 0.5, 0.7, 0.0]), "not strictly descending"),
                          (torch.tensor([[1.0, 0.0]]), "1-D"), (torch.tensor([1.0, float("nan"), 0.0]), "finite")]:
        with pytest.raises(RequestError) as caught:
            run_custom(SimpleNamespace(node_id="7"), "SamplerCustomAdvanced (node 7)", Noise(1), guider,
                       SamplerChoice("euler"), sigmas, latent)
        assert str(caught.value).startswith("SamplerCustomAdvanced (node 7): sigmas: ") and words in str(caught.value)
    # fewer than two sigmas (a BasicScheduler at denoise 0 too) sample nothing: the latent comes back
    assert run_custom(None, "x", Noise(1), guider, SamplerChoice("euler"), torch.zeros(0), latent) == (latent, latent)


def test_basic_scheduler_over_another_models_file_is_refused(comfy):  # noqa: F811
    from sdlite.server.comfy.workflow import Executor, validate
    from tests.test_comfy_workflow import Control

    prompt = custom_workflow()
    prompt["40"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "other.safetensors", "weight_dtype": "default"}}
    executor, dirs, _ = comfy
    other = executor.server.checkpoints.models_dir / "diffusion_models" / "other.safetensors"
    other.write_bytes((executor.server.checkpoints.models_dir / "diffusion_models" / UNET).read_bytes())
    try:
        prompt["33"]["inputs"]["model"] = ["40", 0]
        with pytest.raises(Exception) as caught:
            Executor(executor.server, dirs).run("pid", prompt, validate(prompt, executor.server),
                                                Control(watched=False), lambda *a: None)
    finally:
        other.unlink()
    assert caught.value.node_id == "7"
    assert "SamplerCustomAdvanced (node 7): sigmas: BasicScheduler's model" in str(caught.value)
