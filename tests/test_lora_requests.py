"""LoRAs on a long-lived engine's quantized and kept layers (sdlite.adapters.lora): int8 layers quantized again from
the file's weights for each request, and memory mode 1's merged layers kept for the next request with the same LoRAs.
The tiny model, its files and helpers are tests/test_lora.py's."""
from __future__ import annotations

import pytest
import torch

from sdlite.adapters import lora as L
from sdlite.loader import open_model
from sdlite.pipeline import Engine
from tests.test_lora import (  # noqa: F401  (tiny and tiny_lora are that module's fixtures, used here)
    TEXT, _generate, random_factors, targets, tiny, tiny_lora, unet_inputs, write_kohya,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("precision", ["int8", "bf16-int8", "int8-bf16"])
def test_int8_layers_take_loras_quantized_again(tiny, tmp_path, precision):
    """An int8 precision's layers keep only their codes: a LoRA's layer is the file's weight (held in the model's
    dtype) plus the update, quantized again for the request. Each touched layer then computes, bit for bit, what the
    layer of the float model with the LoRA merged, then quantized, computes; a GEGLU's split projection included
    (int8-bf16's bf16 convolutions merge as bf16 weights do: to bf16 rounding). On leaving, the original layer
    objects are back and the UNet's output is the one before. Without the stored weights, merge() says it needs
    them."""
    from sdlite.engine.precision import PrecisionError
    from sdlite.engine.quant import BF16Conv2d, Int8Conv2d, Int8Linear, quantize_model

    _, folder, _, _, us, ts = tiny
    try:
        engine = Engine.load(folder, prepack=False, precision=precision)
    except PrecisionError:
        assert precision != "int8"   # a CPU without native bf16 (and VNNI): tests/test_precision.py checks why
        return
    unet = engine.models.get("unet")
    touched = targets(us, ("attn1.to_q", "ff.net.0.proj", "conv1", "conv2"))
    convs = {n: unet.get_submodule(n) for n in touched if isinstance(unet.get_submodule(n), BF16Conv2d)}
    convs = {n: (layer, layer.weight) for n, layer in convs.items()}
    chosen = {n: shape for n, shape in touched.items() if isinstance(unet.get_submodule(n), (Int8Conv2d, Int8Linear))}
    assert any(n.endswith("ff.net.0.proj") for n in chosen)
    assert any(len(s) == 4 for s in chosen.values()) or (precision == "int8-bf16" and convs)
    f = write_kohya(tmp_path / "q.safetensors", random_factors(touched, 4, 1),
                    te=random_factors(targets(ts, TEXT), 4, 2), dtype=torch.float16)
    originals = {n: unet.get_submodule(n) for n in chosen}
    x, t, ctx = unet_inputs(unet.config)
    dtype = next(unet.parameters()).dtype
    x, ctx = x.to(dtype), ctx.to(dtype)
    with torch.no_grad():
        plain = unet(x, t, ctx)
    ckpt = open_model(folder)
    if precision != "bf16-int8":
        reference = ckpt.load("unet")
        L.merge(reference, [(f, 1.0)], "unet", keep_originals=False)
        reference = quantize_model(reference, precision)
    else:
        reference = ckpt.load("unet", torch.bfloat16)
        L.merge(reference, [(f, 1.0)], "unet", keep_originals=False)
        reference = quantize_model(reference, "bf16-int8")
    g = torch.Generator().manual_seed(5)
    with L.engine_with_loras(engine, [(f, 1.0)]):
        merged = engine.models.get("unet")
        for name, shape in chosen.items():
            layer, want = merged.get_submodule(name), reference.get_submodule(name)
            assert layer is not originals[name] and type(layer) is type(originals[name]), name
            probe = torch.randn((2, 3, shape[1]) if len(shape) == 2 else (1, shape[1], 6, 6), generator=g).to(dtype)
            with torch.no_grad():
                assert torch.equal(layer(probe), want(probe)), name
        for name, (layer, weight) in convs.items():   # merged into its bf16 weight: one bf16 step apart at most
            got, want = layer.weight.float(), reference.get_submodule(name).weight.float()   # (rounded twice)
            assert layer.weight is not weight and (got - want).abs().max() <= 2 ** -7 * want.abs().max(), name
        with torch.no_grad():
            assert (merged(x, t, ctx).float() - plain.float()).abs().max() > 1e-2   # the LoRA reached the output
    assert all(unet.get_submodule(n) is layer for n, layer in originals.items())
    assert all(layer.weight is weight for layer, weight in convs.values())
    with torch.no_grad():
        assert torch.equal(unet(x, t, ctx), plain)
    with pytest.raises(L.LoraError, match=r"q\.safetensors: .* is quantized \(Int8(Linear|Conv2d)\) .*stored weights"):
        L.merge(unet, [(f, 1.0)], "unet")


def test_mode_1_keeps_the_last_merge_for_the_same_loras(tiny, tiny_lora, tmp_path, monkeypatch):
    """Memory mode 1 keeps the last request's merged layers (restored after it): the same files at the same weights
    are swapped in again without reading or merging anything, for the same latents bit for bit; another weight, or
    a file changed on disk, is merged afresh (what a new engine gives); memory mode 2 keeps nothing."""
    import os
    import shutil

    engine = Engine.load(tiny[1], prepack=False, precision="exact")
    fresh = Engine.load(tiny[1], prepack=False, precision="exact")
    base = _generate(engine)
    first = _generate(engine, tiny_lora)
    kept = engine.models.kept_loras
    assert kept is not None and not any(h.active for h in kept.handles)
    calls = []
    plan, read = L._plan, L.read_lora
    monkeypatch.setattr(L, "_plan", lambda *a, **k: calls.append("plan") or plan(*a, **k))
    monkeypatch.setattr(L, "read_lora", lambda *a, **k: calls.append("read") or read(*a, **k))
    assert torch.equal(_generate(engine, tiny_lora), first) and calls == []
    assert torch.equal(_generate(engine), base)
    other = [(tiny_lora[0][0], 1.0), *tiny_lora[1:]]
    got = _generate(engine, other)
    assert "plan" in calls and engine.models.kept_loras is not kept
    assert torch.equal(got, _generate(fresh, other)) and not torch.equal(got, first)
    changing = tmp_path / "changing.safetensors"
    shutil.copy(tiny_lora[0][0], changing)
    assert torch.equal(_generate(engine, [(changing, 1.0)]), _generate(fresh, [(tiny_lora[0][0], 1.0)]))
    when = changing.stat().st_mtime_ns
    shutil.copy(tiny_lora[1][0], changing)
    os.utime(changing, ns=(when + 10**9, when + 10**9))
    calls.clear()
    assert torch.equal(_generate(engine, [(changing, 1.0)]), _generate(fresh, [(tiny_lora[1][0], 1.0)]))
    assert "read" in calls
    assert torch.equal(_generate(engine), base)
    low = Engine.load(tiny[1], memory_mode=2, prepack=False, precision="exact")
    _generate(low, tiny_lora)
    assert low.models.kept_loras is None
