"""The small distilled UNets people run on CPUs, against diffusers' UNet2DConditionModel built from the same configs:

* BK-SDM (Nota AI; segmind's small-sd / tiny-sd are the same shapes): one resnet and transformer per level
  (``layers_per_block: 1``); Base keeps the middle block, Small drops it (``mid_block_type: null``), Tiny also drops
  the last level (three levels, all with attention). Facts: the ``unet_config/bk_{base,small,tiny}/config.json`` of
  Nota-NetsPresso/BK-SDM.
* SDXS-512 (IDKiro): a BK-SDM-Tiny-shaped UNet, DreamShaper's (SD 1.5) without attention at the first level, 0.9's
  on SD 2.1 (64-wide heads, Linear projections). SDXS-1024 is not published.
* SSD-1B and Vega (segmind): SDXL with a one-resnet middle block (``mid_block_type: UNetMidBlock2D``) and fewer
  transformer blocks: SSD-1B per layer (down ``[1, 2, 4]``, up ``[[4, 4, 10], [2, 1, 1], 1]`` lowest resolution
  first), Vega ``[1, 1, 2]`` both ways. Facts: stable-diffusion.cpp's ``unet.hpp`` and ComfyUI's ``supported_models``.

Tiny configs of each pattern are compared output for output, loaded from diffusers folders and from single files in
the original layout (the key numbering diffusers' conversion script gives one-layer UNets, the SGM layout for
SDXL), whose UNet config sdlite infers from the keys; the published full-size configs are checked on the meta
device, key for key and by parameter count.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdlite.config import PRESETS, UNetConfig
from sdlite.loader import open_model
from sdlite.models.unet import UNet
from sdlite.pipeline import Engine, Request
from tests.reference import diffusers_unet, max_rel_err, saved_pipeline, seed_all, write_hf_tokenizer_files
from tests.test_generate import max_pixel_diff, reference_images, run_cli
from tests.test_models_parity import _load_same
from tests.test_sdxl_pipeline import TEXT_G, TEXT_L, _text
from tests.test_sdxl_single_file import VAE, sgm_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4   # max |ours - diffusers'| / max |diffusers'|, as the other UNet tests; the SD 1.x-shaped ones are bit-exact

_SD1 = dict(context_dim=32, sample_size=8)
_XL = dict(linear_projection=True, context_dim=32 + 40, addition_embed="text_time", addition_time_embed_dim=8,
           add_embed_in=24 + 6 * 8, sample_size=8)   # the text towers of tests.test_sdxl_pipeline
VARIANTS = {
    "bk-sdm-base": UNetConfig(block_channels=(32, 64, 64, 64), layers_per_block=1, attention=(True, True, True, False),
                              heads=(2, 2, 2, 2), **_SD1),
    "bk-sdm-small": UNetConfig(block_channels=(32, 64, 64, 64), layers_per_block=1,
                               attention=(True, True, True, False), heads=(2, 2, 2, 2), mid_block=None, **_SD1),
    # SD 1.x's 8 heads, which a single file's shapes cannot show (the single-file tests read it)
    "bk-sdm-tiny": UNetConfig(block_channels=(32, 64, 64), layers_per_block=1, attention=(True, True, True),
                              heads=(8, 8, 8), mid_block=None, **_SD1),
    "sdxs-512-dreamshaper": UNetConfig(block_channels=(32, 64, 64), layers_per_block=1,
                                       attention=(False, True, True), heads=(2, 2, 2), mid_block=None, **_SD1),
    "sdxs-512-0.9": UNetConfig(block_channels=(32, 64, 64), layers_per_block=1, attention=(True, True, True),
                               heads=(2, 4, 4), linear_projection=True, mid_block=None, context_dim=48, sample_size=8),
    "ssd-1b": UNetConfig(block_channels=(64, 128, 128), layers_per_block=2, attention=(False, True, True),
                         heads=(1, 2, 2), transformer_depth=(1, 2, 3), up_transformer_depth=(1, (2, 1, 1), (3, 3, 4)),
                         mid_block="resnet", **_XL),
    "vega": UNetConfig(block_channels=(64, 128, 128), layers_per_block=2, attention=(False, True, True),
                       heads=(1, 2, 2), transformer_depth=(1, 1, 2), mid_block="resnet", **_XL),
}


def _inputs(cfg: UNetConfig, batch: int = 2):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(batch, 4, 16, 24, generator=g)
    ctx = torch.randn(batch, 9, cfg.context_dim, generator=g)
    extra = {}
    if cfg.addition_embed:
        extra = {"text_embeds": torch.randn(batch, 24, generator=g),
                 "time_ids": torch.tensor([[64.0, 96.0, 0.0, 0.0, 64.0, 96.0]] * batch)}
    return x, torch.tensor([999.0, 17.5][:batch]), ctx, extra


@pytest.mark.parametrize("name", list(VARIANTS))
def test_unet_matches_diffusers(name):
    cfg = VARIANTS[name]
    ref = seed_all(diffusers_unet(cfg), scale=0.05)
    assert UNetConfig.from_diffusers(dict(ref.config)) == cfg     # the config round-trips through diffusers'
    assert (ref.mid_block is None) == (cfg.mid_block is None)
    ours = _load_same(UNet(cfg), ref)
    x, t, ctx, extra = _inputs(cfg)
    with torch.no_grad():
        expected = ref(x, t, encoder_hidden_states=ctx, added_cond_kwargs=extra or None).sample
        got = ours(x, t, ctx, **extra)
    err = max_rel_err(got, expected)
    print(f"{name}: max rel err {err:.2e}, bit-exact {torch.equal(got, expected)}")
    assert err <= TOL
    if not (cfg.addition_embed or cfg.linear_projection):   # SD 1.x-shaped: bit for bit
        assert torch.equal(got, expected)


def test_per_layer_depths_are_built_per_layer():
    ours = UNet(VARIANTS["ssd-1b"])
    depth = [len(a.transformer_blocks) for a in ours.up_blocks[1].attentions]
    assert depth == [2, 1, 1] and [len(a.transformer_blocks) for a in ours.up_blocks[0].attentions] == [3, 3, 4]
    assert len(ours.mid_block.resnets) == 1 and not hasattr(ours.mid_block, "attentions")
    assert not list(UNet(VARIANTS["bk-sdm-tiny"]).mid_block.parameters())


def test_config_errors_name_the_field():
    from sdlite.config import ConfigError

    d = VARIANTS["ssd-1b"].to_diffusers()
    with pytest.raises(ConfigError, match="mid_block_type='UNetMidBlock2DSimpleCrossAttn'"):
        UNetConfig.from_diffusers({**d, "mid_block_type": "UNetMidBlock2DSimpleCrossAttn"})
    with pytest.raises(ConfigError, match="reverse_transformer_layers_per_block"):
        UNetConfig.from_diffusers({**d, "reverse_transformer_layers_per_block": [1, 2]})
    with pytest.raises(ConfigError, match="3 depths for 2 layers"):
        dataclasses.replace(VARIANTS["ssd-1b"], transformer_depth=(1, (2, 2, 2), 3))
    with pytest.raises(ConfigError, match="need the up path"):
        dataclasses.replace(VARIANTS["ssd-1b"], transformer_depth=(1, (2, 1), 3), up_transformer_depth=())


# --- the published full-size configs, on the meta device ----------------------------------------------------------

def _published() -> dict[str, tuple[dict, float]]:
    """name -> (its unet/config.json as the facts above give it, its published UNet size in billions)."""
    sd15, sd21, sdxl = (dict(PRESETS[p].unet.to_diffusers()) for p in ("sd15", "sd21-base", "sdxl"))
    three = dict(block_out_channels=[320, 640, 1280], down_block_types=["CrossAttnDownBlock2D"] * 3,
                 up_block_types=["CrossAttnUpBlock2D"] * 3)
    return {
        "bk-sdm-base": (dict(sd15, layers_per_block=1), 0.58),
        "bk-sdm-small": (dict(sd15, layers_per_block=1, mid_block_type=None), 0.48),
        "bk-sdm-tiny": (dict(sd15, layers_per_block=1, mid_block_type=None, attention_head_dim=8, **three), 0.32),
        "bk-sdm-v2-tiny / sdxs-512-0.9": (dict(sd21, layers_per_block=1, mid_block_type=None,
                                               attention_head_dim=[5, 10, 20], **three), 0.33),
        "sdxs-512-dreamshaper": (dict(sd15, layers_per_block=1, mid_block_type=None, attention_head_dim=8,
                                      **dict(three, down_block_types=["DownBlock2D"] + three["down_block_types"][1:],
                                             up_block_types=three["up_block_types"][:2] + ["UpBlock2D"])), 0.32),
        "ssd-1b": (dict(sdxl, mid_block_type="UNetMidBlock2D", transformer_layers_per_block=[1, 2, 4],
                        reverse_transformer_layers_per_block=[[4, 4, 10], [2, 1, 1], 1]), 1.33),
        "segmind-vega": (dict(sdxl, mid_block_type="UNetMidBlock2D", transformer_layers_per_block=[1, 1, 2]), 0.745),
    }


@pytest.mark.parametrize("name", list(_published()))
def test_published_configs_at_full_size(name):
    from diffusers import UNet2DConditionModel

    config, size = _published()[name]
    config.pop("_class_name", None)
    with torch.device("meta"):
        ref = UNet2DConditionModel(**config)
        ours = UNet(UNetConfig.from_diffusers(dict(ref.config)))
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    count = sum(p.numel() for p in ours.parameters())
    print(f"{name}: {count / 1e9:.3f}B parameters")
    assert count / 1e9 == pytest.approx(size, abs=0.006)


# --- diffusers folders and single files, SD 1.x-shaped (tiny-sd / BK-SDM-Tiny) ------------------------------------

_TEXT = dict(width=32, layers=2, heads=4, mlp_width=37, projection_dim=32)


def _sd_pipeline(unet_cfg: UNetConfig, tmp):
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    from transformers import CLIPTokenizer

    from sdlite.config import TextEncoderConfig
    from tests.reference import TINY_VAE, diffusers_vae, transformers_text, with_contrast

    torch.manual_seed(0)
    tok = CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "tok")))
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=seed_all(diffusers_vae(TINY_VAE), 1, scale=0.05),
                                   text_encoder=seed_all(transformers_text(TextEncoderConfig(**_TEXT)), 2),
                                   tokenizer=tok, unet=seed_all(diffusers_unet(unet_cfg), 0, scale=0.05),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    return with_contrast(pipe)


def _script_unet_state(state: dict) -> dict:
    """A UNet state dict renamed as diffusers' conversion script
    (scripts/convert_diffusers_to_original_stable_diffusion.py) renames it, from the facts of its tables: resnet
    parts renamed in every key with "resnets" in it, then the prefixes of SD 1.5's blocks replaced (three numbers per level, resnets j < 2 down and j < 3 up, attentions only
    at down levels 0-2 and up levels 1-3, the level-0 upsampler at slot 1), then ``model.diffusion_model.``. Keys its
    table does not name keep their diffusers names: a one-layer UNet's up_blocks.0 attentions."""
    resnet = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
              ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection")]
    whole = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
             "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}
    layer = []
    for i in range(4):
        for j in range(2):
            layer.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{3 * i + j + 1}.0."))
            if i < 3:
                layer.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{3 * i + j + 1}.1."))
        for j in range(3):
            layer.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{3 * i + j}.0."))
            if i > 0:
                layer.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{3 * i + j}.1."))
        if i < 3:
            layer.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{3 * (i + 1)}.0.op."))
            layer.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{3 * i + 2}.{1 if i == 0 else 2}."))
    layer.append(("mid_block.attentions.0.", "middle_block.1."))
    layer += [(f"mid_block.resnets.{j}.", f"middle_block.{2 * j}.") for j in range(2)]
    out = {}
    for key, value in state.items():
        name = next((new + key[len(old):] for old, new in whole.items() if key.startswith(old)), key)
        if "resnets" in name:
            for hf, sd in resnet:
                name = name.replace(hf, sd)
        for hf, sd in layer:
            name = name.replace(hf, sd)
        out["model.diffusion_model." + name] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    """A BK-SDM-Tiny-shaped pipeline: its diffusers folder, sdlite's single file of it (LDM numbering) and one with
    the UNet numbered as diffusers' conversion script numbers it."""
    from sdlite.export import save_single_file
    from sdlite.loader import load_model

    tmp = tmp_path_factory.mktemp("tiny_sd")
    pipe = saved_pipeline(_sd_pipeline(VARIANTS["bk-sdm-tiny"], tmp), tmp / "folder")   # as diffusers reads it back
    save_single_file(load_model(tmp / "folder"), tmp / "sdlite.safetensors")
    tensors = {k: v for k, v in load_file(tmp / "sdlite.safetensors").items()
               if not k.startswith("model.diffusion_model.")}
    tensors.update(_script_unet_state(pipe.unet.state_dict()))
    pipe.set_progress_bar_config(disable=True)
    save_file(tensors, tmp / "script.safetensors")
    return pipe, tmp


