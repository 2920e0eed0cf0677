"""Memory modes give the same image as mode 1, and mode 0 really frees what it loads."""
from __future__ import annotations

import dataclasses
import gc

import numpy as np
import psutil
import pytest
import torch

from sdlite.config import TextEncoderConfig
from sdlite.engine.memory import MEMORY_MODES, ModelManager, check_memory_mode, stream_units
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from tests.reference import diffusers_pipeline

REQUEST = Request(prompt="a red circle on a blue background", negative_prompt="green", steps=4, seed=11,
                  width=64, height=64, sampler="euler_a")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem")
    diffusers_pipeline("sd1", tmp).save_pretrained(tmp / "model")
    return tmp / "model"


def _pixels(result):
    return np.stack([np.asarray(im) for im in result.images]).astype(int)


def test_every_mode_gives_the_mode_1_image(model_dir):
    """Bit for bit where the same kernels run; mode 0 streams the UNet's plain weights while modes 1 and 2
    prepack them for oneDNN (engine.packing), so against prepacked mode 1 it agrees to fp32 rounding."""
    reference = Engine.load(model_dir, memory_mode=1, precision="exact").generate(REQUEST)
    plain_reference = Engine.load(model_dir, memory_mode=1, prepack=False, precision="exact").generate(REQUEST)
    for mode in (0, 2):
        engine = Engine.load(model_dir, memory_mode=mode, precision="exact")
        got = engine.generate(REQUEST)
        if mode == 2:
            assert torch.equal(got.latents, reference.latents), f"memory mode {mode}"
            assert np.array_equal(_pixels(got), _pixels(reference))
        else:
            assert torch.allclose(got.latents, reference.latents, rtol=1e-4, atol=1e-4), f"memory mode {mode}"
            assert np.abs(_pixels(got) - _pixels(reference)).max() <= 1
        # what stays resident after a generation is what the mode promises
        assert engine.models.resident() == (["unet"] if mode in (0, 2) else ["text_encoder", "unet", "vae"])
        plain = Engine.load(model_dir, memory_mode=mode, prepack=False, precision="exact").generate(REQUEST)
        assert torch.equal(plain.latents, plain_reference.latents), f"memory mode {mode}, plain weights"
        assert np.array_equal(_pixels(plain), _pixels(plain_reference))


def test_fp16_weights_computed_in_fp32(model_dir, tmp_path):
    """Weights kept in fp16, up-cast block by block: the same image as fp32 weights rounded to fp16."""
    engine = Engine.load(model_dir, weight_dtype=torch.float16, precision="exact")
    unet = engine.models.get("unet")
    assert unet.conv_in.weight.device.type == "meta"  # nothing resident in fp32 between calls
    got = engine.generate(REQUEST)
    # reference: the same model with its weights rounded to fp16 and loaded in fp32
    from sdlite.export import save_diffusers
    from sdlite.loader import load_model

    save_diffusers(load_model(model_dir), tmp_path / "half", dtype=torch.float16)
    expected = Engine.load(tmp_path / "half", prepack=False, precision="exact").generate(REQUEST)  # the same (plain) kernels
    assert torch.allclose(got.latents, expected.latents, rtol=0, atol=1e-5)


def test_streaming_units_cover_every_weight(model_dir):
    ckpt = open_model(model_dir)
    unet = ckpt.build_empty("unet")
    units = stream_units(unet)
    names = [n for n, _ in units]
    assert "conv_in" in names and "down_blocks.0.resnets.0" in names
    # a spatial transformer streams one transformer block at a time, its norm and projections on their own
    assert {"mid_block.attentions.0.norm", "mid_block.attentions.0.proj_in",
            "mid_block.attentions.0.transformer_blocks.0", "mid_block.attentions.0.proj_out"} <= set(names)
    owned = sum(sum(p.numel() for p in u.parameters()) for _, u in units)
    assert owned == sum(p.numel() for p in unet.parameters())


def test_bad_memory_mode():
    with pytest.raises(ValueError, match=r"memory mode 5 is not valid: 0 = low.*1 = all resident.*2 = balanced"):
        check_memory_mode(5)
    assert set(MEMORY_MODES) == {0, 1, 2}


