"""ControlNet at the real SD 1.5 shapes (361M parameters, random weights, its zero convolutions given non-zero values
so the control matters), built in both layouts -- a diffusers folder and lllyasviel's single file (fp16, as the
.safetensors releases are) -- against diffusers' StableDiffusionControlNetPipeline, MultiControlNetModel and
StableDiffusionControlNetImg2ImgPipeline, at a tiny resolution (64 px: 8x8 latents)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from sdlite.control import ControlUnit
from sdlite.pipeline import Engine, Request
from sdlite.weights.controlnet import load_controlnet
from sdlite.weights.unet_keys import controlnet_to_original, unet_structure_from_keys

pytestmark = pytest.mark.slow

PROMPT, NEGATIVE = "a castle on a hill", "blurry"
SIZE = 64
MAX_PIXEL_DIFF = 2
PARAMETERS = 361_279_120   # the 361M of lllyasviel's SD 1.5 ControlNets (control_v11p_sd15_*)


def control_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:SIZE, :SIZE]
    edges = ((np.abs(xx - rng.integers(16, 48)) < 2) | (np.abs(yy - rng.integers(16, 48)) < 2)) * 255
    return Image.fromarray(np.stack([edges] * 3, axis=2).astype(np.uint8))


@pytest.fixture(scope="module")
def sd15cn(sd15_folder, tmp_path_factory):
    from diffusers import (ControlNetModel, MultiControlNetModel, StableDiffusionControlNetImg2ImgPipeline,
                           StableDiffusionControlNetPipeline, StableDiffusionPipeline)

    tmp = tmp_path_factory.mktemp("sd15cn")
    base = StableDiffusionPipeline.from_pretrained(sd15_folder, dtype=torch.float32, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False)
    cn = ControlNetModel.from_unet(base.unet)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for conv in [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]:
            fan_in = conv.weight[0].numel()
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / fan_in ** 0.5)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.01)
        for p in cn.parameters():   # fp16-representable, so the fp16 single file holds the same values
            p.copy_(p.half().float())
    cn.eval()
    assert sum(p.numel() for p in cn.parameters()) == PARAMETERS
    cn.save_pretrained(tmp / "cn-folder")
    keys = list(cn.state_dict())
    plan = controlnet_to_original(keys, unet_structure_from_keys(keys, "diffusers", prefix=""), 8)
    state = cn.state_dict()
    save_file({k: state[e.sources[0]].half().contiguous() for k, e in plan.entries.items()},
              tmp / "control_v11p_sd15_random.safetensors")
    del state
    common = dict(base.components, controlnet=cn)
    one = StableDiffusionControlNetPipeline(**common)
    two = StableDiffusionControlNetPipeline(**{**common, "controlnet": MultiControlNetModel([cn, cn])})
    img = StableDiffusionControlNetImg2ImgPipeline(**common)
    for p in (one, two, img):
        p.set_progress_bar_config(disable=True)
    yield {"one": one, "two": two, "img": img, "cn": cn, "tmp": tmp,
           "engine": Engine.load(sd15_folder, precision="exact")}
    gc.collect()


def as_uint8(images) -> np.ndarray:
    if isinstance(images, np.ndarray):
        return (images * 255).round().astype(np.int16)
    return np.stack([np.asarray(im.convert("RGB"), dtype=np.int16) for im in images])


def test_both_layouts_load_the_same_weights(sd15cn):
    unet = sd15cn["engine"].spec.unet
    folder = load_controlnet(sd15cn["tmp"] / "cn-folder", unet).state_dict()
    single = load_controlnet(sd15cn["tmp"] / "control_v11p_sd15_random.safetensors", unet).state_dict()
    ref = sd15cn["cn"].state_dict()
    assert set(folder) == set(single) == set(ref)
    assert all(torch.equal(folder[k], ref[k]) and torch.equal(single[k], ref[k]) for k in ref)


@pytest.mark.parametrize("layout,sampler,weight,start,end", [
    ("cn-folder", "dpmpp_2m_karras", 1.0, 0.0, 1.0),
    ("control_v11p_sd15_random.safetensors", "euler_a", 0.7, 0.25, 0.75),
])
def test_full_size_matches_diffusers(sd15cn, layout, sampler, weight, start, end):
    from tests.reference import use_scheduler

    pipe = sd15cn["one"]
    use_scheduler(pipe, sampler)
    image = control_image(1)
    expected = as_uint8(pipe(PROMPT, negative_prompt=NEGATIVE, image=image, height=SIZE, width=SIZE,
                             num_inference_steps=4, generator=torch.Generator().manual_seed(21),
                             controlnet_conditioning_scale=weight, control_guidance_start=start,
                             control_guidance_end=end, output_type="np").images)
    unit = ControlUnit(sd15cn["tmp"] / layout, image, weight=weight, guidance_start=start, guidance_end=end,
                       resize_mode="just-resize")
    result = sd15cn["engine"].generate(Request(PROMPT, NEGATIVE, width=SIZE, height=SIZE, steps=4, sampler=sampler,
                                               seed=21, controls=(unit,)))
    assert np.abs(as_uint8(result.images) - expected).max() <= MAX_PIXEL_DIFF
    plain = sd15cn["engine"].generate(Request(PROMPT, NEGATIVE, width=SIZE, height=SIZE, steps=4, sampler=sampler,
                                              seed=21))
    assert np.abs(as_uint8(plain.images) - as_uint8(result.images)).max() > 8   # the control matters


def test_full_size_two_controlnets_match_multicontrolnet(sd15cn):
    from tests.reference import use_scheduler

    pipe = sd15cn["two"]
    use_scheduler(pipe, "euler")
    images = [control_image(2), control_image(3)]
    expected = as_uint8(pipe(PROMPT, negative_prompt=NEGATIVE, image=images, height=SIZE, width=SIZE,
                             num_inference_steps=4, generator=torch.Generator().manual_seed(4),
                             controlnet_conditioning_scale=[0.6, 1.1], control_guidance_start=[0.0, 0.5],
                             control_guidance_end=[1.0, 1.0], output_type="np").images)
    units = (ControlUnit(sd15cn["tmp"] / "cn-folder", images[0], weight=0.6, resize_mode="just-resize"),
             ControlUnit(sd15cn["tmp"] / "cn-folder", images[1], weight=1.1, guidance_start=0.5,
                         resize_mode="just-resize"))
    result = sd15cn["engine"].generate(Request(PROMPT, NEGATIVE, width=SIZE, height=SIZE, steps=4, sampler="euler",
                                               seed=4, controls=units))
    assert np.abs(as_uint8(result.images) - expected).max() <= MAX_PIXEL_DIFF


def test_full_size_img2img_matches_diffusers(sd15cn):
    from tests.reference import use_scheduler

    pipe = sd15cn["img"]
    use_scheduler(pipe, "ddim")
    init = Image.fromarray(np.random.default_rng(5).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
    control = control_image(6)
    expected = as_uint8(pipe(PROMPT, negative_prompt=NEGATIVE, image=init, control_image=control, strength=0.7,
                             height=SIZE, width=SIZE, num_inference_steps=6, generator=torch.Generator().manual_seed(8),
                             controlnet_conditioning_scale=0.8, output_type="np").images)
    unit = ControlUnit(sd15cn["tmp"] / "cn-folder", control, weight=0.8, resize_mode="just-resize")
    result = sd15cn["engine"].generate(Request(PROMPT, NEGATIVE, width=SIZE, height=SIZE, steps=6, sampler="ddim",
                                               seed=8, init_image=init, strength=0.7, controls=(unit,)))
    assert np.abs(as_uint8(result.images) - expected).max() <= MAX_PIXEL_DIFF
