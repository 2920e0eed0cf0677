"""Qwen2.5-VL's vision side against transformers: the tower (sdlite.models.qwen_vision) bit for bit against
``Qwen2_5_VisionTransformerPretrainedModel`` (float32, sdpa) on a tiny config where windows matter; the image
processor (sdlite.tokenizers.qwen_images) against ``Qwen2VLImageProcessorPil``; the config (sdlite.config.qwen_vision)
from config.json files and the released 7B tower's shapes; the key layouts (sdlite.weights.qwen_vision_keys):
``visual.``, ``model.visual.`` and llama.cpp's mmproj GGUF, written here as convert_hf_to_gguf.py writes it (its
names from the gguf package's own tensor map, q/k/v and the Conv3d split the same way)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.vision_utils import get_vision_window_index

from sdlite.config.qwen_vision import (
    QWEN25_VL_7B_VISION, VISION_MAX_PIXELS, VISION_MIN_PIXELS, QwenVisionConfig,
)
from sdlite.errors import CheckpointError
from sdlite.models.qwen_vision import QwenVisionTower, vision_layout
from sdlite.tokenizers.qwen_images import image_tokens, processor_settings, smart_resize, vision_patches
from sdlite.weights.gguf import open_gguf
from sdlite.weights.qwen_vision_keys import (
    GGUF_PREFIX, infer_vision_config, llama_cpp_vision_tensors, load_qwen_vision, vision_config_from_gguf,
    vision_prefix, vision_state_dict,
)
from tests.reference import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 heads of 16; windows of 56 px = 2 x 2 merged units; block 1 attends fully, blocks 0 and 2 in windows
TINY = QwenVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, window_size=56,
                        fullatt_block_indexes=(1,), out_hidden_size=24)
# (t, h, w) in patches: 5 x 7 merged units (windows cut short on both sides), 4 x 4 (windows fill it exactly:
# transformers pads a whole empty window row), a 2-frame clip of 3 x 2 units
GRIDS = torch.tensor([[1, 10, 14], [1, 8, 8], [2, 6, 4]])
# the released Qwen2.5-VL-7B-Instruct config.json's vision_config, as it is written there
RELEASED_VISION_JSON = {
    "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    "temporal_patch_size": 2, "model_type": "qwen2_5_vl",
}


def _reference(cfg: QwenVisionConfig, device=None):
    hf = Qwen2_5_VLVisionConfig(**cfg.to_hf())
    hf._attn_implementation = "sdpa"
    with torch.device(device or "cpu"):
        return Qwen2_5_VisionTransformerPretrainedModel(hf).eval()


def _pixels(grids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    n = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
    return torch.randn(n, TINY.patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    """transformers' tiny tower with random weights, and ours loaded from its state dict."""
    torch.manual_seed(0)
    ref = seed_all(_reference(TINY))
    ours = QwenVisionTower(TINY).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def tiny_vl():
    """A tiny Qwen2_5_VLForConditionalGeneration's state dict (transformers 5 names: ``model.visual.``,
    ``model.language_model.``, ``lm_head``), its tower seeded."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=TINY.to_hf())
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    seed_all(model.model.visual)
    return model.state_dict()


# --- the tower ---------------------------------------------------------------------------------------------------


def test_tower_is_bit_identical_to_transformers(pair):
    ref, ours = pair
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        want = ref(pixels, GRIDS).pooler_output
        got = ours(pixels, GRIDS)
    assert got.shape == (sum(image_tokens(GRIDS)), TINY.out_hidden_size) == want.shape
    assert torch.equal(got, want)


def test_each_image_is_computed_alone(pair):
    """An image's tokens do not depend on the images beside it (bit for bit: equal-length windows batched)."""
    _, ours = pair
    pixels = _pixels(GRIDS)
    counts = (GRIDS[:, 0] * GRIDS[:, 1] * GRIDS[:, 2]).tolist()
    with torch.no_grad():
        together = ours(pixels, GRIDS).split(image_tokens(GRIDS))
        for i, part in enumerate(pixels.split(counts)):
            assert torch.equal(ours(part, GRIDS[i:i + 1]), together[i])


