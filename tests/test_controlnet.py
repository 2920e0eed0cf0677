"""ControlNet against diffusers on tiny models (random weights, every tensor non-zero so the control matters): the
network against ControlNetModel, lllyasviel's layout against diffusers' own converter, generation against
StableDiffusionControlNetPipeline (samplers, weights, guidance windows), two ControlNets against MultiControlNetModel,
image to image against StableDiffusionControlNetImg2ImgPipeline, and A1111's soft-injection modes against a direct
computation of the extension's formulas. The cases bench/parity.py runs at the real SD 1.5 shapes (``parity_*``: each
layout, two units, image to image) run here on the tiny models through the same functions."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from sdlite.config import ControlNetConfig
from sdlite.control import ControlUnit
from sdlite.control.units import keep, residual_scales
from sdlite.models.controlnet import ControlNet
from sdlite.pipeline import Engine, Request, RequestError
from sdlite.weights.controlnet import ControlNetError, load_controlnet, open_controlnet
from sdlite.weights.unet_keys import controlnet_to_original, unet_structure_from_keys
from tests.reference import diffusers_pipeline, saved_pipeline, seed_all, use_scheduler, with_contrast

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "a red circle on a blue background"
NEGATIVE = "blurry, green"
MAX_PIXEL_DIFF = 2
SIZE = 64


def as_uint8(images) -> np.ndarray:
    if isinstance(images, np.ndarray):
        return (images * 255).round().astype(np.int16)
    return np.stack([np.asarray(im.convert("RGB"), dtype=np.int16) for im in images])


def control_image(seed: int, size: int = SIZE) -> Image.Image:
    """A control map with structure: a bright disc on black with some noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    cx, cy = rng.integers(size // 4, 3 * size // 4, 2)
    disc = ((xx - cx) ** 2 + (yy - cy) ** 2 < (size // 5) ** 2) * 255
    img = np.stack([disc, np.roll(disc, 5, axis=1), disc // 2], axis=2) + rng.integers(0, 40, (size, size, 3))
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def diffusers_controlnet(unet, seed: int):
    from diffusers import ControlNetModel

    # the tiny VAE halves the size once: a hint encoder of two widths does the same
    cn = seed_all(ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32)), seed, scale=0.05)
    with torch.no_grad():   # output convolutions strong enough that the control shows in the tiny model's image
        for conv in [*cn.controlnet_down_blocks, cn.controlnet_mid_block]:
            conv.weight.mul_(40)
    return cn.eval()


def original_state(cn) -> dict:
    """lllyasviel's layout of a diffusers ControlNet, by our table (checked against diffusers' converter below)."""
    keys = list(cn.state_dict())
    structure = unet_structure_from_keys(keys, "diffusers", prefix="")
    hint = 2 + 2 * (len(cn.config.conditioning_embedding_out_channels) - 1)
    plan = controlnet_to_original(keys, structure, hint, prefix="")
    state = cn.state_dict()
    return {k: state[e.sources[0]].contiguous() for k, e in plan.entries.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from diffusers import (MultiControlNetModel, StableDiffusionControlNetImg2ImgPipeline,
                           StableDiffusionControlNetPipeline)

    tmp = tmp_path_factory.mktemp("tiny_controlnet")
    pipe = with_contrast(diffusers_pipeline("sd1", tmp))
    with torch.no_grad():   # a UNet whose prediction matters to the image, so that the control's share shows
        pipe.unet.conv_out.weight.mul_(8)
    pipe = saved_pipeline(pipe, tmp / "model")
    nets = [diffusers_controlnet(pipe.unet, 40 + i) for i in range(2)]
    with torch.no_grad():   # fp16-representable, so that an fp16 file (as lllyasviel's releases are) holds the same
        for p in nets[0].parameters():
            p.copy_(p.half().float())
    folders = []
    for i, cn in enumerate(nets):
        cn.save_pretrained(tmp / f"cn{i}")
        folders.append(tmp / f"cn{i}")
    save_file(original_state(nets[0]), tmp / "control_tiny.safetensors")
    save_file({"control_model." + k: v.half() for k, v in original_state(nets[0]).items()},
              tmp / "control_v11p_tiny.safetensors")
    common = dict(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=pipe.unet,
                  scheduler=pipe.scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    one = StableDiffusionControlNetPipeline(controlnet=nets[0], **common)
    two = StableDiffusionControlNetPipeline(controlnet=MultiControlNetModel(nets), **common)
    img = StableDiffusionControlNetImg2ImgPipeline(controlnet=nets[0], **common)
    for p in (one, two, img):
        p.set_progress_bar_config(disable=True)
    return {"one": one, "two": two, "img": img, "nets": nets, "folders": folders, "tmp": tmp,
            "engine": Engine.load(tmp / "model", precision="exact"), "file": tmp / "control_tiny.safetensors",
            "layouts": {"folder": folders[0], "original": tmp / "control_v11p_tiny.safetensors"}}


# --- the network and its files -------------------------------------------------------------------------------------

def test_network_matches_controlnetmodel(tiny):
    cn = tiny["nets"][0]
    ours = ControlNet(ControlNetConfig.from_diffusers(dict(cn.config))).eval()
    ours.load_state_dict(cn.state_dict(), strict=True)
    g = torch.Generator().manual_seed(0)
    x, ctx, hint = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g), \
        torch.rand(2, 3, 32, 32, generator=g)
    t = torch.tensor([801.0, 15.0])
    with torch.no_grad():
        ref_down, ref_mid = cn(x, t, ctx, hint, conditioning_scale=0.7, return_dict=False)
        down, mid = ours(x, t, ctx, hint, 0.7)
    assert len(down) == len(ref_down) == ours.control_config.residuals - 1
    for a, b in zip(down, ref_down):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(mid, ref_mid, rtol=0, atol=0)
    assert all(float(d.abs().mean()) > 1e-3 for d in down)   # the control is not zero


def test_original_layout_is_the_one_diffusers_reads(tiny):
    from diffusers import ControlNetModel
    from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint

    # diffusers' converter knows the published hint encoder (four widths, 8x) only
    cn = seed_all(ControlNetModel.from_unet(tiny["one"].unet), 5, scale=0.05)
    original = original_state(cn)
    assert "input_hint_block.0.weight" in original and "zero_convs.0.0.weight" in original
    back = convert_controlnet_checkpoint({"control_model." + k: v for k, v in original.items()}, dict(cn.config))
    state = cn.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("layout", ["folder", "original", "bare", "diffusers-file", "fp16"])
def test_every_layout_loads_the_same_network(tiny, layout, tmp_path):
    cn = tiny["nets"][0]
    state = cn.state_dict()
    if layout == "folder":
        path = tiny["folders"][0]
    elif layout == "original":
        path = tmp_path / "control_v11p_tiny.safetensors"
        save_file({"control_model." + k: v for k, v in original_state(cn).items()}, path)
    elif layout == "bare":   # the SD 2.1 ControlNets' form, and a .pth read without unpickling code
        path = tmp_path / "controlnet_tiny.pth"
        torch.save(original_state(cn), path)
    elif layout == "diffusers-file":
        path = tmp_path / "diffusers_tiny.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        path = tmp_path / "control_fp16.safetensors"
        save_file({"control_model." + k: v.half() for k, v in original_state(cn).items()}, path)
    base = tiny["engine"].spec.unet
    net = load_controlnet(path, base)
    got = net.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        want = v.half().float() if layout == "fp16" else v
        assert torch.equal(got[k], want), k


@pytest.mark.parametrize("keys,word", [
    ({"lora_controlnet": torch.zeros(1), "input_blocks.0.0.down": torch.zeros(2, 2)}, "control-LoRA"),
    ({"adapter.body.0.resnets.0.block1.weight": torch.zeros(2, 2)}, "T2I-Adapter"),
    ({"control_add_embedding.linear_1.weight": torch.zeros(2, 2), "task_embedding": torch.zeros(2)}, "union"),
    ({"lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.down.0.weight": torch.zeros(2, 2)},
     "ControlLLLite"),
    ({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)}, "not a ControlNet"),
])
def test_other_kinds_are_refused_by_name(tmp_path, keys, word):
    path = tmp_path / "thing.safetensors"
    save_file(keys, path)
    with pytest.raises(ControlNetError, match=word) as err:
        open_controlnet(path)
    assert "thing.safetensors" in str(err.value)


def test_a_controlnet_of_another_family_is_refused_naming_both(tiny, tmp_path):
    from diffusers import ControlNetModel

    cfg = dict(tiny["nets"][0].config)
    cfg.update(cross_attention_dim=48)
    other = ControlNetModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    other.save_pretrained(tmp_path / "cn-other")
    with pytest.raises(RequestError, match=r"ControlNet for .*context width 48.*the model is sd1"):
        tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=2, seed=1, controls=(
            ControlUnit(tmp_path / "cn-other", control_image(0)),)))


def test_a_missing_tensor_names_the_key(tiny, tmp_path):
    state = {"control_model." + k: v for k, v in original_state(tiny["nets"][0]).items()}
    state.pop("control_model.zero_convs.3.0.weight")
    save_file(state, tmp_path / "broken.safetensors")
    with pytest.raises(ControlNetError, match=r"controlnet_down_blocks\.3\.weight|zero_convs\.3"):
        load_controlnet(tmp_path / "broken.safetensors", tiny["engine"].spec.unet)


# --- generation against diffusers' pipelines -----------------------------------------------------------------------

def reference(pipe, sampler, images, *, seed, steps, batch=1, scale=1.0, start=0.0, end=1.0, cfg=7.5, **kw):
    use_scheduler(pipe, sampler)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
    out = pipe(prompt=[PROMPT] * batch, negative_prompt=[NEGATIVE] * batch, height=SIZE, width=SIZE,
               num_inference_steps=steps, guidance_scale=cfg, generator=generators, output_type="np",
               controlnet_conditioning_scale=scale, control_guidance_start=start, control_guidance_end=end,
               **kw).images
    return as_uint8(out)


def generate(engine, sampler, units, *, seed, steps, batch=1, cfg=7.5, **kw):
    result = engine.generate(Request(PROMPT, NEGATIVE, width=SIZE, height=SIZE, steps=steps, sampler=sampler,
                                     seed=seed, batch_size=batch, cfg_scale=cfg, controls=tuple(units), **kw))
    return as_uint8(result.images), result


@pytest.mark.parametrize("sampler,weight,start,end,batch", [
    ("euler", 1.0, 0.0, 1.0, 2),
    ("dpmpp_2m_karras", 0.6, 0.0, 1.0, 1),
    ("euler_a", 1.3, 0.2, 0.8, 1),
    ("ddim", 0.9, 0.0, 0.5, 1),
    ("pndm", 1.0, 0.5, 1.0, 1),
])
def test_generation_matches_diffusers(tiny, sampler, weight, start, end, batch):
    image = control_image(1)
    steps = 6
    expected = reference(tiny["one"], sampler, image, seed=7, steps=steps, batch=batch, scale=weight, start=start,
                         end=end, image=image)
    unit = ControlUnit(tiny["folders"][0], image, weight=weight, guidance_start=start, guidance_end=end,
                       resize_mode="just-resize")
    got, result = generate(tiny["engine"], sampler, [unit], seed=7, steps=steps, batch=batch)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    plain, plain_result = generate(tiny["engine"], sampler, [], seed=7, steps=steps, batch=batch)
    change = (result.latents - plain_result.latents).abs().mean() / plain_result.latents.abs().mean()
    assert change > 0.02 and np.abs(plain - got).max() > 4 * MAX_PIXEL_DIFF   # the control changed the image
    info = result.infotext["ControlNet 0"]
    assert info.startswith("Module: none, Model: cn0 [") and f"Weight: {weight:g}" in info


def test_two_controlnets_match_multicontrolnet(tiny):
    images = [control_image(2), control_image(3)]
    expected = reference(tiny["two"], "euler", images, seed=3, steps=5, scale=[0.8, 1.2], start=[0.0, 0.2],
                         end=[1.0, 0.8], image=images)
    units = [ControlUnit(tiny["folders"][0], images[0], weight=0.8, resize_mode="just-resize"),
             ControlUnit(tiny["folders"][1], images[1], weight=1.2, guidance_start=0.2, guidance_end=0.8,
                         resize_mode="just-resize")]
    got, result = generate(tiny["engine"], "euler", units, seed=3, steps=5)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert set(result.infotext) >= {"ControlNet 0", "ControlNet 1"}


def test_original_file_gives_the_folders_image(tiny):
    image = control_image(4)
    a, _ = generate(tiny["engine"], "euler", [ControlUnit(tiny["folders"][0], image, resize_mode="just-resize")],
                    seed=2, steps=4)
    b, _ = generate(tiny["engine"], "euler", [ControlUnit(tiny["file"], image, resize_mode="just-resize")],
                    seed=2, steps=4)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m_karras"])
def test_img2img_matches_diffusers(tiny, sampler):
    control = control_image(5)
    init = Image.fromarray(np.asarray(control_image(6))[::-1].copy())
    expected = reference(tiny["img"], sampler, control, seed=9, steps=8, scale=0.9, start=0.1, end=0.9,
                         image=init, control_image=control, strength=0.6)
    unit = ControlUnit(tiny["folders"][0], control, weight=0.9, guidance_start=0.1, guidance_end=0.9,
                       resize_mode="just-resize")
    got, _ = generate(tiny["engine"], sampler, [unit], seed=9, steps=8, init_image=init, strength=0.6)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


# --- the cases bench/parity.py runs at the real SD 1.5 shapes --------------------------------------------------------
# (layout, sampler, weight, guidance start, guidance end) of one ControlNet: 4 steps, seed 21; "original" is
# lllyasviel's single-file layout in fp16 under control_model., as the control_v11p_sd15_* releases are.
PARITY_CASES = [("folder", "dpmpp_2m_karras", 1.0, 0.0, 1.0), ("original", "euler_a", 0.7, 0.25, 0.75)]


def parity_case(pipe, engine, path, sampler, weight, start, end):
    """One of ``PARITY_CASES`` with the ControlNet at ``path``: (sdlite's pixels, diffusers' pixels, sdlite's pixels
    without the control)."""
    image = control_image(1)
    expected = reference(pipe, sampler, image, seed=21, steps=4, scale=weight, start=start, end=end, image=image)
    unit = ControlUnit(path, image, weight=weight, guidance_start=start, guidance_end=end, resize_mode="just-resize")
    got, _ = generate(engine, sampler, [unit], seed=21, steps=4)
    plain, _ = generate(engine, sampler, [], seed=21, steps=4)
    return got, expected, plain


def parity_two(pipe, engine, path):
    """Two units of the ControlNet at ``path`` (Euler, weights 0.6 and 1.1, the second from half way) against
    MultiControlNetModel of that network twice: (sdlite's pixels, diffusers' pixels)."""
    images = [control_image(2), control_image(3)]
    expected = reference(pipe, "euler", images, seed=4, steps=4, scale=[0.6, 1.1], start=[0.0, 0.5], end=[1.0, 1.0],
                         image=images)
    units = [ControlUnit(path, images[0], weight=0.6, resize_mode="just-resize"),
             ControlUnit(path, images[1], weight=1.1, guidance_start=0.5, resize_mode="just-resize")]
    got, _ = generate(engine, "euler", units, seed=4, steps=4)
    return got, expected


def parity_img2img(pipe, engine, path):
    """Image to image (DDIM, strength 0.7, 6 steps, weight 0.8) against StableDiffusionControlNetImg2ImgPipeline:
    (sdlite's pixels, diffusers' pixels)."""
    init = Image.fromarray(np.random.default_rng(5).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
    control = control_image(6)
    expected = reference(pipe, "ddim", control, seed=8, steps=6, scale=0.8, image=init, control_image=control,
                         strength=0.7)
    unit = ControlUnit(path, control, weight=0.8, resize_mode="just-resize")
    got, _ = generate(engine, "ddim", [unit], seed=8, steps=6, init_image=init, strength=0.7)
    return got, expected


@pytest.mark.parametrize("layout,sampler,weight,start,end", PARITY_CASES)
def test_parity_cases_match_diffusers(tiny, layout, sampler, weight, start, end):
    """Each layout as its own case against diffusers' pipeline (the fp16 single file holds the network's very
    values), and the control changes the image."""
    got, expected, plain = parity_case(tiny["one"], tiny["engine"], tiny["layouts"][layout], sampler, weight, start,
                                       end)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(plain - got).max() > 4 * MAX_PIXEL_DIFF


def test_parity_two_units_of_one_controlnet_match_multicontrolnet(tiny):
    """The same ControlNet given twice, as two units with their own maps, weights and windows."""
    two = tiny["two"]
    pipe = type(two)(**{**two.components, "controlnet": type(two.controlnet)([tiny["nets"][0]] * 2)})
    pipe.set_progress_bar_config(disable=True)
    got, expected = parity_two(pipe, tiny["engine"], tiny["layouts"]["folder"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_parity_img2img_matches_diffusers(tiny):
    """Image to image from a noise source with DDIM, the control over every step."""
    got, expected = parity_img2img(tiny["img"], tiny["engine"], tiny["layouts"]["folder"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


# --- A1111's control modes ----------------------------------------------------------------------------------------

def test_soft_injection_scales_are_a1111s():
    unit = ControlUnit("m", mode="prompt", weight=0.8).checked()
    scales = residual_scales(unit, 13)
    assert scales == [0.8 * 0.825 ** float(12 - i) for i in range(13)]
    assert residual_scales(unit, 10) == scales[:10]          # SDXL's 10 residuals take the first 10 factors
    assert residual_scales(ControlUnit("m", weight=0.8).checked(), 13) == [0.8] * 13


def test_keep_rule_is_diffusers():
    # diffusers: keeps = 1.0 - float(i / len(timesteps) < s or (i + 1) / len(timesteps) > e)
    for steps in (1, 4, 7, 20):
        for s, e in ((0.0, 1.0), (0.2, 0.8), (0.5, 0.5), (0.0, 0.3), (0.9, 1.0)):
            want = [1.0 - float(i / steps < s or (i + 1) / steps > e) for i in range(steps)]
            assert [float(keep(i, steps, s, e)) for i in range(steps)] == want


@pytest.mark.parametrize("mode", ["prompt", "control"])
def test_soft_modes_match_a_direct_computation(tiny, mode):
    """One denoiser call with the unit against the UNet given the residuals the extension's formulas say: every
    residual i times weight * 0.825^(12 - i); "control" zeroes the unconditional half."""
    from sdlite.control.apply import ActiveControl, ControlledUNet, hint_tensor

    engine = tiny["engine"]
    net, label = engine.controlnet(tiny["folders"][0])
    unit = ControlUnit(tiny["folders"][0], mode=mode, weight=0.7).checked()
    hint = hint_tensor(control_image(7))
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(4, 4, 32, 32, generator=g), torch.randn(4, 77, 32, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad(), engine.models.use("unet") as unet:
        got = ControlledUNet(unet, [ActiveControl(unit, net, hint, label)], cfg=True, steps=1)(x, t, context=ctx)
        down, mid = net(x, t, ctx, hint.expand(4, -1, -1, -1), 1.0)
        factors = [0.7 * 0.825 ** float(12 - i) for i in range(13)][:len(down) + 1]
        down = [d * f for d, f in zip(down, factors)]
        mid = mid * factors[len(down)]
        if mode == "control":
            down = [torch.cat([torch.zeros_like(d[:2]), d[2:]]) for d in down]
            mid = torch.cat([torch.zeros_like(mid[:2]), mid[2:]])
        want = unet(x, t, ctx, control=(down, mid))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unit_values_are_checked_by_name(tiny):
    for unit, word in ((ControlUnit("m", weight=-1), "weight -1"),
                       (ControlUnit("m", guidance_start=0.8, guidance_end=0.2), "guidance start 0.8"),
                       (ControlUnit("m", mode="louder"), "control mode 'louder'"),
                       (ControlUnit("m", resize_mode=7), "resize mode 7"),
                       (ControlUnit("m", processor_res=3), "processor_res 3"),
                       (ControlUnit(None), "no model")):
        with pytest.raises(RequestError, match=word):
            tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=1, controls=(unit,)))
    with pytest.raises(RequestError, match="no control image"):
        tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=1,
                                        controls=(ControlUnit(tiny["folders"][0]),)))
    with pytest.raises(RequestError, match="depth_midas.*annotator"):
        tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=1, controls=(
            ControlUnit(tiny["folders"][0], control_image(0), preprocessor="depth_midas"),)))


def test_a1111_names_and_integers_are_taken():
    u = ControlUnit("m", mode="ControlNet is more important", resize_mode=2, hr_option="Low res only").checked()
    assert (u.mode, u.resize_mode, u.hr_option) == ("control", "resize-and-fill", "low-res-only")
    assert ControlUnit("m", mode=1, resize_mode="Just Resize").checked().mode == "prompt"


# --- a tiny SDXL ---------------------------------------------------------------------------------------------------

def test_tiny_sdxl_matches_diffusers(tmp_path):
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    from tests.test_sdxl_pipeline import saved_pipelines

    base, _ = saved_pipelines(tmp_path)
    cn = seed_all(ControlNetModel.from_unet(base.unet), 12, scale=0.05)
    with torch.no_grad():
        for conv in [*cn.controlnet_down_blocks, cn.controlnet_mid_block]:
            conv.weight.mul_(40)
    cn.save_pretrained(tmp_path / "cn-xl")
    components = {k: v for k, v in base.components.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = StableDiffusionXLControlNetPipeline(**components, controlnet=cn.eval(), force_zeros_for_empty_prompt=True)
    pipe.set_progress_bar_config(disable=True)
    engine = Engine.load(tmp_path / "base", precision="exact")
    image = control_image(8)
    for sampler, weight, start, end in (("euler", 1.0, 0.0, 1.0), ("dpmpp_2m_karras", 0.7, 0.2, 0.9)):
        expected = reference(pipe, sampler, image, seed=5, steps=5, scale=weight, start=start, end=end, image=image)
        unit = ControlUnit(tmp_path / "cn-xl", image, weight=weight, guidance_start=start, guidance_end=end,
                           resize_mode="just-resize")
        got, result = generate(engine, sampler, [unit], seed=5, steps=5)
        assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
        plain, plain_result = generate(engine, sampler, [], seed=5, steps=5)
        assert (result.latents - plain_result.latents).abs().max() / plain_result.latents.abs().max() > 0.02
    # with the refiner (diffusers' two-pipeline hand-off): the control acts on the base's steps only, so a window
    # that opens after the switch leaves the image uncontrolled
    engine.set_refiner(Engine.load(tmp_path / "refiner", precision="exact"))
    unit = ControlUnit(tmp_path / "cn-xl", image, resize_mode="just-resize")
    controlled, with_result = generate(engine, "euler", [unit], seed=5, steps=6, refiner_switch_at=0.5)
    plain, plain_result = generate(engine, "euler", [], seed=5, steps=6, refiner_switch_at=0.5)
    late, _ = generate(engine, "euler", [unit.replace(guidance_start=0.6)], seed=5, steps=6, refiner_switch_at=0.5)
    change = (with_result.latents - plain_result.latents).abs().max() / plain_result.latents.abs().max()
    assert change > 0.02 and np.abs(controlled - plain).max() > MAX_PIXEL_DIFF
    assert np.array_equal(late, plain)

    from sdlite.weights.controlnet import check_compatible
    from tests.reference import TINY_UNET_SD1

    cfile = open_controlnet(tmp_path / "cn-xl")
    cfile.close()
    assert cfile.config.unet.addition_embed == "text_time"
    with pytest.raises(ControlNetError, match=r"ControlNet for SDXL-like .*the model is sd1"):
        check_compatible(cfile.config, TINY_UNET_SD1, "cn-xl", "sd1")


# --- with everything else -----------------------------------------------------------------------------------------

def test_hires_fix_matches_diffusers_composition(tiny):
    """hr_option "Both": the first pass is diffusers' ControlNet pipeline with the control map fitted to the first
    pass's size, the second its ControlNet img2img pipeline on the upscaled latents with the map at the target size;
    "Low res only" / "High res only" leave the other pass uncontrolled."""
    from sdlite.control.apply import fit_control
    from sdlite.hires import Hires

    big = control_image(10, size=2 * SIZE)
    small = fit_control(big, SIZE, SIZE, "just-resize")
    one, img = tiny["one"], tiny["img"]
    for option, first_on, second_on in (("both", True, True), ("low-res-only", True, False),
                                        ("high-res-only", False, True)):
        use_scheduler(one, "euler")
        common = dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=7.5)
        latents = one(**common, image=small, height=SIZE, width=SIZE, num_inference_steps=4,
                      controlnet_conditioning_scale=1.0 if first_on else 0.0,
                      generator=torch.Generator().manual_seed(6), output_type="latent").images
        up = torch.nn.functional.interpolate(latents, size=(2 * SIZE // 2, 2 * SIZE // 2), mode="bilinear",
                                             antialias=False)
        use_scheduler(img, "euler")
        expected = as_uint8(img(**common, image=up, control_image=big, strength=0.5, num_inference_steps=4,
                                controlnet_conditioning_scale=1.0 if second_on else 0.0, height=2 * SIZE,
                                width=2 * SIZE, generator=torch.Generator().manual_seed(6),
                                output_type="np").images)
        unit = ControlUnit(tiny["folders"][0], big, resize_mode="just-resize", hr_option=option)
        got, result = generate(tiny["engine"], "euler", [unit], seed=6, steps=4,
                               hires=Hires(scale=2, upscaler="Latent", denoise=0.5))
        assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF, option
        assert "ControlNet 0" in result.infotext
        # the maps the networks got, for callers to show: the second pass's, then the first's
        sizes = [im.size for _, im, _ in result.control_maps]
        assert sizes == [(2 * SIZE,) * 2] * second_on + [(SIZE, SIZE)] * first_on


def test_inpainting_matches_diffusers(tiny):
    """A 4-channel model's inpainting with a ControlNet, against StableDiffusionControlNetInpaintPipeline (the
    unmasked region re-imposed after each step), and the inpaint preprocessor's control image (masked pixels -1)."""
    from diffusers import StableDiffusionControlNetInpaintPipeline

    from sdlite.control.apply import hint_tensor

    one = tiny["one"]
    pipe = StableDiffusionControlNetInpaintPipeline(**one.components)
    pipe.set_progress_bar_config(disable=True)
    use_scheduler(pipe, "euler")
    init = Image.fromarray(np.asarray(control_image(11))[:, ::-1].copy())
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    mask = Image.fromarray(mask)
    control = control_image(12)
    expected = as_uint8(pipe(PROMPT, negative_prompt=NEGATIVE, image=init, mask_image=mask, control_image=control,
                             strength=0.8, height=SIZE, width=SIZE, num_inference_steps=6, controlnet_conditioning_scale=1.0,
                             generator=torch.Generator().manual_seed(13), output_type="np").images)
    unit = ControlUnit(tiny["folders"][0], control, resize_mode="just-resize")
    got, _ = generate(tiny["engine"], "euler", [unit], seed=13, steps=6, init_image=init, mask=mask, strength=0.8,
                      mask_blur=0, overlay=False)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF

    hint = hint_tensor(init, mask)
    inside = torch.from_numpy(np.asarray(mask) > 127)
    assert bool((hint[0][:, inside] == -1).all()) and bool((hint[0][:, ~inside] >= 0).all())
    # the inpaint preprocessor takes the request's mask and gives the network that map
    unit = ControlUnit(tiny["folders"][0], None, preprocessor="inpaint_global_harmonious", resize_mode="just-resize")
    r = Request(PROMPT, width=SIZE, height=SIZE, init_image=init, mask=mask, controls=(unit,))
    from sdlite.pipeline import validate

    (active,) = tiny["engine"].prepare_controls(validate(r), SIZE, SIZE)
    assert torch.equal(active.hint, hint)


def test_with_a_lora_matches_diffusers(tiny, tmp_path):
    """A LoRA changes the UNet and not the ControlNet, in diffusers (load_lora_weights + fuse_lora) as here."""
    from sdlite.loader import build_network
    from tests.test_lora import ATTENTION, CONVS, layer_shapes, random_factors, targets, write_kohya

    with torch.device("meta"):
        unet = build_network("unet", tiny["engine"].spec)
    factors = random_factors(targets(layer_shapes(unet), ATTENTION + CONVS), 4, 3, strength=4.0)
    lora = write_kohya(tmp_path / "tiny_lora.safetensors", unet=factors)
    control = control_image(14)
    pipe = tiny["one"]
    pipe.load_lora_weights(str(lora), adapter_name="l0")
    try:
        pipe.fuse_lora(lora_scale=0.8, adapter_names=["l0"])
        expected = reference(pipe, "euler", control, seed=15, steps=4, image=control)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    unit = ControlUnit(tiny["folders"][0], control, resize_mode="just-resize")
    got, result = generate(tiny["engine"], "euler", [unit], seed=15, steps=4, loras=((lora, 0.8),))
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    without, _ = generate(tiny["engine"], "euler", [unit], seed=15, steps=4)
    assert np.abs(without - got).max() > 4 * MAX_PIXEL_DIFF   # the LoRA matters
    assert "ControlNet 0" in result.infotext


def test_memory_mode_0_streams_it_and_gives_the_same_image(tiny):
    from sdlite.engine.memory import WeightStreamer

    unit = ControlUnit(tiny["folders"][1], control_image(16), resize_mode="just-resize")
    resident, _ = generate(tiny["engine"], "dpmpp_2m_karras", [unit], seed=17, steps=4)
    low = Engine.load(tiny["tmp"] / "model", precision="exact", memory_mode=0)
    streamed, _ = generate(low, "dpmpp_2m_karras", [unit], seed=17, steps=4)
    assert np.array_equal(streamed, resident)
    net, _ = low.controlnet(tiny["folders"][1])
    assert isinstance(getattr(net, "_streamer", None), WeightStreamer)
    assert all(p.device.type == "meta" for p in net.parameters())   # no weight resident between blocks


def test_bf16_precision_stays_close_to_exact(tiny):
    import warnings

    from sdlite.engine.cpu import bf16_support
    from sdlite.engine.precision import PrecisionError

    if bf16_support() == "none":   # an AVX2-only CPU: bf16 is refused, ControlNet or not
        with pytest.raises(PrecisionError, match="bf16 needs bf16 kernels"):
            Engine.load(tiny["tmp"] / "model", precision="bf16")
        return
    warnings.filterwarnings("ignore", message=".*no native bf16")
    unit = ControlUnit(tiny["folders"][0], control_image(18), resize_mode="just-resize")
    exact, _ = generate(tiny["engine"], "euler", [unit], seed=19, steps=6)
    engine = Engine.load(tiny["tmp"] / "model", precision="bf16")
    got, result = generate(engine, "euler", [unit], seed=19, steps=6)
    net, _ = engine.controlnet(tiny["folders"][0])
    assert net.dtype == torch.bfloat16 and result.infotext["Precision"].startswith("bf16")
    mse = np.mean((got.astype(np.float64) - exact) ** 2)
    assert 10 * np.log10(255 ** 2 / mse) >= 30


def test_inpainting_the_masked_area_crops_the_control_as_the_source(tiny):
    """Inpaint area "masked" (A1111's inpaint_full_res, its API default): the control map is the source's crop of
    it (fitted to the canvas, cropped to the same box, fitted to the run's size as "resize and fill")."""
    from sdlite.control.apply import fit_control, hint_tensor
    from sdlite.pipeline import validate

    init = control_image(20, size=96)
    mask = np.zeros((96, 96), np.uint8)
    mask[60:80, 10:40] = 255
    mask = Image.fromarray(mask)
    control = control_image(21, size=96)
    unit = ControlUnit(tiny["folders"][0], control, resize_mode="just-resize")
    r = validate(Request(PROMPT, width=SIZE, height=SIZE, steps=4, seed=3, init_image=init, mask=mask,
                         inpaint_area="masked", controls=(unit,)))
    source = tiny["engine"].prepare_source(r)
    assert source.paste_box is not None
    (active,) = tiny["engine"].prepare_controls(r, SIZE, SIZE, source=source)
    want = fit_control(fit_control(control, 96, 96, "just-resize").crop(source.paste_box), SIZE, SIZE,
                       "resize-and-fill")
    assert torch.equal(active.hint, hint_tensor(want))
    result = tiny["engine"].generate(r)
    assert result.images[0].size == (96, 96) and "ControlNet 0" in result.infotext
    # away from the mask (beyond its 4 px blur) the source is pasted back: the control changes only the inpainting
    outside = np.ones((96, 96), bool)
    outside[48:92, 0:52] = False
    assert np.abs(np.asarray(result.images[0], np.int16) - np.asarray(init, np.int16))[outside].max() <= 2


def test_tiny_sd2_bare_file_matches_diffusers(tmp_path):
    """SD 2.x (Linear projections, 64-wide heads, v-prediction): a bare original-layout file, as the SD 2.1
    ControlNets are published, against StableDiffusionControlNetPipeline."""
    from diffusers import StableDiffusionControlNetPipeline

    pipe = diffusers_pipeline("sd2", tmp_path, prediction_type="v_prediction")
    with torch.no_grad():
        pipe.unet.conv_out.weight.mul_(8)
    pipe = saved_pipeline(with_contrast(pipe), tmp_path / "model")
    cn = diffusers_controlnet(pipe.unet, 30)
    save_file(original_state(cn), tmp_path / "controlnet_sd21_tiny.safetensors")
    ref = StableDiffusionControlNetPipeline(**pipe.components, controlnet=cn)
    ref.set_progress_bar_config(disable=True)
    engine = Engine.load(tmp_path / "model", precision="exact")
    image = control_image(22)
    expected = reference(ref, "dpmpp_2m_karras", image, seed=4, steps=5, scale=0.8, image=image)
    unit = ControlUnit(tmp_path / "controlnet_sd21_tiny.safetensors", image, weight=0.8, resize_mode="just-resize")
    got, result = generate(engine, "dpmpp_2m_karras", [unit], seed=4, steps=5)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    plain, plain_result = generate(engine, "dpmpp_2m_karras", [], seed=4, steps=5)
    assert (result.latents - plain_result.latents).abs().max() / plain_result.latents.abs().max() > 0.02
