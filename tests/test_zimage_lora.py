"""Z-Image LoRAs in the layouts they are published in, against diffusers' ``load_lora_weights`` + ``fuse_lora`` on the
tiny random ZImagePipeline of tests/test_zimage_pipeline.py. Every linear layer of the transformer is targeted (the
blocks' attention, feed-forward and modulation, the refiners, the embedders, the output layer), q, k and v of one
attention sharing their down factor so that ComfyUI's stacked ``attention.qkv`` holds them:

* diffusers / PEFT ``transformer.*`` with the alpha in ``lora_adapter_metadata``: the reference itself;
* diffusers' names under ComfyUI's and ai-toolkit's ``diffusion_model.`` with ``.alpha`` keys;
* ComfyUI's names (the original code's: ``attention.qkv`` with q, k and v stacked, ``attention.out``, ``x_embedder``,
  ``final_layer``) under ``diffusion_model.``, as ``lora_down`` / ``lora_up`` and as ``lora_A`` / ``lora_B``;
* kohya's ``lora_unet_`` over diffusers' names,

all made of the same factors, so all give diffusers' image; and the layouts diffusers converts itself (its
``_convert_non_diffusers_z_image_lora_to_diffusers``: ``diffusion_model.``, ``lora_unet_`` over either name set, the
stacked qkv split) against diffusers' own reading of the same file. Memory mode 0 applies them as the blocks stream.
LoRA layers of the Qwen3 text encoder are refused (diffusers' Z-Image loader takes the transformer's alone)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine
from sdlite.weights.zimage_keys import zimage_to_comfy
from tests.reference import (LORA_RANK, factors_on, fused_lora_images, lora_and_base, lora_factors, lora_files,
                             lora_request, under, underscored, write_lora)
from tests.test_zimage_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, WEIGHT = LORA_RANK, 0.8
SIZE = 64
SHARES = {"to_k": "to_q", "to_v": "to_q"}   # q, k and v of an attention share their down factor


def _comfy(factors: dict) -> dict:
    """The same factors on ComfyUI's names: each attention's q, k and v as one ``attention.qkv`` (their ups
    stacked)."""
    out = factors_on(zimage_to_comfy, factors)
    assert "layers.0.attention.qkv" in out and "x_embedder" in out and "final_layer.linear" in out
    return out


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zimage_lora")
    pipe = _pipeline(tmp / "z-image")
    factors = lora_factors(pipe.transformer.named_modules(), 11, SHARES)
    comfy = _comfy(factors)
    files = {
        **lora_files(tmp, factors),
        "comfy": write_lora(tmp / "comfy.safetensors", under("diffusion_model.", comfy), parts="lora_down"),
        "comfy-lora_A": write_lora(tmp / "comfy_a.safetensors", under("diffusion_model.", comfy)),
    }
    # kohya's lora_unet_ over ComfyUI's names (stacked qkv), as diffusers' converter reads them: the blocks, the
    # refiners and the embedders it knows by those names (it has no name for x_embedder or final_layer)
    blocks = {n: f for n, f in _comfy(lora_factors(pipe.transformer.named_modules(), 12, SHARES)).items()
              if not n.startswith(("x_embedder", "final_layer"))}
    files["kohya-comfy"] = write_lora(tmp / "kohya_comfy.safetensors", underscored(blocks), parts="lora_down")
    return pipe, Engine.load(tmp / "z-image", precision="exact"), files, tmp


def _diffusers(pipe, path=None) -> np.ndarray:
    """ZImagePipeline's batch of 2 (3 steps, no guidance), with the LoRA at ``path`` loaded and fused at WEIGHT."""
    return fused_lora_images(pipe, PROMPT, SIZE, path, WEIGHT, guidance_scale=0.0)


@pytest.fixture(scope="module")
def expected(zimage):
    pipe, _, files, _ = zimage
    return lora_and_base(pipe, PROMPT, SIZE, files["peft"], WEIGHT, least=8, guidance_scale=0.0)


def _request(**kw):
    return lora_request(PROMPT, SIZE, **kw)


@pytest.mark.parametrize("layout", ["peft", "diffusion_model", "comfy", "comfy-lora_A", "kohya"])
def test_each_layout_gives_diffusers_image(zimage, expected, layout):
    _, engine, files, _ = zimage
    with_lora, base = expected
    lora = L.read_lora(files[layout])
    assert lora.format == {"peft": "peft", "kohya": "kohya"}.get(layout, "comfy")
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - with_lora).max() <= MAX_PIXEL_DIFF
    assert np.abs(_pixels(engine.generate(_request()).images) - base).max() <= MAX_PIXEL_DIFF, "restored exactly"


@pytest.mark.parametrize("layout", ["diffusion_model", "kohya", "kohya-comfy"])
def test_layouts_diffusers_converts_match_its_reading(zimage, layout):
    """The files diffusers' Z-Image loader converts itself (``diffusion_model.``, ``.alpha`` folded into the
    factors; kohya's names; the stacked qkv of ``lora_unet_layers_N_attention_qkv`` split in three)."""
    pipe, engine, files, _ = zimage
    want = _diffusers(pipe, files[layout])
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - want).max() <= MAX_PIXEL_DIFF


