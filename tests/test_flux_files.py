"""FLUX.1 in the files people have, against diffusers' FluxPipeline on the same tiny random weights: BFL's
transformer-only file with ``ae.safetensors``, ComfyUI's ``clip_l.safetensors`` and a T5 file given or found beside it,
ComfyUI's all-in-one checkpoint, a T5 stored in fp8, and the errors for what is missing or wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.config import TextEncoderConfig
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.weights.flux_keys import flux_to_original
from sdlite.weights.vae_keys import vae_to_original
from tests.test_flux_pipeline import MAX_PIXEL_DIFF, PROMPT, SIZE, _pipeline, _pixels, _reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# what the shapes of a file must show as the releases have it: CLIP heads 64 wide, transformer heads 128 wide (their
# rotary split is the releases' 16/56/56)
TEXT_L = TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=48, projection_dim=64)
TRANSFORMER = dict(attention_head_dim=128, num_attention_heads=1, pooled_projection_dim=64, axes_dims_rope=(16, 56, 56))
CLIP_L, T5 = "text_encoders.clip_l.transformer.", "text_encoders.t5xxl.transformer."


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _converted(plan, state: dict) -> dict:
    return {k: v.clone().contiguous() for k, v in plan.materialize(state).items()}


def _parts(pipe) -> dict:
    """The pipeline's networks as the separate files hold them."""
    transformer, vae = _state(pipe.transformer), _state(pipe.vae)
    t5 = {k: v for k, v in _state(pipe.text_encoder_2).items() if k != "encoder.embed_tokens.weight"}
    return {"transformer": _converted(flux_to_original(transformer), transformer),
            "vae": _converted(vae_to_original(vae, prefix=""), vae),
            "clip_l": {k if k.startswith("text_model.") else "text_model." + k: v   # as ComfyUI's clip_l holds it
                       for k, v in _state(pipe.text_encoder).items()}, "t5": t5}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux-files")
    pipe = _pipeline(tmp, "dev", text_l=TEXT_L, save=False, **TRANSFORMER)
    parts = _parts(pipe)
    beside = tmp / "beside"
    beside.mkdir()
    save_file(parts["transformer"], beside / "flux1-dev.safetensors")
    save_file(parts["vae"], beside / "ae.safetensors")
    save_file(parts["clip_l"], beside / "clip_l.safetensors")
    save_file(parts["t5"], beside / "t5xxl_fp16.safetensors")
    aio = {**{"model.diffusion_model." + k: v for k, v in parts["transformer"].items()},
           **{"vae." + k: v for k, v in parts["vae"].items()},
           **{CLIP_L + k: v for k, v in parts["clip_l"].items()}, **{T5 + k: v for k, v in parts["t5"].items()}}
    save_file(aio, tmp / "flux1-dev-aio.safetensors")
    alone = tmp / "alone"
    alone.mkdir()
    save_file(parts["transformer"], alone / "flux1-dev.safetensors")
    expected = _reference(pipe, "dev", prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                          generator=torch.Generator().manual_seed(6))
    return pipe, parts, tmp, expected


def _run(path, **kw) -> np.ndarray:
    engine = Engine.load(path, precision="exact", **kw)
    return _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=6,
                                           width=SIZE, height=SIZE)).images)


def test_bfl_file_with_its_parts_beside(files):
    _, _, tmp, expected = files
    ckpt = open_model(tmp / "beside" / "flux1-dev.safetensors")
    assert ckpt.spec.family == "flux-dev" and ckpt.layout == "original"
    assert sum("found beside the model" in n for n in ckpt.notes) == 3
    assert np.abs(_run(tmp / "beside" / "flux1-dev.safetensors") - expected).max() <= MAX_PIXEL_DIFF
    b = tmp / "beside"   # the same files given as well as beside: taken once, as given
    given = open_model(b / "flux1-dev.safetensors",
                       text_encoders=[b / "t5xxl_fp16.safetensors", b / "clip_l.safetensors", b / "ae.safetensors"])
    assert not given.notes and given.spec.family == "flux-dev"