def test_bfloat16_is_bit_identical_too(pair):
    """In bf16 (the dtype of its weights) too, against transformers' tower as ``from_pretrained(dtype=bf16)`` leaves
    it: weights in bf16, the rotary inverse frequencies still float32 (``.to(bf16)`` would round them as well)."""
    ref, ours = pair
    low_ref = _reference(TINY).to(torch.bfloat16)
    low_ref.load_state_dict(ref.state_dict())
    low_ref.rotary_pos_emb.inv_freq = ref.rotary_pos_emb.inv_freq
    low = QwenVisionTower(TINY).to(torch.bfloat16).eval()
    low.load_state_dict(ours.state_dict())
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        want = low_ref(pixels, GRIDS).pooler_output
        got = low(pixels, GRIDS)
        full = ours(pixels, GRIDS)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert (got.float() - full).abs().max() / full.abs().max() < 0.05


@pytest.mark.parametrize("grid", [(1, 10, 14), (1, 8, 8), (2, 6, 4), (1, 2, 2), (3, 18, 6)])
def test_window_order_is_transformers(grid):
    grids = torch.tensor([grid, (1, 4, 6)])
    layout = vision_layout(grids, 2, TINY.window_units)
    index, cu = get_vision_window_index(grids, spatial_merge_size=2, window_size=56, patch_size=14)
    assert torch.equal(layout.window_index, index)
    assert torch.equal(layout.cu_windows, cu)


def test_tower_refuses_bad_input(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="1176"):
        ours(torch.zeros(4, 100), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="describes 16"):
        ours(torch.zeros(8, TINY.patch_dim), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="image 1"):
        ours(torch.zeros(8, TINY.patch_dim), torch.tensor([[1, 2, 2], [1, 3, 2]]))


def test_released_7b_tower_on_meta_matches_transformers():
    with torch.device("meta"):
        ours = QwenVisionTower(QWEN25_VL_7B_VISION)
    ref = _reference(QWEN25_VL_7B_VISION, "meta")
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert mine == theirs
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters()) == 676_550_144
    assert mine["patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert mine["merger.mlp.2.weight"] == (3584, 5120)
    assert infer_vision_config(mine) == QWEN25_VL_7B_VISION


# --- the config --------------------------------------------------------------------------------------------------


def test_config_from_the_released_and_transformers_5_files():
    assert QwenVisionConfig.from_hf(RELEASED_VISION_JSON) == QWEN25_VL_7B_VISION
    assert QwenVisionConfig.from_hf({"model_type": "qwen2_5_vl", "vision_config": RELEASED_VISION_JSON}) \
        == QWEN25_VL_7B_VISION
    saved = Qwen2_5_VLConfig(vision_config=RELEASED_VISION_JSON).to_dict()   # transformers 5's nested layout
    assert QwenVisionConfig.from_hf(saved) == QWEN25_VL_7B_VISION
    assert QwenVisionConfig.from_hf(TINY.to_hf()) == TINY
    assert (QWEN25_VL_7B_VISION.head_dim, QWEN25_VL_7B_VISION.patch_dim, QWEN25_VL_7B_VISION.window_units) \
        == (80, 1176, 4)


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("depth", 0), ("num_heads", 3),
                                          ("fullatt_block_indexes", [7, 40]), ("window_size", 14),
                                          ("hidden_size", "1280")])
def test_config_names_a_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        QwenVisionConfig.from_hf({**RELEASED_VISION_JSON, field: value})


def test_config_refuses_qwen2_vl():
    with pytest.raises(ValueError, match="embed_dim"):
        QwenVisionConfig.from_hf({"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16})


# --- the image processor -----------------------------------------------------------------------------------------


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + width * 1000 + height)
    a = rng.integers(0, 256, (height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return Image.fromarray(a, "RGBA" if mode == "RGBA" else "RGB").convert(mode)


def test_processor_equals_transformers():
    """Odd sizes, one under min_pixels, ones over a small max_pixels, non-square, alpha, palette and grey."""
    max_pixels = 28 * 28 * 12
    images = [_image(57, 43), _image(20, 15), _image(300, 97), _image(97, 300), _image(28, 28),
              _image(33, 61, "RGBA"), _image(10, 140), _image(1, 1), _image(40, 30, "P"), _image(45, 31, "L")]
    ref = Qwen2VLImageProcessorPil(min_pixels=VISION_MIN_PIXELS, max_pixels=max_pixels)(images=images,
                                                                                          return_tensors="pt")
    pixels, grids = vision_patches(images, VISION_MIN_PIXELS, max_pixels)
    assert pixels.dtype == torch.float32 and grids.dtype == torch.long
    assert torch.equal(grids, ref["image_grid_thw"])
    assert torch.equal(pixels, ref["pixel_values"])
    assert max(int(h * w) for _, h, w in grids.tolist()) * 14 * 14 <= max_pixels


def test_processor_defaults_are_the_released_preprocessor_config():
    config = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
              "processor_class": "Qwen2_5_VLProcessor", "do_rescale": True, "rescale_factor": 0.00392156862745098,
              "resample": 3, "do_convert_rgb": True, "do_normalize": True, "do_resize": True}
    settings = processor_settings(config)
    assert settings["max_pixels"] == VISION_MAX_PIXELS and settings["min_pixels"] == VISION_MIN_PIXELS
    images = [_image(123, 77)]
    ref = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if "class" not in k and "type" not in k})(
        images=images, return_tensors="pt")
    pixels, grids = vision_patches(images, **settings)
    assert torch.equal(pixels, ref["pixel_values"]) and torch.equal(grids, ref["image_grid_thw"])