def test_folder_and_single_files_open_with_the_config_inferred(tiny_sd):
    _, tmp = tiny_sd
    cfg = VARIANTS["bk-sdm-tiny"]
    for path in ("folder", "sdlite.safetensors", "script.safetensors"):
        with open_model(tmp / path) as ckpt:
            assert not ckpt.problems(), path
            unet = ckpt.spec.unet
            assert (unet.block_channels, unet.layers_per_block, unet.attention, unet.mid_block) == \
                (cfg.block_channels, 1, cfg.attention, None), path
            assert ckpt.detection.family == "sd1"
    keys = load_file(tmp / "script.safetensors")
    assert "model.diffusion_model.output_blocks.2.1.conv.weight" in keys            # the numbering with gaps
    # the lowest level's up attentions, which the script's table (written for SD 1.5) leaves in diffusers naming
    assert "model.diffusion_model.up_blocks.0.attentions.1.proj_in.weight" in keys
    assert not any(k.startswith("model.diffusion_model.output_blocks.0.1.") for k in keys)
    assert not any(k.startswith("model.diffusion_model.middle_block.") for k in keys)


@pytest.mark.parametrize("path", ["folder", "script.safetensors"])
def test_generates_diffusers_image(tiny_sd, tmp_path, path):
    pipe, tmp = tiny_sd
    expected = reference_images(pipe, "euler", steps=3, seed=7, size=64)
    _, got = run_cli(tmp / path, tmp_path / "out.png", "euler", steps=3, seed=7, size=64)
    assert max_pixel_diff(got, expected) <= 2


