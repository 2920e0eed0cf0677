"""Key conversion and detection against diffusers' own single-file conversion code.

Every reference model is built from a config written here (nothing is downloaded): tiny ones with random
weights for exact tensor-for-tensor checks, and the real SD 1.5 / SD 2.1 architectures on the meta device
for key coverage, shapes and detection.
"""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint, convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from transformers import CLIPTextConfig, CLIPTextModel

from sdlite.weights import convert as C
from sdlite.weights.detect import UnsupportedModelError, describe, detect, prediction_type_from_metadata

# --- reference configs ---------------------------------------------------------------------------------

SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768, attention_head_dim=8,
)
SD21_UNET = dict(SD15_UNET, sample_size=96, cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20],
                 use_linear_projection=True)
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, sample_size=512)
CLIP_L = dict(vocab_size=49408, max_position_embeddings=77, hidden_size=768, intermediate_size=3072,
              num_hidden_layers=12, num_attention_heads=12, hidden_act="quick_gelu", projection_dim=768)
OPENCLIP_H = dict(vocab_size=49408, max_position_embeddings=77, hidden_size=1024, intermediate_size=4096,
                  num_hidden_layers=23, num_attention_heads=16, hidden_act="gelu", projection_dim=512)

TINY_UNETS = {
    "sd1-conv-proj": dict(block_out_channels=(32, 64), layers_per_block=2,
                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                          attention_head_dim=8),
    "sd2-linear-proj": dict(block_out_channels=(32, 64), layers_per_block=1,
                            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=48,
                            attention_head_dim=[2, 4], use_linear_projection=True),
    "inpaint-9ch": dict(in_channels=9, block_out_channels=(32, 64), layers_per_block=1,
                        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                        attention_head_dim=4),
    "3-levels-unmirrored-depth2": dict(block_out_channels=(32, 32, 64), layers_per_block=2,
                                       down_block_types=("CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
                                       up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
                                       cross_attention_dim=32, attention_head_dim=4, transformer_layers_per_block=2),
}
TINY_VAES = {
    "2-levels": dict(block_out_channels=(32, 64), layers_per_block=1,
                     down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
    "3-levels": dict(block_out_channels=(32, 32, 64), layers_per_block=2, latent_channels=8,
                     down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3),
}
TINY_TEXT = dict(vocab_size=100, max_position_embeddings=16, hidden_size=32, intermediate_size=37,
                 num_attention_heads=4, bos_token_id=0, eos_token_id=1, pad_token_id=1)


# --- helpers -------------------------------------------------------------------------------------------


def randomized(state: Mapping[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Same keys and shapes, every float tensor random (no zero biases or unit norms that hide mix-ups)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in state.items()}


def unet_state(cfg: dict, meta: bool = False) -> dict[str, torch.Tensor]:
    if meta:
        with torch.device("meta"):
            return UNet2DConditionModel(**cfg).state_dict()
    return randomized(UNet2DConditionModel(sample_size=8, **cfg).state_dict())


def vae_state(cfg: dict, meta: bool = False) -> dict[str, torch.Tensor]:
    if meta:
        with torch.device("meta"):
            return AutoencoderKL(**cfg).state_dict()
    return randomized(AutoencoderKL(norm_num_groups=32, **cfg).state_dict(), seed=1)


def text_model(cfg: dict, meta: bool = False) -> CLIPTextModel:
    config = CLIPTextConfig(**cfg)
    if meta:
        with torch.device("meta"):
            return CLIPTextModel(config)
    return CLIPTextModel(config)


def text_state(model: CLIPTextModel, seed: int = 2) -> dict[str, torch.Tensor]:
    """Canonical text-encoder keys: a diffusers folder's ``text_model.*`` names (transformers 5 drops the level)."""
    state = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
    if next(iter(state.values())).is_meta:
        return state
    return randomized(state, seed)


def assert_same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]):
    assert sorted(got) == sorted(want), (
        f"only in got: {sorted(set(got) - set(want))[:5]}, only in want: {sorted(set(want) - set(got))[:5]}")
    for k in want:
        a, b = got[k], want[k]
        assert a.shape == b.shape, f"{k}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert a.dtype == b.dtype, k
        if not b.is_meta:
            assert torch.equal(a, b), k


def assert_clean(plan: C.ComponentPlan):
    assert plan.missing == [] and plan.unexpected == [], plan.report()


def shapes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


# --- UNet ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY_UNETS))
def test_unet_export_is_read_back_by_diffusers(name):
    cfg = TINY_UNETS[name]
    state = unet_state(cfg)
    plan = C.unet_to_original(state, cfg)
    assert_clean(plan)
    original = plan.materialize(state)
    assert all(k.startswith(C.UNET_PREFIX) for k in original) and len(original) == len(state)
    assert not any(".down_blocks." in k or ".resnets." in k for k in original)
    assert_same(convert_ldm_unet_checkpoint(original, dict(cfg)), state)


@pytest.mark.parametrize("name", list(TINY_UNETS))
def test_unet_import_matches_diffusers(name):
    cfg = TINY_UNETS[name]
    state = unet_state(cfg)
    original = C.unet_to_original(state, cfg).materialize(state)
    reference = convert_ldm_unet_checkpoint(original, dict(cfg))
    for structure in (cfg, None):  # from the config, and derived from the key names alone
        plan = C.unet_from_original(original, structure, expected=state)
        assert_clean(plan)
        assert_same(plan.materialize(original), reference)


def test_unet_structure_from_config_and_keys_agree():
    for cfg in TINY_UNETS.values():
        state = unet_state(cfg)
        from_cfg = C.UNetStructure.from_diffusers_config(cfg)
        original = C.unet_to_original(state, cfg).entries
        from sdlite.weights.unet_keys import unet_structure_from_keys

        assert unet_structure_from_keys(state, layout="diffusers", prefix="") == from_cfg
        assert unet_structure_from_keys(original, layout="original") == from_cfg


def test_unet_unsupported_block_type_is_named():
    with pytest.raises(C.ConversionError, match="AttnDownBlock2D"):
        C.UNetStructure.from_diffusers_config(dict(TINY_UNETS["sd1-conv-proj"],
                                                   down_block_types=("AttnDownBlock2D", "DownBlock2D")))


def test_unet_ema_weights():
    cfg = TINY_UNETS["sd1-conv-proj"]
    state = unet_state(cfg)
    original = C.unet_to_original(state, cfg).materialize(state)
    ema = {C.ema_key(k): v + 1.0 for k, v in original.items()}
    file = {**original, **ema, "model_ema.decay": torch.tensor(0.9999), "model_ema.num_updates": torch.tensor(7)}
    # default: EMA copies ignored, regular weights used
    plan = C.plan_from_original(file, expected={"unet": state})
    assert_same(plan.components["unet"].materialize(file), state)
    assert set(plan.ignored) == set(ema) | {"model_ema.decay", "model_ema.num_updates"} and plan.unexpected == []
    # use_ema: the EMA copies, as diffusers' extract_ema reads them
    plan = C.unet_from_original(file, cfg, use_ema=True, expected=state)
    assert_clean(plan)
    got = plan.materialize(file)
    assert_same(got, convert_ldm_unet_checkpoint(file, dict(cfg), extract_ema=True))
    assert torch.equal(got["conv_in.weight"], state["conv_in.weight"] + 1.0)


# --- VAE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY_VAES))
def test_vae_roundtrip_against_diffusers(name):
    cfg = TINY_VAES[name]
    state = vae_state(cfg)
    plan = C.vae_to_original(state)
    assert_clean(plan)
    original = plan.materialize(state)
    n = len(cfg["block_out_channels"])
    # attention projections are 1x1 convolutions in the original layout; the decoder's up.N runs backwards
    assert original["first_stage_model.decoder.mid.attn_1.q.weight"].shape[2:] == (1, 1)
    assert torch.equal(original[f"first_stage_model.decoder.up.{n - 1}.block.0.conv1.weight"],
                       state["decoder.up_blocks.0.resnets.0.conv1.weight"])
    assert_same(convert_ldm_vae_checkpoint(original, dict(cfg)), state)
    back = C.vae_from_original(original, n, expected=state)
    assert_clean(back)
    assert_same(back.materialize(original), state)
    assert_same(C.vae_from_original(original).materialize(original), state)  # levels from the keys


def test_legacy_diffusers_vae_attention_names():
    cfg = TINY_VAES["2-levels"]
    state = vae_state(cfg)
    names = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    legacy = {}
    for k, v in state.items():
        for new, old in names.items():
            if f".attentions.0.{new}." in k:
                k = k.replace(f".{new}.", f".{old}.")
                if old == "query" and v.ndim == 2:
                    v = v[:, :, None, None]  # some old folders even stored them conv-shaped
        legacy[k] = v
    assert "encoder.mid_block.attentions.0.proj_attn.weight" in legacy
    plan = C.normalize_diffusers_keys(legacy, "vae", expected=state)
    assert_clean(plan)
    assert_same(plan.materialize(legacy), state)


# --- text encoders -------------------------------------------------------------------------------------


def test_clip_roundtrip_against_diffusers():
    state = text_state(text_model(dict(TINY_TEXT, num_hidden_layers=3)))
    plan = C.clip_to_original(state)
    assert_clean(plan)
    original = plan.materialize(state)
    assert all(k.startswith("cond_stage_model.transformer.text_model.") for k in original)
    assert_same(convert_ldm_clip_checkpoint(original), state)
    back = C.clip_from_original(original, expected=state)
    assert_clean(back)
    assert_same(back.materialize(original), state)


def test_clip_old_layout_without_text_model_and_position_ids():
    state = text_state(text_model(dict(TINY_TEXT, num_hidden_layers=2)))
    old = {k.replace("text_model.", "cond_stage_model.transformer.", 1): v for k, v in state.items()}
    old["cond_stage_model.transformer.embeddings.position_ids"] = torch.arange(16)[None]
    plan = C.clip_from_original(old, expected=state)
    assert_clean(plan)
    assert plan.ignored == ["cond_stage_model.transformer.embeddings.position_ids"]
    assert_same(plan.materialize(old), state)


def test_clip_both_spellings_of_a_key_is_an_error():
    state = text_state(text_model(dict(TINY_TEXT, num_hidden_layers=1)))
    key = "text_model.final_layer_norm.weight"
    file = {"cond_stage_model.transformer." + key: state[key],
            "cond_stage_model.transformer.final_layer_norm.weight": state[key]}
    with pytest.raises(C.ConversionError, match="both map to 'text_model.final_layer_norm.weight'"):
        C.clip_from_original(file)


def _openclip_file(state: dict, layers: int, hidden: int, seed: int = 3) -> dict:
    """An SD 2.x-style OpenCLIP tower: our export plus the unused last block, text_projection and logit_scale."""
    original = C.openclip_to_original(state).materialize(state)
    g = torch.Generator().manual_seed(seed)
    last = f"{C.OPENCLIP_PREFIX}transformer.resblocks.{layers - 2}."
    for k, v in list(original.items()):
        if k.startswith(last):
            original[k.replace(f"resblocks.{layers - 2}.", f"resblocks.{layers - 1}.")] = \
                torch.randn(v.shape, generator=g)
    original[C.OPENCLIP_PREFIX + "text_projection"] = torch.randn(hidden, hidden // 2, generator=g)
    original[C.OPENCLIP_PREFIX + "logit_scale"] = torch.tensor(4.6)
    return original


def test_openclip_roundtrip_against_diffusers():
    model = text_model(dict(TINY_TEXT, num_hidden_layers=4, hidden_act="gelu"))
    state = text_state(model)
    export = C.openclip_to_original(state)
    assert_clean(export)
    exported = export.materialize(state)
    assert torch.equal(exported[C.OPENCLIP_PREFIX + "transformer.resblocks.0.attn.in_proj_weight"],
                       torch.cat([state[f"text_model.encoder.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert C.OPENCLIP_PREFIX + "positional_embedding" in exported
    assert not any("resblocks.4." in k for k in exported)  # export writes back the layers we have

    original = _openclip_file(state, layers=5, hidden=32)  # the file's tower has one more layer
    reference = convert_open_clip_checkpoint(model, original)
    # diffusers drops only block 23 by name (ViT-H); at this size it passes the extra block through
    extra = {k for k in reference if k.startswith("text_model.encoder.layers.4.")}
    assert len(extra) == 16
    assert_same({k: v for k, v in reference.items() if k not in extra}, state)

    plan = C.openclip_from_original(original, expected=state)
    assert_clean(plan)
    assert_same(plan.materialize(original), state)
    assert C.OPENCLIP_PREFIX + "text_projection" in plan.ignored
    assert sum("resblocks.4." in k for k in plan.ignored) == 12
    # without `expected` the default drops the file's last block too
    assert_same(C.openclip_from_original(original).materialize(original), state)
    # an sdlite export (all blocks used) read back with the layer count given
    assert_same(C.openclip_from_original(exported, num_layers=4).materialize(exported), state)


def test_text_encoder_diffusers_folder_names():
    state = text_state(text_model(dict(TINY_TEXT, num_hidden_layers=2)))
    flat = {k.removeprefix("text_model."): v for k, v in state.items()}  # as transformers 5 names them
    flat["embeddings.position_ids"] = torch.arange(16)[None]
    plan = C.normalize_diffusers_keys(flat, "text_encoder", expected=state)
    assert_clean(plan)
    assert plan.ignored == ["embeddings.position_ids"]
    assert_same(plan.materialize(flat), state)
    prefixed = {**state, "text_model.embeddings.position_ids": torch.arange(16)[None]}
    assert C.normalize_diffusers_keys(prefixed, "text_encoder").ignored == ["text_model.embeddings.position_ids"]


# --- whole files ---------------------------------------------------------------------------------------


def _tiny_parts():
    unet_cfg = TINY_UNETS["sd1-conv-proj"]
    parts = {"unet": unet_state(unet_cfg), "vae": vae_state(TINY_VAES["2-levels"]),
             "text_encoder": text_state(text_model(dict(TINY_TEXT, num_hidden_layers=2)))}
    return unet_cfg, parts


def test_whole_file_export_and_import():
    unet_cfg, parts = _tiny_parts()
    export = C.plan_to_original({k: list(v) for k, v in parts.items()}, unet_structure=unet_cfg)
    file = dict(export.merge(parts))
    assert len(file) == sum(len(v) for v in parts.values())
    file.update({"betas": torch.rand(10), "alphas_cumprod": torch.rand(10), "alphas_cumprod_prev": torch.rand(10),
                 "cond_stage_model.transformer.text_model.embeddings.position_ids": torch.arange(16)[None]})
    plan = C.plan_from_original(file, expected=parts)
    views = plan.split(file)
    for name, state in parts.items():
        assert_clean(plan.components[name])
        assert_same(dict(views[name]), state)
    assert sorted(plan.ignored) == ["alphas_cumprod", "alphas_cumprod_prev", "betas"]
    assert plan.components["text_encoder"].ignored == [
        "cond_stage_model.transformer.text_model.embeddings.position_ids"]
    assert plan.unexpected == [] and plan.report() == ""


def test_import_reports_missing_and_unexpected():
    unet_cfg, parts = _tiny_parts()
    file = dict(C.plan_to_original(parts, unet_structure=unet_cfg).merge(parts))
    for k in ["first_stage_model.quant_conv.weight", "first_stage_model.quant_conv.bias",
              "model.diffusion_model.out.2.weight"]:
        del file[k]
    file["model.diffusion_model.input_blocks.1.0.frobnicate.weight"] = torch.zeros(1)
    file["something_else.weight"] = torch.zeros(1)
    plan = C.plan_from_original(file, unet_structure=unet_cfg, expected=parts)
    assert plan.components["vae"].missing == ["quant_conv.weight", "quant_conv.bias"]
    assert plan.components["unet"].missing == ["conv_out.weight"]
    assert plan.components["unet"].unexpected == ["model.diffusion_model.input_blocks.1.0.frobnicate.weight"]
    assert plan.unexpected == ["something_else.weight"]
    report = plan.report()
    assert "vae: 2 missing keys, first few: 'quant_conv.weight', 'quant_conv.bias'" in report
    assert "unet: 1 unexpected keys, first few: 'model.diffusion_model.input_blocks.1.0.frobnicate.weight'" in report
    assert "1 unexpected keys outside the known components, first few: 'something_else.weight'" in report


class CountingMapping(Mapping):
    def __init__(self, data):
        self.data, self.reads = data, []

    def __getitem__(self, k):
        self.reads.append(k)
        return self.data[k]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_plans_are_lazy():
    model = text_model(dict(TINY_TEXT, num_hidden_layers=2))
    state = text_state(model)
    original = _openclip_file(state, layers=3, hidden=32)
    source = CountingMapping(original)
    plan = C.openclip_from_original(list(source))  # names only
    view = plan.apply(source)
    assert source.reads == [] and len(view) == len(state)
    q = view["text_model.encoder.layers.1.self_attn.q_proj.weight"]
    assert source.reads == [C.OPENCLIP_PREFIX + "transformer.resblocks.1.attn.in_proj_weight"]
    assert q.shape == (32, 32)
    assert plan.shapes(shapes_of(original)) == shapes_of(state)


def test_transform_errors_name_key_and_shape():
    with pytest.raises(C.ConversionError, match=r"'x.weight'.*1x1 convolution.*\[8, 8, 3, 3\]"):
        C.Transform("to_linear").apply([torch.zeros(8, 8, 3, 3)], "x.weight")
    with pytest.raises(C.ConversionError, match=r"cannot split shape \[10, 4\] into 3"):
        C.Transform("chunk", (0, 3)).shape([(10, 4)], "y")
    view = C.apply_plan({"a": C.PlanEntry(("missing.key",))}, {})
    with pytest.raises(C.ConversionError, match="'missing.key' is not in the checkpoint"):
        view["a"]


# --- real SD 1.5 / SD 2.1 architectures (meta device: names and shapes only) ---------------------------


@pytest.fixture(scope="module")
def real():
    sd15_unet = unet_state(SD15_UNET, meta=True)
    sd21_unet = unet_state(SD21_UNET, meta=True)
    vae = vae_state(SD_VAE, meta=True)
    clip_l = text_model(CLIP_L, meta=True)
    vit_h = text_model(OPENCLIP_H, meta=True)
    return dict(sd15_unet=sd15_unet, sd21_unet=sd21_unet, vae=vae, clip_l_model=clip_l, clip_l=text_state(clip_l),
                vit_h_model=vit_h, vit_h=text_state(vit_h))


def _sd15_file(real, unet="sd15_unet"):
    parts = {"unet": real[unet], "vae": real["vae"], "text_encoder": real["clip_l"]}
    return dict(C.plan_to_original(parts, unet_structure=SD15_UNET).merge(parts))


def _sd21_file(real):
    parts = {"unet": real["sd21_unet"], "vae": real["vae"], "text_encoder": real["vit_h"]}
    file = dict(C.plan_to_original(parts, text_encoder="openclip").merge(parts))
    for k, v in list(file.items()):  # ViT-H's 24th block and projection, as in the real file
        if ".resblocks.22." in k:
            file[k.replace(".resblocks.22.", ".resblocks.23.")] = v
    file[C.OPENCLIP_PREFIX + "text_projection"] = torch.empty(1024, 1024, device="meta")
    file[C.OPENCLIP_PREFIX + "logit_scale"] = torch.empty((), device="meta")
    return file


def test_real_sd15_keys(real):
    file = _sd15_file(real)
    # key names of the real v1-5-pruned file
    for key in ["model.diffusion_model.input_blocks.0.0.weight", "model.diffusion_model.input_blocks.3.0.op.weight",
                "model.diffusion_model.input_blocks.4.0.skip_connection.weight",
                "model.diffusion_model.input_blocks.8.1.transformer_blocks.0.attn2.to_k.weight",
                "model.diffusion_model.middle_block.1.proj_in.weight",
                "model.diffusion_model.output_blocks.2.1.conv.weight",
                "model.diffusion_model.output_blocks.5.2.conv.weight",
                "model.diffusion_model.output_blocks.11.0.skip_connection.weight",
                "model.diffusion_model.output_blocks.11.1.proj_out.weight",
                "model.diffusion_model.time_embed.2.weight", "model.diffusion_model.out.2.weight",
                "first_stage_model.decoder.up.3.upsample.conv.weight",
                "first_stage_model.decoder.up.0.block.0.nin_shortcut.weight",
                "first_stage_model.encoder.mid.attn_1.proj_out.weight",
                "cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc2.weight"]:
        assert key in file, key
    assert file["model.diffusion_model.middle_block.1.proj_in.weight"].shape == (1280, 1280, 1, 1)
    assert file["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (512, 512, 1, 1)
    assert len([k for k in file if k.startswith(C.UNET_PREFIX)]) == 686
    assert_same(convert_ldm_unet_checkpoint(file, SD15_UNET), real["sd15_unet"])
    assert_same(convert_ldm_vae_checkpoint(file, SD_VAE), real["vae"])
    assert_same(convert_ldm_clip_checkpoint(file), real["clip_l"])
    plan = C.plan_from_original(file, expected={"unet": real["sd15_unet"], "vae": real["vae"],
                                                "text_encoder": real["clip_l"]})
    for name, state in (("unet", real["sd15_unet"]), ("vae", real["vae"]), ("text_encoder", real["clip_l"])):
        assert_clean(plan.components[name])
        assert_same(plan.components[name].materialize(file), state)


def test_real_sd21_keys(real):
    file = _sd21_file(real)
    assert file["model.diffusion_model.input_blocks.1.1.proj_in.weight"].shape == (320, 320)
    assert file[C.OPENCLIP_PREFIX + "transformer.resblocks.0.attn.in_proj_weight"].shape == (3072, 1024)
    assert_same(convert_ldm_unet_checkpoint(file, SD21_UNET), real["sd21_unet"])
    # diffusers drops resblocks.23 and text_projection of SD 2.x by name
    assert_same(convert_open_clip_checkpoint(real["vit_h_model"], file), real["vit_h"])
    plan = C.plan_from_original(file, expected={"unet": real["sd21_unet"], "vae": real["vae"],
                                                "text_encoder": real["vit_h"]})
    for name, state in (("unet", real["sd21_unet"]), ("vae", real["vae"]), ("text_encoder", real["vit_h"])):
        assert_clean(plan.components[name])
        assert_same(plan.components[name].materialize(file), state)
    te_ignored = plan.components["text_encoder"].ignored
    assert len([k for k in te_ignored if ".resblocks.23." in k]) == 12
    # without `expected`, the default (file layers - 1) gives the same 23-layer model
    assert sorted(C.openclip_from_original(file).entries) == sorted(real["vit_h"])


# --- detection -----------------------------------------------------------------------------------------


def test_detect_sd15(real):
    d = detect(shapes_of(_sd15_file(real)))
    assert (d.layout, d.family, d.components) == ("original", "sd1", ("unet", "vae", "text_encoder"))
    u = d.unet
    assert (u.in_channels, u.out_channels, u.block_channels, u.layers_per_block) == (4, 4, (320, 640, 1280, 1280), 2)
    assert u.attention == (True, True, True, False) and u.up_attention == (False, True, True, True)
    assert (u.context_dim, u.linear_projection, u.heads, u.channel_mult) == (768, False, (8, 8, 8, 8), (1, 2, 4, 4))
    assert u.transformer_depth == (1, 1, 1, 0) and u.time_embed_dim == 1280
    assert u.structure == C.UNetStructure.from_diffusers_config(SD15_UNET)
    v = d.vae
    assert (v.block_channels, v.layers_per_block, v.latent_channels, v.in_channels) == ((128, 256, 512, 512), 2, 4, 3)
    t = d.text_encoder
    assert (t.kind, t.width, t.layers, t.heads, t.mlp_width, t.activation, t.vocab_size, t.max_positions) == (
        "clip", 768, 12, 12, 3072, "quick_gelu", 49408, 77)
    assert d.prediction_type is None and not d.has_ema


def test_detect_sd21_and_prediction_metadata(real):
    file = shapes_of(_sd21_file(real))
    d = detect(file)
    assert (d.layout, d.family) == ("original", "sd2")
    assert (d.unet.context_dim, d.unet.linear_projection, d.unet.heads) == (1024, True, (5, 10, 20, 20))
    t = d.text_encoder
    assert (t.kind, t.width, t.layers, t.source_layers, t.heads, t.mlp_width, t.activation) == (
        "openclip", 1024, 23, 24, 16, 4096, "gelu")
    assert d.prediction_type is None
    d = detect(file, metadata={"modelspec.prediction_type": "v"})
    assert (d.prediction_type, d.prediction_source) == ("v_prediction", "metadata modelspec.prediction_type='v'")
    assert detect(file, {"modelspec.architecture": "stable-diffusion-v2-768-v"}).prediction_type == "v_prediction"
    assert detect(file, {"modelspec.prediction_type": "epsilon"}).prediction_type == "epsilon"
    assert detect({**file, "v_pred": ()}).prediction_source == "marker key 'v_pred'"
    assert prediction_type_from_metadata({"ss_v_parameterization": "True"})[0] == "v_prediction"
    assert prediction_type_from_metadata({"modelspec.architecture": "stable-diffusion-v2-512"}) == (None, None)


@pytest.mark.parametrize("which", ["sd1", "sd2"])
def test_detect_inpainting(real, which):
    file = shapes_of(_sd15_file(real) if which == "sd1" else _sd21_file(real))
    file["model.diffusion_model.input_blocks.0.0.weight"] = (320, 9, 3, 3)
    d = detect(file)
    assert d.family == f"{which}-inpaint" and d.inpainting and d.base_family == which and d.unet.in_channels == 9


def test_detect_other_input_channels_refused(real):
    file = shapes_of(_sd15_file(real))
    file["model.diffusion_model.input_blocks.0.0.weight"] = (320, 8, 3, 3)
    with pytest.raises(UnsupportedModelError, match=r"8 input channels \(instruct-pix2pix-like\)"):
        detect(file)


def test_detect_diffusers_folder(real):
    d = detect({"unet": shapes_of(real["sd21_unet"]), "vae": shapes_of(real["vae"]),
                "text_encoder": shapes_of(real["vit_h"])})
    assert (d.layout, d.family, d.components) == ("diffusers", "sd2", ("unet", "vae", "text_encoder"))
    assert d.text_encoder.layers == 23 and d.text_encoder.activation == "gelu"
    unet_only = detect(shapes_of(real["sd15_unet"]))
    assert (unet_only.layout, unet_only.family, unet_only.components) == ("diffusers", "sd1", ("unet",))


def test_detect_tiny_inpaint_roundtrip_shapes():
    cfg = TINY_UNETS["inpaint-9ch"]
    state = unet_state(cfg)
    d = detect(shapes_of(C.unet_to_original(state, cfg).materialize(state)))
    assert d.family == "sd1-inpaint" and d.components == ("unet",)
    assert d.unet.block_channels == (32, 64) and d.unet.attention == (False, True) and d.unet.layers_per_block == 1


def test_detect_context_mismatch_is_named(real):
    file = shapes_of(_sd15_file(real))
    file["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"] = (49408, 1024)
    with pytest.raises(UnsupportedModelError, match="context dim 768.*does not match the text encoder width 1024"):
        detect(file)


def test_detect_incomplete_or_mixed_sdxl_refused(real):
    """SDXL files load (tests/test_sdxl_single_file.py); what is refused is a file that mixes the SD 1.x/2.x and
    SDXL layouts, or SDXL-looking keys that do not make a model."""
    file = shapes_of(_sd15_file(real))
    file["conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias"] = (1280,)
    with pytest.raises(UnsupportedModelError, match=r"both SD 1\.x/2\.x \('cond_stage_model\.'\) and SDXL"):
        detect(file)
    unet_only = {"model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
                 "model.diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3)}
    with pytest.raises(UnsupportedModelError, match=r"SDXL-like checkpoint \(has 'model\.diffusion_model\.label_emb"):
        detect(unet_only)
    with pytest.raises(UnsupportedModelError, match="no UNet 'down_blocks' keys"):
        detect({"add_embedding.linear_1.weight": (1280, 2816), "conv_in.weight": (320, 4, 3, 3)})


def test_detect_lora_refused():
    kohya = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": (4, 320, 1, 1),
             "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": (320, 4, 1, 1),
             "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": ()}
    with pytest.raises(UnsupportedModelError, match=r"a LoRA/LyCORIS adapter \(3 tensors.*not a full model"):
        detect(kohya)
    peft = {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": (4, 320)}
    with pytest.raises(UnsupportedModelError, match="LoRA"):
        detect(peft)


def test_detect_vae_only_and_other_files_refused(real):
    vae_original = {k.removeprefix(C.VAE_PREFIX): v for k, v in C.vae_to_original(real["vae"]).shapes(
        shapes_of(real["vae"])).items()}
    with pytest.raises(UnsupportedModelError, match=r"a standalone VAE in the original layout \(\d+ tensors\)"):
        detect(vae_original)
    with pytest.raises(UnsupportedModelError, match="a standalone VAE in the diffusers layout"):
        detect(shapes_of(real["vae"]))
    with pytest.raises(UnsupportedModelError, match="a standalone text encoder"):
        detect(shapes_of(real["clip_l"]))
    with pytest.raises(UnsupportedModelError, match="textual-inversion embedding"):
        detect({"emb_params": (2, 768)})
    with pytest.raises(UnsupportedModelError, match="ControlNet"):
        detect({"control_model.time_embed.0.weight": (1280, 320)})
    with pytest.raises(UnsupportedModelError, match=r"not a Stable Diffusion checkpoint: no UNet found \(1 tensors, "
                                                    r"first keys: 'fc.weight'"):
        detect({"fc.weight": (10, 10)})
    assert describe(list(_sd15_file(real))) is None


def test_detected_configs_feed_sdlite_configs(real):
    config = pytest.importorskip("sdlite.config")
    import dataclasses

    d15 = detect(shapes_of(_sd15_file(real)))
    d21 = detect(shapes_of(_sd21_file(real)))
    for d, spec in ((d15, config.SD15), (d21, config.SD21_BASE)):
        assert dataclasses.replace(spec.unet, **d.unet.config_kwargs()) == spec.unet
        assert dataclasses.replace(spec.vae, **d.vae.config_kwargs()) == spec.vae
        assert dataclasses.replace(spec.text, **d.text_encoder.config_kwargs()) == spec.text
        assert C.UNetStructure.from_diffusers_config(spec.unet) == d.unet.structure