def test_bfl_file_with_its_parts_given(files):
    _, _, tmp, expected = files
    b = tmp / "beside"
    got = _run(tmp / "alone" / "flux1-dev.safetensors",
               text_encoders=[b / "t5xxl_fp16.safetensors", b / "clip_l.safetensors", b / "ae.safetensors"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_comfyui_all_in_one(files):
    _, _, tmp, expected = files
    ckpt = open_model(tmp / "flux1-dev-aio.safetensors")
    assert ckpt.spec.family == "flux-dev" and not ckpt.notes
    assert np.abs(_run(tmp / "flux1-dev-aio.safetensors") - expected).max() <= MAX_PIXEL_DIFF


def test_fp8_t5(files, tmp_path):
    """T5 stored in float8_e4m3fn (ComfyUI's t5xxl_fp8_e4m3fn): computed from the fp8 values, as a pipeline with those
    values in fp32 draws."""
    pipe, parts, tmp, _ = files
    b = tmp / "beside"
    fp8 = {k: (v.to(torch.float8_e4m3fn) if v.ndim == 2 else v) for k, v in parts["t5"].items()}
    save_file(fp8, tmp_path / "t5xxl_fp8_e4m3fn.safetensors")
    with torch.no_grad():
        for k, p in pipe.text_encoder_2.named_parameters():
            if k in fp8:
                p.copy_(fp8[k].float())
    expected = _reference(pipe, "dev", prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                          generator=torch.Generator().manual_seed(6))
    got = _run(tmp / "alone" / "flux1-dev.safetensors",
               text_encoders=[tmp_path / "t5xxl_fp8_e4m3fn.safetensors", b / "clip_l.safetensors", b / "ae.safetensors"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_what_is_missing_or_wrong_is_named(files, tmp_path):
    _, parts, tmp, _ = files
    b = tmp / "beside"
    with pytest.raises(CheckpointError, match="has no CLIP-L"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "t5xxl_fp16.safetensors", b / "ae.safetensors"])
    with pytest.raises(CheckpointError, match="has no VAE"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "t5xxl_fp16.safetensors", b / "clip_l.safetensors"])
    with pytest.raises(CheckpointError, match="given twice"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "clip_l.safetensors", b / "clip_l.safetensors"])
    with pytest.raises(CheckpointError, match="no such file"):
        open_model(tmp / "alone" / "flux1-dev.safetensors", text_encoders=[tmp_path / "nope.safetensors"])
    broken = dict(parts["transformer"])
    del broken["single_blocks.0.linear1.weight"]
    save_file(broken, tmp_path / "broken.safetensors")
    for name in ("ae.safetensors", "clip_l.safetensors", "t5xxl_fp16.safetensors"):
        (tmp_path / name).symlink_to(b / name)
    with pytest.raises(CheckpointError, match=r"single_blocks\.0\.linear1\.weight"):
        Engine.load(tmp_path / "broken.safetensors", precision="exact")


# --- GGUF (city96's layout: BFL's names, 2-D weights in a block format, the rest F32) ------------------------------

def _k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks (144 bytes per 256 values) with small fp16 scales (d, dmin ~ 1e-4), so the weights are of
    the size a trained layer's are."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        blocks[:, at:at + 2] = (rng.uniform(0.5, 1.5, blocks.shape[0]) * 1e-4).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _write_gguf(path, tensors: dict, arch: str) -> dict:
    """``tensors`` (name -> float tensor) written with gguf.GGUFWriter as city96's converter lays them out: a 2-D
    weight whose rows are whole blocks in Q4_K (if 256 values long) or Q8_0 (32), everything else F32. Returns the
    values each tensor holds in the file (the gguf package's own dequantisation)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    stored = {}
    for i, (name, t) in enumerate(tensors.items()):
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[1] % 256 == 0 and ("mlp" in name or "ffn" in name):
            qtype, raw = gguf.GGMLQuantizationType.Q4_K, _k_blocks(*a.shape, seed=i)
        elif a.ndim == 2 and a.shape[1] % 32 == 0 and name not in ("token_embd.weight",):
            qtype = gguf.GGMLQuantizationType.Q8_0
            raw = gguf.quants.quantize(a, qtype)
        else:
            writer.add_tensor(name, a)
            stored[name] = t.float()
            continue
        writer.add_tensor(name, raw, raw_dtype=qtype)
        stored[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))).reshape(a.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def gguf_files(files):
    """flux1-dev-Q.gguf (transformer: Q8_0 and Q4_K) and t5-Q8_0.gguf (T5 in llama.cpp's names) beside ae and
    clip_l; the pipeline given the values the files hold."""
    import gguf

    pipe, parts, tmp, _ = files
    folder = tmp / "gguf"
    folder.mkdir()
    stored = _write_gguf(folder / "flux1-dev-Q.gguf", parts["transformer"], "flux")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5ENCODER, 8)
    gguf_name = {k: names.get_name(k.removesuffix(".weight")) + ".weight" for k in parts["t5"]}
    t5_stored = _write_gguf(folder / "t5-v1_1-xxl-encoder-Q8_0.gguf",
                            {gguf_name[k]: v for k, v in parts["t5"].items()}, "t5encoder")
    for name in ("ae.safetensors", "clip_l.safetensors"):
        (folder / name).symlink_to(tmp / "beside" / name)
    from sdlite.weights.flux_keys import flux_from_original

    transformer = flux_from_original(stored.keys()).materialize(stored)
    with torch.no_grad():
        for k, p in pipe.transformer.named_parameters():
            p.copy_(transformer[k])
        for k, p in pipe.text_encoder_2.named_parameters():
            p.copy_(t5_stored[gguf_name[k]])
    expected = _reference(pipe, "dev", prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                          generator=torch.Generator().manual_seed(6))
    save_file({k: v.contiguous() for k, v in stored.items()}, folder / "flux1-dev-dense.safetensors")
    return folder, expected


def test_gguf_transformer_and_t5(gguf_files):
    """A GGUF transformer (Q8_0, Q4_K) and a GGUF T5 beside it: the image of the values they hold; the transformer's
    quantised Linear layers stay quantised in memory (dequantised as they run)."""
    from sdlite.engine.lowbit import LowBitLinear, lowbit_bytes

    folder, expected = gguf_files
    ckpt = open_model(folder / "flux1-dev-Q.gguf")
    assert ckpt.spec.family == "flux-dev" and sum("found beside" in n for n in ckpt.notes) == 3
    engine = Engine.load(folder / "flux1-dev-Q.gguf", precision="exact")
    got = _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=6,
                                          width=SIZE, height=SIZE)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    with engine.models.use("transformer") as transformer:
        low = [m for m in transformer.modules() if isinstance(m, LowBitLinear)]
        assert {m.qtype for m in low} == {"Q8_0", "Q4_K"} and len(low) > 20
        dense = sum(m.in_features * m.out_features * 4 for m in low)
        assert lowbit_bytes(transformer) < dense / 3
    low_memory = Engine.load(folder / "flux1-dev-Q.gguf", precision="exact", memory_mode=0)
    again = _pixels(low_memory.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=6,
                                                width=SIZE, height=SIZE)).images)
    assert np.array_equal(again, got)


def test_lora_on_gguf_weights(files, gguf_files):
    """A LoRA (sd-scripts' BFL layout) on the GGUF transformer merges per call into each dequantised weight: the
    image a dense file of the same values gives with it, in memory modes 1 and 0."""
    from tests.test_flux_lora import TRANSFORMER_TARGETS, WEIGHT, _bfl, _factors, _linears, _write

    pipe = files[0]
    folder, _ = gguf_files
    lora = _write(folder / "style.safetensors", _bfl(_factors(_linears(pipe.transformer, TRANSFORMER_TARGETS), 5)),
                  kohya=True)
    r = Request(prompt=PROMPT, steps=2, cfg_scale=1.0, sampler="euler", seed=3, width=SIZE, height=SIZE,
                loras=((lora, WEIGHT),))
    dense = _pixels(Engine.load(folder / "flux1-dev-dense.safetensors", precision="exact").generate(r).images)
    engine = Engine.load(folder / "flux1-dev-Q.gguf", precision="exact")
    assert np.array_equal(_pixels(engine.generate(r).images), dense)
    plain = _pixels(engine.generate(r.replace(loras=())).images)
    assert np.abs(plain - dense).mean() > 4, "the LoRA should change the image"
    low = Engine.load(folder / "flux1-dev-Q.gguf", precision="exact", memory_mode=0)
    assert np.array_equal(_pixels(low.generate(r).images), dense)