MEASURE = r"""
import gc, json, sys, psutil, torch
from sdlite.engine.memory import ModelManager
from sdlite.loader import open_model

def rss():
    gc.collect()
    return psutil.Process().memory_info().rss

manager = ModelManager(open_model(sys.argv[1]), mode=0)
# a first use pays one-time costs (library code pages, thread pools and their arenas); measure the second
for _ in range(2):
    before = rss()
    with manager.use("text_encoder") as enc:
        during = rss()
        dtype = str(enc.text_model.final_layer_norm.weight.dtype)
    after = rss()
print(json.dumps({"before": before, "during": during, "after": after, "dtype": dtype,
                  "resident": manager.resident()}))
"""


def test_mode_0_frees_each_sub_model(tmp_path):
    """A ~300 MB (fp32) text encoder: resident while used, handed back after. RSS is measured in a fresh
    process, before, during and after the sub-model's (second) use."""
    import json
    import subprocess
    import sys

    from sdlite.config import SD15
    from sdlite.export import save_diffusers
    from sdlite.loader import StableDiffusion
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer
    from tests.reference import TINY_UNET_SD1, TINY_VAE

    text = TextEncoderConfig(width=512, layers=16, heads=8, mlp_width=2048)  # ~76M params = ~300 MB fp32
    spec = SD15.replace(text=text, unet=dataclasses.replace(TINY_UNET_SD1, context_dim=512), vae=TINY_VAE)
    with torch.no_grad():
        model = StableDiffusion(spec=spec, tokenizer=CLIPTokenizer.from_package(),
                                text_encoder=CLIPTextEncoder(spec.text), unet=UNet(spec.unet),
                                vae=AutoencoderKL(spec.vae), scheduler_config=dict(spec.scheduler))
    save_diffusers(model, tmp_path / "big_text", dtype=torch.float16)
    size = sum(p.numel() for p in model.text_encoder.parameters()) * 4
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "big_text")], capture_output=True,
                         text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["dtype"] == "torch.float32" and m["resident"] == []
    assert m["during"] - m["before"] > 0.8 * size, m
    assert m["after"] - m["before"] < 0.1 * size, m


def test_int8_and_tiled_decode_through_the_engine(model_dir):
    """--quantize int8 stays close to fp32 on the tiny model; a tiled decode gives the untiled image."""
    reference = Engine.load(model_dir, precision="exact").generate(REQUEST)
    int8 = Engine.load(model_dir, precision="int8")
    got = int8.generate(REQUEST)
    cos = torch.nn.functional.cosine_similarity(got.latents.flatten(), reference.latents.flatten(), dim=0)
    assert cos > 0.99
    assert any(type(m).__name__ == "Int8Conv2d" for m in int8.models.get("unet").modules())
    tiled = Engine.load(model_dir, vae_tile=8, precision="exact")  # 64 px images: 32x32 latents here (2x VAE), 4 tiles of 8
    assert np.abs(_pixels(tiled.generate(REQUEST)) - _pixels(reference)).max() <= 1


def test_mode_0_decodes_in_tiles(model_dir, monkeypatch):
    """Low memory: from 256 px up the VAE decodes in 256 px tiles, which give the untiled image."""
    import sdlite.families.loaded as pipeline

    tiles = []
    real = pipeline.tiled_decode
    monkeypatch.setattr(pipeline, "tiled_decode", lambda vae, z, tile: tiles.append(tile) or real(vae, z, tile))
    torch.manual_seed(0)
    z = torch.randn(1, 4, 48, 40)
    low = Engine.load(model_dir, memory_mode=0, precision="exact").decode_latents(z)
    assert tiles == [pipeline.LOW_MEMORY_TILE]
    full = Engine.load(model_dir, memory_mode=1, precision="exact").decode_latents(z)  # 384 px: untiled in mode 1
    assert tiles == [pipeline.LOW_MEMORY_TILE]
    assert (low - full).abs().max().item() < 1e-4