# --- SSD-1B-shaped SDXL: folder and SGM single file ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ssd(tmp_path_factory):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    from sdlite.config import PUBLISHED_SCHEDULERS
    from tests.reference import diffusers_vae

    tmp = tmp_path_factory.mktemp("ssd")
    cfg = VARIANTS["ssd-1b"]
    torch.manual_seed(0)
    pipe = StableDiffusionXLPipeline(
        vae=seed_all(diffusers_vae(VAE), 1, scale=0.05), text_encoder=_text(TEXT_L, False, 2),
        text_encoder_2=_text(TEXT_G, True, 3),
        tokenizer=CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "tok1"))),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "tok2", pad_token="!"))),
        unet=seed_all(diffusers_unet(cfg), 0, scale=0.05),
        scheduler=EulerDiscreteScheduler.from_config(PUBLISHED_SCHEDULERS["sdxl"][1]))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp / "folder")
    save_file(sgm_file(pipe, cfg), tmp / "ssd.safetensors")
    return pipe, tmp


def test_ssd_folder_and_single_file(ssd):
    pipe, tmp = ssd
    cfg = VARIANTS["ssd-1b"]
    expected = pipe(prompt="a red circle", num_inference_steps=2, guidance_scale=5.0, height=64, width=64,
                    generator=torch.Generator().manual_seed(3), output_type="np").images
    expected = np.round(np.clip(expected, 0, 1) * 255).astype(np.int16)
    for path in ("folder", "ssd.safetensors"):
        engine = Engine.load(tmp / path, precision="exact")
        unet = engine.spec.unet
        assert engine.spec.family == "sdxl"
        assert (unet.mid_block, unet.transformer_depth, unet.up_transformer_depth) == \
            (cfg.mid_block, cfg.transformer_depth, cfg.up_transformer_depth), path
        got = engine.generate(Request(prompt="a red circle", steps=2, cfg_scale=5.0, sampler="euler", seed=3,
                                      width=64, height=64))
        pixels = np.stack([np.asarray(im, dtype=np.int16) for im in got.images])
        assert np.abs(pixels - expected).max() <= 2, path


def test_info_describes_the_small_unets(tiny_sd, ssd, capsys):
    from sdlite.cli import main

    assert main(["info", str(tiny_sd[1] / "folder")]) == 0
    assert main(["info", str(ssd[1] / "ssd.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "no middle block" in out
    assert "one-resnet middle block" in out and "up [1, [2, 1, 1], [3, 3, 4]]" in out
