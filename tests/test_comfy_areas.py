"""ComfyUI's area conditioning on the demo model (sdlite/sampling/regions.py, the ConditioningSetArea nodes of
sdlite/server/comfy/nodes.py): the feathered weights against ComfyUI's published formula written out here, a run
with a whole-image prompt and areas against a computation by hand (the engine's denoiser on each crop, weighted,
guided, two Euler steps from the same noise), a workflow giving that run's image, strength 0, and the errors."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from sdlite.errors import RequestError
from sdlite.families.base import latents_to_images
from sdlite.pipeline import Request
from sdlite.pipeline.latents import LatentRun
from sdlite.sampling.comfy import comfy_noise, comfy_sigmas, comfy_timesteps, noise_scaling
from sdlite.sampling.regions import WHOLE, Region, feather
from tests.test_comfy_workflow import ckpt_name, env, refusal, run, saved, txt2img  # noqa: F401  (env: the fixture)

WIDTH, HEIGHT = 128, 96          # a 16 x 12 latent
AREA = Region((8, 8, 4, 8), strength=0.8, origin="A")                                  # inside: top and left ramps
EDGE = Region((0.5, 0.5, 0.75, 0.0), percentage=True, origin="B")   # 6 x 8 at (9, 0): cut to 3 rows at the bottom


def comfy_weight(area, height, width, strength):
    """ComfyUI's mult of an area (height, width, y, x) already cut to the latent, row by row as it writes it."""
    h, w, y, x = area
    m = torch.ones(h, w) * strength
    r = min(8, h // 4)
    for t in range(r):
        if y != 0:
            m[t, :] *= (1.0 / r) * (t + 1)
        if y + h < height:
            m[h - 1 - t, :] *= (1.0 / r) * (t + 1)
    r = min(8, w // 4)
    for t in range(r):
        if x != 0:
            m[:, t] *= (1.0 / r) * (t + 1)
        if x + w < width:
            m[:, w - 1 - t] *= (1.0 / r) * (t + 1)
    return m


@pytest.mark.parametrize("area,strength", [((8, 8, 4, 8), 0.8), ((64, 64, 0, 0), 1.0), ((40, 24, 10, 30), 2.5),
                                           ((3, 5, 1, 1), 1.0), ((12, 16, 0, 0), 0.0), ((20, 36, 44, 0), 1.0)])
def test_feather_is_comfyuis_ramp(area, strength):
    assert torch.equal(feather(area, 64, 66, strength), comfy_weight(area, 64, 66, strength))


def test_feather_ramps_the_inner_edges_only():
    weights = feather((8, 8, 4, 8), 12, 16, 0.8)   # ramps of 2 pixels on the top and left edges
    assert weights[0, 0].item() == pytest.approx(0.8 * 0.5 * 0.5) and weights[1, 0].item() == pytest.approx(0.4)
    assert torch.all(weights[2:, 2:] == torch.tensor(0.8))


def _request(steps):
    return Request(prompt="a red circle", negative_prompt="blurry", width=WIDTH, height=HEIGHT, steps=steps,
                   cfg_scale=6.0, sampler="euler", schedule="normal", seed=5)


def _by_hand(engine, steps, positive, negative, scale=6.0):
    """The run's latents computed here: ``positive`` / ``negative`` as (text, area cut to the latent or None,
    strength), ComfyUI's opposite areas written out by the caller."""
    shape = (1, engine.family.latent.channels, HEIGHT // 8, WIDTH // 8)
    schedule = engine.schedule_for(_request(steps))
    sigmas = comfy_sigmas(schedule, "normal", steps)
    x = noise_scaling(schedule, float(sigmas[0]), comfy_noise(5, shape), torch.zeros(shape))

    def args(text):   # the text's context, and SDXL's pooled embedding and size ids (the whole image's)
        extra = engine.conditioning(Request(prompt=text, width=WIDTH, height=HEIGHT, steps=steps), False).extra_at(0, 1)
        return {"context": extra["context"], **extra.get("added", {})}

    with torch.no_grad(), engine.models.use(engine.spec.denoiser) as unet:
        denoiser = engine.family.denoiser(unet, schedule, unet.dtype) \
            .with_timesteps(sigmas, comfy_timesteps(schedule, sigmas[:-1]))

        def half(x, sigma, parts):
            total, weights = torch.zeros(shape), torch.full(shape, 1e-37)
            for text, area, strength in parts:
                h, w, y, left = area or (shape[2], shape[3], 0, 0)
                pred = denoiser(x[:, :, y:y + h, left:left + w], sigma, **args(text))
                weight = torch.zeros(shape)
                weight[:, :, y:y + h, left:left + w] = comfy_weight((h, w, y, left), shape[2], shape[3], strength) \
                    if area else strength
                total = total + torch.nn.functional.pad(pred, (left, shape[3] - left - w, y, shape[2] - y - h)) \
                    * weight
                weights = weights + weight
            return total / weights

        for i in range(steps):
            sigma = sigmas[i:i + 1]
            cond, uncond = half(x, sigma, positive), half(x, sigma, negative)
            denoised = uncond + (cond - uncond) * scale
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


def _check_areas(engine, steps: int) -> torch.Tensor:
    """A whole-image prompt combined with an area inside the latent and one cut at its bottom edge: ``steps`` Euler
    steps equal the computation by hand, with the negative prompt run on each area too (ComfyUI's opposite areas)."""
    zeros = torch.zeros(1, engine.family.latent.channels, HEIGHT // 8, WIDTH // 8)
    got = engine.sample_latents(_request(steps), LatentRun(zeros, prompts=("a blue square", "green grass"),
                                                           regions=(WHOLE, AREA, EDGE))).latents
    cut = (3, 8, 9, 0)
    want = _by_hand(engine, steps, [("a red circle", None, 1.0), ("a blue square", AREA.area, 0.8),
                                ("green grass", cut, 1.0)],
                    [("blurry", None, 1.0), ("blurry", AREA.area, 0.8), ("blurry", cut, 1.0)])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    return got


def test_areas_on_sdxl_keep_the_whole_images_size_ids(tmp_path):
    """On a tiny SDXL each crop gets its text's pooled embedding and the whole image's size ids, as ComfyUI's (one
    step: the sampler ends at the guided estimate)."""
    from sdlite.pipeline import Engine
    from tests.test_sdxl_pipeline import _pipelines

    base, _ = _pipelines(tmp_path)
    base.save_pretrained(tmp_path / "base")
    _check_areas(Engine.load(tmp_path / "base", precision="exact"), 1)


def test_areas_blend_the_predictions_as_comfyui(env):
    """The demo model's run (see :func:`_check_areas`), which the areas change; a workflow with the nodes gives that
    run's image."""
    engine = env[2]
    got = _check_areas(engine, 2)
    zeros = torch.zeros(1, engine.family.latent.channels, HEIGHT // 8, WIDTH // 8)
    plain = engine.sample_latents(_request(2), LatentRun(zeros, prompts=("a blue square", "green grass"))).latents
    assert (got - plain).abs().max() > 0.01 * got.abs().max()

    prompt = txt2img(ckpt_name(env), seed=5, prefix="areas")
    prompt["5"]["inputs"].update(width=WIDTH, height=HEIGHT)
    prompt["3"]["inputs"].update(steps=2)
    prompt["20"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a blue square", "clip": ["4", 1]}}
    prompt["21"] = {"class_type": "ConditioningSetArea", "inputs": {"conditioning": ["20", 0], "width": 64,
                                                                    "height": 64, "x": 64, "y": 32, "strength": 0.8}}
    prompt["22"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "green grass", "clip": ["4", 1]}}
    prompt["23"] = {"class_type": "ConditioningSetAreaPercentage", "inputs": {
        "conditioning": ["22", 0], "width": 0.5, "height": 0.5, "x": 0.0, "y": 0.75, "strength": 1.0}}
    prompt["24"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["6", 0],
                                                                    "conditioning_2": ["21", 0]}}
    prompt["25"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["24", 0],
                                                                    "conditioning_2": ["23", 0]}}
    prompt["3"]["inputs"]["positive"] = ["25", 0]
    history, _ = run(env, prompt)
    image = latents_to_images(engine.decode_scaled(got))[0]
    assert np.array_equal(saved(env[3], history["9"]["images"][0]), np.asarray(image))


def test_strength_zero_leaves_no_prediction(env):
    """ConditioningSetAreaStrength 0 on the only positive conditioning: ComfyUI's weights start at 1e-37, so the
    positive prediction is 0 and one Euler step ends at uncond - 6 * uncond."""
    engine = env[2]
    zeros = torch.zeros(1, engine.family.latent.channels, HEIGHT // 8, WIDTH // 8)
    zero = Region(strength=0.0, origin="S")
    got = engine.sample_latents(_request(1), LatentRun(zeros, regions=(zero,), negative_regions=(WHOLE,))).latents
    want = _by_hand(engine, 1, [("a red circle", None, 0.0)], [("blurry", None, 1.0)])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    uncond = _by_hand(engine, 1, [("blurry", None, 1.0)], [("blurry", None, 1.0)])
    assert torch.allclose(got, -5.0 * uncond, rtol=1e-4, atol=1e-4 * uncond.abs().max().item())


def test_bad_area_values_are_refused(env):
    """Validation gives ComfyUI's error types; an area whose corner lies outside the latent is an execution error
    naming the node and its values; areas with a ControlNet are refused naming the node."""
    prompt = txt2img(ckpt_name(env))
    prompt["20"] = {"class_type": "ConditioningSetArea", "inputs": {"conditioning": ["6", 0], "width": 32,
                                                                    "height": 64, "x": 20000, "y": 0,
                                                                    "strength": "strong"}}
    prompt["21"] = {"class_type": "ConditioningSetAreaPercentage", "inputs": {
        "conditioning": ["20", 0], "width": 0.5, "height": 0.5, "x": 1.5, "y": 0.0, "strength": 1.0}}
    prompt["22"] = {"class_type": "ConditioningSetAreaStrength", "inputs": {"conditioning": ["21", 0],
                                                                            "strength": -1}}
    prompt["3"]["inputs"]["positive"] = ["22", 0]
    body = refusal(env, prompt)
    types = {node: {e["extra_info"]["input_name"]: e["type"] for e in body["node_errors"][node]["errors"]}
             for node in ("20", "21", "22")}
    assert types["20"] == {"width": "value_smaller_than_min", "x": "value_bigger_than_max",
                           "strength": "invalid_input_type"}
    assert types["21"] == {"x": "value_bigger_than_max"} and types["22"] == {"strength": "value_smaller_than_min"}

    outside = txt2img(ckpt_name(env), prefix="outside")
    outside["20"] = {"class_type": "ConditioningSetArea", "inputs": {"conditioning": ["6", 0], "width": 64,
                                                                     "height": 64, "x": 64, "y": 0, "strength": 1.0}}
    outside["3"]["inputs"]["positive"] = ["20", 0]
    with pytest.raises(RequestError, match=r"ConditioningSetArea \(node #20\): the area's corner \(x 64, y 0\) lies "
                                           r"outside the 64x64 image"):
        run(env, outside)

    controlled = copy.deepcopy(outside)
    controlled["20"]["inputs"]["x"] = 0
    controlled["30"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "demo-position"}}
    controlled["31"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["20", 0], "negative": ["7", 0], "control_net": ["30", 0], "image": ["32", 0], "strength": 1.0,
        "start_percent": 0.0, "end_percent": 1.0}}
    controlled["32"] = {"class_type": "LoadImage", "inputs": {"image": "source.png"}}
    controlled["3"]["inputs"].update(positive=["31", 0], negative=["31", 1])
    with pytest.raises(RequestError, match=r"ConditioningSetArea \(node #20\): areas and strengths with a "
                                           "ControlNet are not supported"):
        run(env, controlled)
