"""Model families (sdlite.families): every preset finds its family, each family answers what the loop asks from the
spec it was given, and the loop asks instead of testing which family it runs. The families' conditioning and
decoding against diffusers is held by the pipeline tests (test_generate, test_sdxl_pipeline, test_x4_upscaler,
test_taiyi)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from sdlite import config
from sdlite.errors import RequestError
from sdlite.config import sd3 as sd3_config
from sdlite.families import FAMILIES, SD3Family, SDFamily, SDXLFamily, X4Family, family_for
from sdlite.families.base import CHEAP_RGB, CHEAP_RGB_SDXL, approximate_images
from sdlite.families.sd3 import CHEAP_RGB_SD3
from sdlite.pipeline import Request

PRESETS = {
    "SD15": SDFamily, "SD15_INPAINT": SDFamily, "SD21_BASE": SDFamily, "SD21_V": SDFamily, "SD2_INPAINT": SDFamily,
    "DEMO": SDFamily, "TAIYI": SDFamily, "SD_TURBO": SDFamily, "SDXL_BASE": SDXLFamily, "SDXL_REFINER": SDXLFamily,
    "SDXL_TURBO": SDXLFamily, "SD_X4_UPSCALER": X4Family,
    "SD3_MEDIUM_MODEL": SD3Family, "SD35_MEDIUM_MODEL": SD3Family, "SD35_LARGE_MODEL": SD3Family,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_finds_its_family_and_its_answers(name):
    spec = getattr(config, name, None) or getattr(sd3_config, name)
    family = family_for(spec)
    assert type(family) is PRESETS[name]
    assert [f for f in FAMILIES if f.takes(spec)][0] is PRESETS[name]
    latent = family.latent
    assert (latent.channels, latent.downscale, latent.scaling_factor) == \
        (spec.vae.latent_channels, spec.vae.downscale, spec.vae.scaling_factor)
    assert latent.shift_factor == spec.vae.shift_factor
    assert family.prediction_type == ("flow" if PRESETS[name] is SD3Family else spec.prediction_type)
    assert family.default_size == spec.default_size and family.scheduler_config == spec.scheduler
    assert latent.preview_rgb == {SDXLFamily: CHEAP_RGB_SDXL, SD3Family: CHEAP_RGB_SD3}.get(PRESETS[name], CHEAP_RGB)
    assert family.inpainting == (name in ("SD15_INPAINT", "SD2_INPAINT"))


def test_a_spec_no_family_takes_is_refused_by_name():
    # no text encoder of its own and no added conditioning: neither SD's nor SDXL's
    spec = config.SDXL_REFINER.replace(family="mystery", unet=config.SD15.unet)
    with pytest.raises(ValueError, match="no sdlite family runs a mystery model"):
        family_for(spec)


def test_what_the_families_refuse():
    with pytest.raises(RequestError, match="sdlite upscale IMAGE --model PATH"):
        family_for(config.SD_X4_UPSCALER).check_generate(Request("a cat"))
    family_for(config.SD15).check_generate(Request("a cat"))        # draws images: nothing to refuse
    inpaint = family_for(config.SD15_INPAINT)
    inpaint.check_request(Request("a cat"))                         # text to image on an inpainting model runs
    with pytest.raises(RequestError, match="inpainting model: image to image needs a mask"):
        inpaint.check_request(Request("a cat", init_image="source.png"))
    odd = family_for(config.SD15.replace(unet=dataclasses.replace(config.SD15.unet, in_channels=5)))
    with pytest.raises(RequestError, match="this UNet takes 5 input channels"):
        odd.check_request(Request("a cat"))
    for spec in (config.SD15, config.SDXL_BASE, config.SD_X4_UPSCALER):   # no transformer blocks to skip
        with pytest.raises(RequestError, match="skip-layer guidance skips blocks of SD3.5's transformer"):
            family_for(spec).check_request(Request("a cat", slg_layers=(7,)))
    sd35 = family_for(sd3_config.SD35_MEDIUM_MODEL)
    sd35.check_request(Request("a cat", slg_layers=(7, 8, 9)))
    with pytest.raises(RequestError, match=r"layers \[24\] are not blocks of this transformer \(0..23\)"):
        sd35.check_request(Request("a cat", slg_layers=(24,)))


def test_load_dtypes_follow_the_family():
    """SDXL keeps half-precision files' weights as they are on a CPU computing fp32 and decodes in fp32 under fp16;
    the x4 upscaler decodes in fp32 under fp16 (its force_upcast); SD takes the plan as it is."""
    from types import SimpleNamespace

    cpu, half = torch.device("cpu"), SimpleNamespace(storage_dtype=torch.float16)
    fp32 = SimpleNamespace(dtype=torch.float32, quantize="none", vae_dtype=torch.float32)
    fp16 = SimpleNamespace(dtype=torch.float16, quantize="none", vae_dtype=torch.float16)
    assert family_for(config.SDXL_BASE).load_dtypes(half, fp32, cpu, 1, None, None) == (torch.float16, torch.float32)
    assert family_for(config.SDXL_BASE).load_dtypes(half, fp32, cpu, 0, None, None) == (None, torch.float32)
    assert family_for(config.SDXL_BASE).load_dtypes(half, fp16, cpu, 1, None, None) == (None, torch.float32)
    assert family_for(config.SD_X4_UPSCALER).load_dtypes(half, fp16, cpu, 1, None, None)[1] == torch.float32
    assert family_for(config.SD15).load_dtypes(half, fp16, cpu, 1, None, None) == (None, torch.float16)


def test_sdxl_time_ids_as_diffusers_builds_them():
    r = Request("a cat", width=1024, height=768, original_size=(512, 512), crops_coords_top_left=(4, 8))
    pos, neg = family_for(config.SDXL_BASE).time_ids(r, "cpu")
    assert pos.tolist() == neg.tolist() == [[512, 512, 4, 8, 768, 1024]]
    pos, neg = family_for(config.SDXL_REFINER).time_ids(r.replace(aesthetic_score=7.0), "cpu")
    assert pos.tolist() == [[512, 512, 4, 8, 7.0]] and neg.tolist() == [[512, 512, 4, 8, 2.5]]


def test_cheap_preview_colours_follow_the_family():
    latents = torch.zeros(1, 4, 2, 2)
    latents[:, 1] = 1.0
    sd = approximate_images(latents, 8, coefs=family_for(config.SD15).latent.preview_rgb)[0]
    xl = approximate_images(latents, 8, coefs=family_for(config.SDXL_BASE).latent.preview_rgb)[0]
    assert sd.size == xl.size == (16, 16)
    assert sd.getpixel((8, 8)) == tuple(round((c / 2 + 0.5) * 255) for c in CHEAP_RGB[1])
    assert xl.getpixel((8, 8)) == tuple(round((c / 2 + 0.5) * 255) for c in CHEAP_RGB_SDXL[1])


def test_the_loop_does_not_test_which_family_it_runs():
    """No module of sdlite.pipeline asks a spec whether it is SDXL or the x4 upscaler, compares a family name, or
    checks a family's class: it asks the family object."""
    found = []
    for path in sorted((Path(__file__).resolve().parent.parent / "sdlite" / "pipeline").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("is_sdxl", "is_x4_upscaler"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Name) and node.id.endswith("Family") and node.id != "Family":
                found.append(f"{path.name}:{node.lineno} {node.id}")
            if isinstance(node, ast.Compare) and any(isinstance(v, ast.Attribute) and v.attr == "family"
                                                     for v in [node.left, *node.comparators]):
                found.append(f"{path.name}:{node.lineno} a comparison of .family")
    assert found == []