def test_smart_resize_is_transformers():
    for height in (1, 13, 28, 41, 56, 99, 480, 1023):
        for width in (2, 14, 29, 75, 640, 1999):
            for low, high in ((3136, 12845056), (3136, 28 * 28 * 16), (28 * 28 * 9, 28 * 28 * 40)):
                if max(height, width) / min(height, width) > 200:
                    continue
                assert smart_resize(height, width, 28, low, high) == hf_smart_resize(height, width, 28, low, high)


def test_image_tokens_and_the_tower_agree(pair):
    _, ours = pair
    pixels, grids = vision_patches([_image(70, 45), _image(30, 90)])
    counts = image_tokens(grids)
    assert counts == [int(t * h * w) // 4 for t, h, w in grids.tolist()]
    with torch.no_grad():
        assert ours(pixels, grids).shape[0] == sum(counts)


def test_processor_names_the_bad_image():
    with pytest.raises(ValueError, match=r"image 1 is a ndarray"):
        vision_patches([_image(30, 30), np.zeros((30, 30, 3), np.uint8)])
    with pytest.raises(ValueError, match=r"image 0 is 0x5"):
        vision_patches([Image.new("RGB", (0, 5))])
    with pytest.raises(ValueError, match=r"image 1 \(1x300\).*aspect ratio"):
        vision_patches([_image(30, 30), _image(1, 300)])
    with pytest.raises(ValueError, match="aspect ratio"):   # transformers refuses it too
        Qwen2VLImageProcessorPil()(images=[_image(1, 300)])


# --- the key layouts ---------------------------------------------------------------------------------------------


def test_hugging_face_layouts(tiny_vl):
    """transformers 5's ``model.visual.`` (a whole Qwen2.5-VL's state dict), the released files' ``visual.`` and bare
    names: the canonical state dict comes back tensor for tensor; the language model beside it is not read."""
    want = {k[len("model.visual."):]: v for k, v in tiny_vl.items() if k.startswith("model.visual.")}
    released = {("visual." + k[len("model.visual."):] if k.startswith("model.visual.") else
                 k.replace("model.language_model.", "model.")): v for k, v in tiny_vl.items()}
    for prefix, state in (("model.visual.", tiny_vl), ("visual.", released), ("", want)):
        assert vision_prefix(state) == prefix
        got = vision_state_dict(state, "text_encoder/model.safetensors")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    tower = load_qwen_vision(released, "qwen_2.5_vl_7b.safetensors", config=TINY)
    assert all(torch.equal(tower.state_dict()[k], want[k]) for k in want)
    assert vision_prefix([k for k in tiny_vl if not k.startswith("model.visual.")]) is None


def test_comfyui_scaled_fp8(tiny_vl):
    """ComfyUI's ``qwen_2.5_vl_7b_fp8_scaled``: matrices fp8 with a per-tensor ``scale_weight`` (or ``weight_scale``),
    a ``scaled_fp8`` marker, input scales: each weight comes back as fp8 value times scale."""
    state, want = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}, {}
    for i, (k, v) in enumerate((k, v) for k, v in tiny_vl.items() if k.startswith("model.visual.")):
        name, key = k[len("model.visual."):], "visual." + k[len("model.visual."):]
        if v.ndim == 2:
            scale = v.abs().max() / 448
            state[key] = (v / scale).to(torch.float8_e4m3fn)
            state[key[:-len("weight")] + ("scale_weight" if i % 2 else "weight_scale")] = scale.reshape(1)
            state[key[:-len("weight")] + "input_scale"] = torch.ones(1)
            want[name] = state[key].float() * scale
        else:
            state[key] = want[name] = v
    got = vision_state_dict(state, "qwen_2.5_vl_7b_fp8_scaled.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_partial_layout_names_the_file_and_the_key(tiny_vl):
    state = {k: v for k, v in tiny_vl.items() if k != "model.visual.blocks.2.attn.qkv.bias"}
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.visual\.blocks\.2\.attn\.qkv\.bias"):
        vision_state_dict(state, "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*no Qwen2\.5-VL vision tower"):
        vision_state_dict({"model.norm.weight": torch.ones(2)}, "model.safetensors")
    with pytest.raises(CheckpointError, match=r"visual\.blocks\.0\.attn\.extra\.weight"):
        vision_state_dict({**{"visual." + k[len("model.visual."):]: v for k, v in tiny_vl.items()
                              if k.startswith("model.visual.")}, "visual.blocks.0.attn.extra.weight": torch.ones(1)},
                          "x.safetensors")


def _converted(state: dict) -> dict:
    """What convert_hf_to_gguf.py (Qwen2VLVisionModel.modify_tensors) makes of ``visual.`` tensors: names through the
    gguf package's tensor map, qkv split in three row blocks, the Conv3d split along its temporal axis."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, TINY.depth)
    patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
    out = {}
    for key, t in state.items():
        name = "visual." + key
        if ".qkv." in name:
            c = t.shape[0] // 3
            for part, rows in zip("qkv", (t[:c], t[c:2 * c], t[2 * c:])):
                out[names.get_name(name.replace("qkv", part), try_suffixes=(".weight", ".bias"))] = rows
        elif "patch_embed.proj.weight" in name:
            out[patch], out[patch + ".1"] = t[:, :, 0], t[:, :, 1]
        else:
            out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    return out


def mmproj_fields(writer, config: QwenVisionConfig) -> None:
    """The metadata llama.cpp's converter writes into Qwen2.5-VL's mmproj GGUF, for a tower of ``config``."""
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_vision_projection_dim(config.out_hidden_size)
    writer.add_vision_patch_size(config.patch_size)
    writer.add_vision_embedding_length(config.hidden_size)
    writer.add_vision_feed_forward_length(config.intermediate_size)
    writer.add_vision_block_count(config.depth)
    writer.add_vision_head_count(config.num_heads)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(config.fullatt_block_indexes[0] + 1)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_uint32("clip.vision.window_size", config.window_size)


def _write_mmproj(path, tensors: dict, drop: str | None = None) -> None:
    """A mmproj GGUF with the metadata llama.cpp's converter writes for Qwen2.5-VL; matrices F16, the rest F32."""
    writer = gguf.GGUFWriter(str(path), arch="clip")
    mmproj_fields(writer, TINY)
    for name, t in tensors.items():
        if name != drop:
            a = np.ascontiguousarray(t.detach().numpy().astype(np.float16 if t.ndim >= 2 else np.float32))
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama_cpp_mmproj(pair, tmp_path):
    ref, ours = pair
    state = ref.state_dict()
    converted = _converted(state)
    mine = llama_cpp_vision_tensors(state)
    assert mine.keys() == converted.keys() and all(torch.equal(mine[k], converted[k]) for k in mine)
    assert {"v.patch_embd.weight", "v.patch_embd.weight.1", "v.blk.2.attn_v.bias", "v.post_ln.weight",
            "mm.2.weight"} <= converted.keys()
    path = tmp_path / "mmproj-Qwen2.5-VL-tiny-f16.gguf"
    _write_mmproj(path, converted)
    store = open_gguf(path)
    assert vision_prefix(store.keys()) == GGUF_PREFIX
    assert vision_config_from_gguf(store) == TINY
    back = vision_state_dict(store, str(path))
    held = {k: v.to(torch.float16).float() if v.ndim >= 2 else v for k, v in state.items()}   # the file's values
    assert back.keys() == held.keys()
    assert all(torch.equal(back[k].float(), held[k]) for k in held)
    tower = load_qwen_vision(store, str(path))
    same = QwenVisionTower(TINY).eval()
    same.load_state_dict(held)
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        assert torch.equal(tower(pixels, GRIDS), same(pixels, GRIDS))
    partial = tmp_path / "partial.gguf"
    _write_mmproj(partial, converted, drop="v.blk.2.attn_k.weight")
    with pytest.raises(CheckpointError, match=r"partial\.gguf.*v\.blk\.2\.attn_k\.weight"):
        vision_state_dict(open_gguf(partial), str(partial))