def test_prompt_tag_and_low_memory_mode(zimage, expected):
    """``<lora:comfy:0.8>`` in the prompt finds the file in the LoRA folder; memory mode 0 merges the LoRA into each
    block's weights as they stream, to the same image."""
    _, engine, files, tmp = zimage
    tagged = engine.generate(_request(prompt=f"{PROMPT} <lora:comfy:{WEIGHT}>", lora_dir=str(tmp)))
    assert np.abs(_pixels(tagged.images) - expected[0]).max() <= MAX_PIXEL_DIFF
    assert tagged.infotext["Lora hashes"].startswith("comfy: ")
    low = Engine.load(tmp / "z-image", precision="exact", memory_mode=0)
    r = _request(loras=((files["comfy"], WEIGHT),))
    assert np.array_equal(_pixels(low.generate(r).images), _pixels(tagged.images))


def test_refusals_name_the_key(zimage, tmp_path):
    """Text-encoder layers (PEFT's and kohya's names), a FLUX LoRA, a UNet's, a stacked qkv of the wrong size:
    each refused naming a key, the model left as it was."""
    _, engine, files, _ = zimage
    down, up = torch.zeros(RANK, 32), torch.zeros(32, RANK)
    cases = {
        "te_peft.safetensors": ({"text_encoder.layers.0.self_attn.q_proj": (down, up)}, "lora_A",
                                r"text encoder \(e\.g\. 'text_encoder\.layers\.0\.self_attn\.q_proj\.lora_A\.weight'\)"
                                r".*Z-Image-Turbo.*Qwen3"),
        "te_kohya.safetensors": ({"lora_te_layers_0_mlp_up_proj": (down, torch.zeros(48, RANK)),
                                  "lora_unet_layers_0_attention_to_q": (torch.zeros(RANK, 64), torch.zeros(64, RANK))},
                                 "lora_down", r"1 layers of a text encoder \(e\.g\. 'lora_te_layers_0_mlp_up_proj"),
        "flux.safetensors": ({"transformer.transformer_blocks.0.attn.to_q": (torch.zeros(RANK, 64),
                                                                             torch.zeros(64, RANK))}, "lora_A",
                             r"1 of its 1 transformer layers match no layer.*transformer_blocks\.0\.attn\.to_q"),
        "unet.safetensors": ({"unet.down_blocks.0.attentions.0.proj_in": (down, up)}, "lora_A",
                             r"layers of UNet blocks.*Z-Image-Turbo, whose denoiser is a transformer"),
        "qkv.safetensors": ({"diffusion_model.layers.0.attention.qkv": (torch.zeros(RANK, 64),
                                                                        torch.zeros(3 * 64 + 1, RANK))},
                            "lora_down", r"'diffusion_model\.layers\.0\.attention\.qkv\.lora_down\.weight' does not "
                                         r"fit 'layers\.0\.attention\.to_q' \+ .*193 outputs, the layers have "
                                         r"64 \+ 64 \+ 64"),
    }
    before = _pixels(engine.generate(_request(steps=1, batch_size=1)).images)
    for name, (layers, parts, message) in cases.items():
        path = write_lora(tmp_path / name, layers, parts=parts)
        with pytest.raises(L.LoraError, match=message):
            engine.generate(_request(steps=1, batch_size=1, loras=((path, 1.0),)))
    assert np.array_equal(_pixels(engine.generate(_request(steps=1, batch_size=1)).images), before)


def test_default_precision_int8_layers_take_the_lora(zimage):
    """Under ``auto``, where the CPU computes in bf16 and int8, the transformer's Linears are W8A8 layers with
    per-token activations: a LoRA's layer is then the file's weight plus the update, quantized again, and computes
    bit for bit what the layer of the bf16 transformer with the LoRA merged, then quantized, computes. On leaving,
    the original layers are back and the image is the one before. Where auto chose no int8 (a CPU without native
    bf16 and VNNI), its plan says so."""
    from sdlite.engine.quant import Int8Linear, quantize_model
    from sdlite.loader import open_model

    _, _, files, tmp = zimage
    engine = Engine.load(tmp / "z-image")
    if engine.precision.quantize != "bf16-int8":
        assert engine.precision.requested == "auto" and engine.precision.name != "bf16-int8", engine.precision
        assert engine.precision.reason, "auto says why it chose no int8"
        return
    transformer = engine.models.get("transformer")
    chosen = {n: m for n, m in transformer.named_modules() if isinstance(m, Int8Linear)}
    assert any(".attention.to_q" in n for n in chosen) and all(m.per_token for m in chosen.values())
    reference = open_model(tmp / "z-image").load("transformer", torch.bfloat16)
    L.merge(reference, [(files["peft"], WEIGHT)], "transformer", keep_originals=False)
    reference = quantize_model(reference, "bf16-int8")
    before = _pixels(engine.generate(_request(steps=1, batch_size=1)).images)
    g = torch.Generator().manual_seed(3)
    with L.engine_with_loras(engine, [(files["peft"], WEIGHT)]):
        merged = engine.models.get("transformer")
        for name, original in chosen.items():
            layer, want = merged.get_submodule(name), reference.get_submodule(name)
            assert layer is not original and isinstance(layer, Int8Linear) and layer.per_token, name
            probe = torch.randn(2, 5, original.in_features, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(layer(probe), want(probe)), name
    assert all(transformer.get_submodule(n) is m for n, m in chosen.items()), "the original layers are back"
    assert np.array_equal(_pixels(engine.generate(_request(steps=1, batch_size=1)).images), before)
