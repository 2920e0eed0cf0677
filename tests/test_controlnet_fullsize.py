"""ControlNet at the real SD 1.5 shapes (361M parameters), as files of headers only: diffusers' ControlNetModel made
from SD 1.5's UNet on the meta device and written in both layouts -- a diffusers folder and lllyasviel's single file
(fp16, under ``control_model.``, as the control_v11p_sd15_* releases are) -- with data sections that are holes in
the files (tests.test_sdxl_single_file.sparse_safetensors). sdlite opens them as it opens the released files: the
architecture read from the shapes (the 4-width, 8x hint encoder included), every tensor found under diffusers' name
with diffusers' shape, the same network from both layouts.

Generation at these shapes against diffusers' pipelines is bench/parity.py's; the tiny models of
tests/test_controlnet.py run the same cases through the same functions."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import SD15, ControlNetConfig
from sdlite.weights.controlnet import check_compatible, open_controlnet
from sdlite.weights.unet_keys import controlnet_to_original, unet_structure_from_keys
from tests.reference import diffusers_unet
from tests.test_sdxl_single_file import sparse_safetensors

PARAMETERS = 361_279_120   # the 361M of lllyasviel's SD 1.5 ControlNets (control_v11p_sd15_*)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """diffusers' ControlNetModel (meta device) and the two files written from it, by layout."""
    from diffusers import ControlNetModel

    tmp = tmp_path_factory.mktemp("sd15cn")
    with torch.device("meta"):
        cn = ControlNetModel.from_unet(diffusers_unet(SD15.unet))
    state = cn.state_dict()
    cn.save_config(tmp / "cn-folder")
    sparse_safetensors(tmp / "cn-folder" / "diffusion_pytorch_model.safetensors", state)
    keys = list(state)
    plan = controlnet_to_original(keys, unet_structure_from_keys(keys, "diffusers", prefix=""), 8)
    sparse_safetensors(tmp / "control_v11p_sd15_random.safetensors",
                       {k: state[e.sources[0]].half() for k, e in plan.entries.items()})
    return cn, {"diffusers": tmp / "cn-folder", "original": tmp / "control_v11p_sd15_random.safetensors"}


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_both_layouts_open_as_diffusers_network(layouts, layout):
    """Each layout opens as the network diffusers builds (its config, every key and shape, 361,279,120
    parameters), an SD 1.5 ControlNet the SD 1.5 UNet takes; the single file's tensors are fp16 as stored."""
    cn, paths = layouts
    reference = {k: tuple(v.shape) for k, v in cn.state_dict().items()}
    assert sum(v.numel() for v in cn.state_dict().values()) == PARAMETERS
    opened = open_controlnet(paths[layout], SD15.unet)
    try:
        assert opened.layout == layout
        assert opened.config == ControlNetConfig.from_diffusers(dict(cn.config))
        assert opened.config.hint_downscale == 8
        check_compatible(opened.config, SD15.unet, opened.name, "sd1")
        network = opened.build_empty()    # every tensor of the architecture found, with its shape
        assert {k: tuple(v.shape) for k, v in network.state_dict().items()} == reference
        dtypes = {opened.sources["controlnet"].view[k].dtype for k in ("controlnet_mid_block.weight",
                                                                       "controlnet_cond_embedding.conv_in.weight")}
        assert dtypes == {torch.float16 if layout == "original" else torch.float32}
    finally:
        opened.close()