def test_automatic_tiles_by_mode_and_dtype(model_dir):
    """Above 768 px the decoder works in 512 px tiles, but memory mode 1 (all resident, fastest) with a bf16 decoder
    on a CPU decodes whole up to 1024 px (3.5x faster there, about 1.3 GB more at 1024^2); the latent sides in latent
    pixels."""
    import sdlite.families.loaded as loaded

    exact1, bf16_1, bf16_2 = (Engine.load(model_dir, memory_mode=mode, precision="exact") for mode in (1, 1, 2))
    for engine in (bf16_1, bf16_2):   # a bf16 decoder as the bf16 precisions load it (not every CPU runs them)
        engine.models.vae_dtype = torch.bfloat16
    for side, exact, fast, balanced in ((96, 0, 0, 0), (97, 64, 0, 64), (128, 64, 0, 64), (129, 64, 64, 64)):
        assert exact1.decode_tile(side, 64) == exact and bf16_1.decode_tile(64, side) == fast \
            and bf16_2.decode_tile(side, side) == balanced, side
    assert loaded.FAST_BF16_TILE_ABOVE == 128 and loaded.AUTO_TILE == 64


def test_tiled_decode_with_streamed_weights(model_dir):
    """fp16 weights stream block by block; tiled decoding calls the VAE's layers one by one, so it gets a whole
    copy for the duration: the same image as the untiled, streamed decode."""
    torch.manual_seed(2)
    z = torch.randn(1, 4, 40, 48)
    tiled = Engine.load(model_dir, weight_dtype=torch.float16, vae_tile=16, precision="exact").decode_latents(z)
    plain = Engine.load(model_dir, weight_dtype=torch.float16, vae_tile=0, precision="exact").decode_latents(z)
    assert tiled.shape == plain.shape and tiled.shape[-1] > z.shape[-1]
    assert (tiled - plain).abs().max().item() < 1e-3


@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
def test_mode_1_holds_the_text_encoder_in_its_compute_dtype(model_dir, tmp_path, stored):
    """Mode 1 converts a half-precision file's text encoder weights to fp32 once, at load, and keeps them: a warm
    engine up-casts nothing per prompt (holding them as stored, up-cast block by block, cost 0.04 s a prompt on the
    full-size SD 1.5 for 250 MB less). The same encodings as the fp32-converted network, from either file."""
    from sdlite.export import save_diffusers
    from sdlite.loader import load_model

    folder = tmp_path / "copy"
    save_diffusers(load_model(model_dir), folder, dtype=stored)
    ckpt = open_model(folder)
    ids = ckpt.tokenizer()(["a red circle on a blue background", "blurry"])
    with torch.no_grad():
        expected = ckpt.load("text_encoder", torch.float32)(ids)
        manager = ModelManager(ckpt, mode=1)
        with manager.use("text_encoder") as text:
            got = text(ids)
            streamed = hasattr(text, "_streamer")
            dtypes = {p.dtype for p in text.parameters()}
        assert torch.equal(got, expected)
    assert not streamed and dtypes == {torch.float32}
    assert manager.resident() == ["text_encoder"]


def test_a_streamed_embedding_table_reads_only_its_rows():
    """Streamed (memory mode 0), an embedding table alone (an LLM's, 152064 rows) is made of the rows its ids read,
    each once (a GGUF block format's rows dequantised alone): the same vectors as the whole table's."""
    from torch import nn

    from sdlite.engine.memory import WeightStreamer
    from sdlite.weights.quants import quantize_int8_rows

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(100, 32), nn.Linear(32, 8)

        def forward(self, ids):
            return self.lin(self.emb(ids))

    torch.manual_seed(0)
    ref = Net().eval()
    ids = torch.tensor([[5, 7, 5, 99], [0, 7, 3, 3]])
    for quantized in (False, True):
        table = ref.emb.weight.detach()
        stored = quantize_int8_rows(table) if quantized else table
        net = Net()
        WeightStreamer(net, {"emb.weight": stored, "lin.weight": ref.lin.weight.detach(),
                             "lin.bias": ref.lin.bias.detach()}.__getitem__, torch.float32, "cpu")
        seen = []
        net.emb.register_forward_hook(lambda m, a, out: seen.append(m.weight.shape[0]), prepend=True)
        dense = stored.dequantize(torch.float32) if quantized else table
        with torch.no_grad():
            assert torch.equal(net(ids), ref.lin(nn.functional.embedding(ids, dense)))
        assert seen == [5]   # ids 0, 3, 5, 7, 99
