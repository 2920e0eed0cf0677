"""SD 1.x single files as GGUF (stable-diffusion.cpp's layout: the original checkpoint names, 2-D weights in ggml
block formats): opened by the same reader as FLUX's, detected like any single file, the quantised tensors
dequantised as they load; the image equals that of a safetensors file holding the values the GGUF holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdlite.export import save_single_file
from sdlite.loader import load_model, open_model
from sdlite.pipeline import Engine, Request
from tests.reference import diffusers_pipeline, saved_pipeline, with_contrast

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_gguf(path, tensors: dict) -> dict:
    """Each 2-D weight whose rows are whole 32-value blocks in Q8_0 (Q5_1 for every third, Q4_0 for every
    fifth), the rest F32, written with gguf.GGUFWriter; returns the values the file holds."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="sd1")
    stored, quantized = {}, 0
    for i, (name, t) in enumerate(sorted(tensors.items())):
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[1] % 32 == 0 and "embedding" not in name:
            qtype = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_1,
                     gguf.GGMLQuantizationType.Q4_0][0 if i % 3 else 1 if i % 5 else 2]
            raw = gguf.quants.quantize(a, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            stored[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))).reshape(a.shape)
            quantized += 1
        else:
            writer.add_tensor(name, a)
            stored[name] = t.float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert quantized > 20
    return stored


def test_sd1_gguf_loads_as_its_values(tmp_path):
    saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp_path, conventional=True)), tmp_path / "folder")
    save_single_file(load_model(tmp_path / "folder"), tmp_path / "model.safetensors")
    tensors = load_file(tmp_path / "model.safetensors")
    stored = _write_gguf(tmp_path / "model.gguf", tensors)
    save_file({k: v.contiguous() for k, v in stored.items()}, tmp_path / "dense.safetensors")
    ckpt = open_model(tmp_path / "model.gguf")
    assert ckpt.spec.family == "sd1" and ckpt.layout == "original"
    r = Request(prompt="a red circle", steps=3, seed=2, width=64, height=64, sampler="euler")
    got = np.asarray(Engine.load(tmp_path / "model.gguf", precision="exact").generate(r).images[0], np.int16)
    want = np.asarray(Engine.load(tmp_path / "dense.safetensors", precision="exact").generate(r).images[0], np.int16)
    assert np.array_equal(got, want)
    original = np.asarray(Engine.load(tmp_path / "model.safetensors", precision="exact").generate(r).images[0],
                          np.int16)
    assert 0 < np.abs(original - got).max()   # the quantised values are not the file's


def test_sd1_gguf_takes_a_lora_on_int8_layers(tmp_path):
    """At an int8 precision a LoRA's layers are quantized again from the file's weights: from a GGUF's block formats,
    dequantised as they are read, the image is the one of a safetensors file holding the values the GGUF holds."""
    from sdlite.engine.quant import Int8Conv2d, Int8Linear

    saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp_path, conventional=True)), tmp_path / "folder")
    save_single_file(load_model(tmp_path / "folder"), tmp_path / "model.safetensors")
    stored = _write_gguf(tmp_path / "model.gguf", load_file(tmp_path / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in stored.items()}, tmp_path / "dense.safetensors")
    engines = {name: Engine.load(tmp_path / name, precision="int8", prepack=False)
               for name in ("model.gguf", "dense.safetensors")}
    unet = engines["model.gguf"].models.get("unet")
    int8 = {n: m for n, m in unet.named_modules() if isinstance(m, (Int8Conv2d, Int8Linear))}
    chosen = [next(n for n in int8 if n.endswith("attn1.to_q")), next(n for n in int8 if n.endswith("conv1"))]
    g = torch.Generator().manual_seed(4)
    lora = {}
    for name in chosen:
        layer = int8[name]
        out, rest = (layer.out_features, (layer.in_features,)) if isinstance(layer, Int8Linear) else \
            (layer.out_channels, (layer.in_channels, *layer.kernel_size))
        key = "lora_unet_" + name.replace(".", "_")
        lora[f"{key}.lora_down.weight"] = torch.randn((4, *rest), generator=g) * 0.3
        lora[f"{key}.lora_up.weight"] = torch.randn((out, 4, *([1, 1] if len(rest) == 3 else [])), generator=g) * 0.3
    save_file(lora, tmp_path / "lora.safetensors")
    r = Request(prompt="a red circle", steps=3, seed=2, width=64, height=64, sampler="euler",
                loras=((str(tmp_path / "lora.safetensors"), 1.0),))
    got, want = (np.asarray(e.generate(r).images[0], np.int16) for e in engines.values())
    assert np.array_equal(got, want)
    plain = np.asarray(engines["model.gguf"].generate(r.replace(loras=())).images[0], np.int16)
    assert np.abs(plain - got).max() > 0   # the LoRA reached the image
    assert all(unet.get_submodule(n) is m for n, m in int8.items())
