"""SDXL single files in Stability's original (SGM) layout: sd_xl_base_1.0, sd_xl_refiner_1.0, sd_xl_turbo_1.0_fp16.

Tiny SDXL pipelines are built with diffusers/transformers (random weights, from configs) and written in the SGM
layout by a key mapping written here, from the published convention, independently of sdlite's tables. diffusers'
own single-file loader proves that mapping: it must read every tensor back unchanged. Then sdlite must detect the
family, build the right spec and load components whose outputs match the diffusers modules.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import save_file

from sdlite.config import PRESETS, PUBLISHED_SCHEDULERS, SDXL_BASE, SDXL_REFINER
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from tests.reference import diffusers_unet, diffusers_vae, max_rel_err, seed_all, write_hf_tokenizer_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4

# SDXL in small, following the presets' conventions where shapes cannot tell (64-wide heads, token ids, the VAE's
# scaling factor): CLIP ViT-L-like (quick-GELU) and bigG-like (GELU, a non-square projection) text towers, a
# three-level UNet (no attention at the first level, depths 2 and 3), size/crop ids of 8 channels
TEXT_L = dataclasses.replace(SDXL_BASE.text, vocab_size=1000, width=64, layers=2, heads=1, mlp_width=96)
TEXT_G = dataclasses.replace(SDXL_BASE.text2, vocab_size=1000, width=128, layers=3, heads=2, mlp_width=160,
                             projection_dim=96)
UNET_BASE = dataclasses.replace(SDXL_BASE.unet, block_channels=(64, 128, 128), heads=(1, 2, 2),
                                context_dim=64 + 128, transformer_depth=(1, 2, 3), addition_time_embed_dim=8,
                                add_embed_in=96 + 6 * 8)
# the refiner's shape: bigG alone, four levels with attention at the middle two, 5 time ids
UNET_REFINER = dataclasses.replace(SDXL_REFINER.unet, block_channels=(64, 128, 128, 128), heads=(1, 2, 2, 2),
                                   context_dim=128, transformer_depth=2, addition_time_embed_dim=8,
                                   add_embed_in=96 + 5 * 8)
VAE = dataclasses.replace(SDXL_BASE.vae, block_channels=(32, 64), layers_per_block=1)

# --- the SGM layout, written from the published convention (test-side, independent of sdlite's tables) ---------

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def sgm_unet_key(key: str, attention: tuple[bool, ...], lpb: int) -> str:
    """A diffusers UNet2DConditionModel key -> its name under ``model.diffusion_model.``."""
    levels = len(attention)
    rules = [
        (r"time_embedding\.linear_1\.(.+)", lambda m: f"time_embed.0.{m[1]}"),
        (r"time_embedding\.linear_2\.(.+)", lambda m: f"time_embed.2.{m[1]}"),
        (r"add_embedding\.linear_1\.(.+)", lambda m: f"label_emb.0.0.{m[1]}"),
        (r"add_embedding\.linear_2\.(.+)", lambda m: f"label_emb.0.2.{m[1]}"),
        (r"conv_in\.(.+)", lambda m: f"input_blocks.0.0.{m[1]}"),
        (r"conv_norm_out\.(.+)", lambda m: f"out.0.{m[1]}"),
        (r"conv_out\.(.+)", lambda m: f"out.2.{m[1]}"),
        (r"down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.+)",
         lambda m: f"input_blocks.{1 + int(m[1]) * (lpb + 1) + int(m[2])}.0.{_RESNET[m[3]]}.{m[4]}"),
        (r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)",
         lambda m: f"input_blocks.{1 + int(m[1]) * (lpb + 1) + int(m[2])}.1.{m[3]}"),
        (r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)",
         lambda m: f"input_blocks.{(int(m[1]) + 1) * (lpb + 1)}.0.op.{m[2]}"),
        (r"mid_block\.resnets\.(\d)\.(\w+)\.(.+)", lambda m: f"middle_block.{2 * int(m[1])}.{_RESNET[m[2]]}.{m[3]}"),
        (r"mid_block\.attentions\.0\.(.+)", lambda m: f"middle_block.1.{m[1]}"),
        (r"up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.+)",
         lambda m: f"output_blocks.{int(m[1]) * (lpb + 1) + int(m[2])}.0.{_RESNET[m[3]]}.{m[4]}"),
        (r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)",
         lambda m: f"output_blocks.{int(m[1]) * (lpb + 1) + int(m[2])}.1.{m[3]}"),
        # the upsampler follows the level's last resnet (and its transformer, where the level has one)
        (r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)",
         lambda m: f"output_blocks.{int(m[1]) * (lpb + 1) + lpb}."
                   f"{2 if attention[levels - 1 - int(m[1])] else 1}.conv.{m[2]}"),
    ]
    for pattern, name in rules:
        m = re.fullmatch(pattern, key)
        if m:
            return name(m)
    raise AssertionError(f"no SGM name for UNet key {key}")


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def sgm_vae(state: dict, levels: int) -> dict:
    out = {}
    for key, value in state.items():
        name = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        name = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.",
                      lambda m: f"decoder.up.{levels - 1 - int(m[1])}.block.", name)
        name = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                      lambda m: f"decoder.up.{levels - 1 - int(m[1])}.upsample.", name)
        name = re.sub(r"mid_block\.resnets\.(\d)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", name)
        m = re.fullmatch(r"(.+)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(weight|bias)", name)
        if m:
            name = f"{m[1]}.mid.attn_1.{_VAE_ATTN[m[2]]}.{m[3]}"
            if m[2] != "group_norm" and m[3] == "weight":
                value = value.reshape(*value.shape, 1, 1)  # 1x1 convolutions in the original VAE
        out["first_stage_model." + name] = value
    return out


def sgm_clip_l(state: dict) -> dict:
    """transformers' CLIPTextModel -> ``conditioner.embedders.0.transformer.text_model.*`` (with the position_ids
    buffer the released files carry)."""
    out = {"conditioner.embedders.0.transformer." + (k if k.startswith("text_model.") else "text_model." + k): v
           for k, v in state.items() if not k.endswith("position_ids")}
    out["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.arange(77)[None]
    return out


_OPENCLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                   "self_attn.out_proj": "attn.out_proj"}


def sgm_bigg(state: dict, prefix: str) -> dict:
    """transformers' CLIPTextModelWithProjection -> an OpenCLIP text tower under ``prefix``: fused in_proj, the
    projection as the (width, proj) matrix of ``x @ text_projection``, and the unused ``logit_scale``."""
    out = {prefix + "logit_scale": torch.tensor(4.6052)}
    for key, value in state.items():
        if key.endswith("position_ids"):
            continue
        key = key.removeprefix("text_model.")
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = value.t().contiguous()
        elif key == "embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = value
        elif key == "embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = value
        elif key.startswith("final_layer_norm."):
            out[prefix + "ln_final." + key.split(".")[-1]] = value
        else:
            m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
            layer, module, param = m[1], m[2], m[3]
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                if module.endswith("q_proj"):
                    parts = [state[f"text_model.encoder.layers.{layer}.self_attn.{p}_proj.{param}"] for p in "qkv"]
                    out[f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{param}"] = torch.cat(parts)
            else:
                out[f"{prefix}transformer.resblocks.{layer}.{_OPENCLIP_LAYER[module]}.{param}"] = value
    return out


def sgm_file(pipe, unet_cfg) -> dict:
    """The whole pipeline in the SGM layout (the refiner: bigG is embedder 0)."""
    unet = {"model.diffusion_model." + sgm_unet_key(k, unet_cfg.attention, unet_cfg.layers_per_block): v
            for k, v in pipe.unet.state_dict().items()}
    out = {**unet, **sgm_vae(pipe.vae.state_dict(), len(VAE.block_channels))}
    if pipe.text_encoder is not None:
        out.update(sgm_clip_l(pipe.text_encoder.state_dict()))
        out.update(sgm_bigg(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model."))
    else:
        out.update(sgm_bigg(pipe.text_encoder_2.state_dict(), "conditioner.embedders.0.model."))
    return {k: v.detach().contiguous() for k, v in out.items()}


# --- the reference pipelines ------------------------------------------------------------------------------------


def clip_text(cfg, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(CLIPTextConfig(**d, attn_implementation="eager")).eval()


def sdxl_pipeline(folder, refiner: bool, seed: int):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    unet_cfg = UNET_REFINER if refiner else UNET_BASE
    torch.manual_seed(seed)
    unet = seed_all(diffusers_unet(unet_cfg), seed, scale=0.05)
    vae = seed_all(diffusers_vae(VAE), seed + 1, scale=0.05)
    text_2 = seed_all(clip_text(TEXT_G, projection=True), seed + 3, scale=0.2)
    tokenizer_2 = CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(folder.parent / "tok2", pad_token="!")))
    scheduler = EulerDiscreteScheduler.from_config(PUBLISHED_SCHEDULERS["sdxl"][1])
    if refiner:
        pipe = StableDiffusionXLImg2ImgPipeline(vae=vae, text_encoder=None, text_encoder_2=text_2, tokenizer=None,
                                                tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
                                                requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    else:
        text = seed_all(clip_text(TEXT_L, projection=False), seed + 2, scale=0.2)
        tokenizer = CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(folder.parent / "tok1")))
        pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text, text_encoder_2=text_2, tokenizer=tokenizer,
                                         tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Base and refiner: the diffusers pipeline, its folder (the config diffusers reads single files with) and the
    SGM single file; plus an fp16 copy of the base and a copy whose metadata names it SDXL Turbo."""
    root = tmp_path_factory.mktemp("sdxl")
    out = {}
    for name, refiner, seed in (("base", False, 0), ("refiner", True, 10)):
        folder = root / name / "folder"
        folder.parent.mkdir()
        pipe = sdxl_pipeline(folder, refiner, seed)
        tensors = sgm_file(pipe, UNET_REFINER if refiner else UNET_BASE)
        path = root / name / f"sd_xl_{name}.safetensors"
        save_file(tensors, path)
        out[name] = (pipe, folder, path, tensors)
    tensors = out["base"][3]
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()},
              root / "sd_xl_base_fp16.safetensors")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()},
              root / "sd_xl_turbo_1.0_fp16.safetensors",
              metadata={"modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "stable-diffusion-xl-v1-base",
                        "modelspec.implementation": "sgm", "modelspec.title": "SDXL Turbo",
                        "modelspec.resolution": "512x512"})
    out["fp16"] = root / "sd_xl_base_fp16.safetensors"
    out["turbo"] = root / "sd_xl_turbo_1.0_fp16.safetensors"
    return out


# --- the test-side layout is the published one ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "refiner"])
def test_diffusers_reads_the_written_layout_back(files, name):
    pipe, folder, path, tensors = files[name]
    assert any(k.startswith("conditioner.embedders.") for k in tensors)
    assert "model.diffusion_model.label_emb.0.0.weight" in tensors
    check_diffusers_reads(pipe, folder, path, refiner=name == "refiner")


def check_diffusers_reads(pipe, folder, path, refiner: bool):
    """diffusers' single-file loader, given the pipeline's own folder as config, reads ``path`` back into exactly the
    tensors of ``pipe``."""
    from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLImg2ImgPipeline if refiner else StableDiffusionXLPipeline
    back = cls.from_single_file(str(path), config=str(folder), local_files_only=True, torch_dtype=torch.float32)
    for component in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ref = getattr(pipe, component)
        if ref is None:
            assert getattr(back, component) is None
            continue
        got = getattr(back, component).state_dict()
        expected = {k: v for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
        assert set(expected) <= set(got), f"{component}: {sorted(set(expected) - set(got))[:3]}"
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{component}.{key}"


# --- sdlite reads it --------------------------------------------------------------------------------------------


def _text_ids(eos: int = 999, lengths=(5, 12)) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    rows = []
    for n in lengths:  # BOS, words, EOS (the largest id: bigG's legacy config finds it by argmax), padding
        rows.append([998] + torch.randint(1, 990, (n,), generator=g).tolist() + [eos] + [0] * (77 - n - 2))
    return torch.tensor(rows)


def check_outputs(ckpt, pipe, unet_cfg, as_stored=None):
    """Every component sdlite loads from ``ckpt`` against the diffusers/transformers module (optionally with its
    weights rounded as the file stores them)."""
    ids = _text_ids()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in ("text_encoder", "text_encoder_2"):
            ref = getattr(pipe, name)
            if ref is None:
                assert name not in ckpt.sources
                continue
            ref = as_stored(ref) if as_stored else ref
            ours = ckpt.load(name)
            out = ref(ids, output_hidden_states=True)
            if name == "text_encoder_2":
                hidden, pooled = ours.encode(ids, clip_skip=2, final_norm=False, pooled=True)
                assert max_rel_err(pooled, out.text_embeds) <= TOL
            else:
                hidden = ours.encode(ids, clip_skip=2, final_norm=False)
                assert max_rel_err(ours(ids), out.last_hidden_state) <= TOL
            assert max_rel_err(hidden, out.hidden_states[-2]) <= TOL  # what SDXL conditions on
        ref = as_stored(pipe.unet) if as_stored else pipe.unet
        unet = ckpt.load("unet")
        x = torch.randn(2, 4, 16, 24, generator=g)
        ctx = torch.randn(2, 11, unet_cfg.context_dim, generator=g)
        n_ids = (unet_cfg.add_embed_in - TEXT_G.projection_dim) // unet_cfg.addition_time_embed_dim
        text_embeds = torch.randn(2, TEXT_G.projection_dim, generator=g)
        time_ids = torch.tensor([[1024.0, 768.0, 0.0, 64.0, 1024.0, 1024.0][:n_ids]] * 2)
        t = torch.tensor([999.0, 17.5])
        expected = ref(x, t, encoder_hidden_states=ctx,
                       added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample
        assert max_rel_err(unet(x, t, ctx, text_embeds=text_embeds, time_ids=time_ids), expected) <= TOL
        ref = as_stored(pipe.vae) if as_stored else pipe.vae
        vae = ckpt.load("vae")
        img = torch.rand(1, 3, 16, 24, generator=g) * 2 - 1
        z = torch.randn(1, 4, 8, 12, generator=g)
        mean, _ = vae.encode_moments(img)
        assert max_rel_err(mean, ref.encode(img).latent_dist.mean) <= TOL
        assert max_rel_err(vae.decode(z), ref.decode(z).sample) <= TOL


def test_base_file(files):
    pipe, _, path, _ = files["base"]
    with open_model(path) as ckpt:
        assert ckpt.layout == "original" and ckpt.detection.family == "sdxl" and not ckpt.detection.turbo
        assert set(ckpt.sources) == {"text_encoder", "text_encoder_2", "unet", "vae"}
        spec = ckpt.spec
        assert (spec.family, spec.is_sdxl, spec.turbo, spec.prediction_type) == ("sdxl", True, False, "epsilon")
        assert spec.text == TEXT_L and spec.text2 == TEXT_G and spec.unet == UNET_BASE and spec.vae == VAE
        assert spec.force_zeros_for_empty_prompt and not spec.requires_aesthetics_score
        assert spec.default_size == 1024 and spec.scheduler == SDXL_BASE.scheduler
        assert ckpt.scheduler_config["timestep_spacing"] == "leading"
        assert "stable-diffusion-xl-base-1.0" in ckpt.scheduler_source
        assert ckpt.storage_dtype == torch.float32 and ckpt.problems() == []
        assert not ckpt.notes  # logit_scale and position_ids are known and ignored, nothing is left over
        counts = ckpt.parameter_counts()
        for name in ("text_encoder", "text_encoder_2", "unet", "vae"):
            module = getattr(pipe, name)
            assert counts[name] == sum(p.numel() for p in module.parameters()), name
        check_outputs(ckpt, pipe, UNET_BASE)


def test_refiner_file(files):
    pipe, _, path, tensors = files["refiner"]
    assert not any(k.startswith("conditioner.embedders.1.") for k in tensors)
    with open_model(path) as ckpt:
        spec = ckpt.spec
        assert ckpt.detection.family == spec.family == "sdxl-refiner"
        assert set(ckpt.sources) == {"text_encoder_2", "unet", "vae"}
        assert spec.text is None and spec.text2 == TEXT_G and spec.text_encoders == ("text_encoder_2",)
        assert spec.unet == UNET_REFINER and spec.vae == VAE
        assert spec.requires_aesthetics_score and not spec.force_zeros_for_empty_prompt
        assert "stable-diffusion-xl-refiner-1.0" in ckpt.scheduler_source and ckpt.problems() == []
        check_outputs(ckpt, pipe, UNET_REFINER)


def _rounded(module):
    """A copy of ``module`` with its weights rounded to fp16 and back (what an fp16 file stores)."""
    import copy

    module = copy.deepcopy(module)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())
    return module


def test_fp16_file(files):
    pipe = files["base"][0]
    with open_model(files["fp16"]) as ckpt:
        assert ckpt.detection.family == "sdxl" and ckpt.storage_dtype == torch.float16
        assert ckpt.spec.unet == UNET_BASE and ckpt.spec.text2 == TEXT_G
        assert ckpt.load("unet", torch.float16).conv_in.weight.dtype == torch.float16
        check_outputs(ckpt, pipe, UNET_BASE, as_stored=_rounded)


def test_turbo_metadata(files):
    with open_model(files["turbo"]) as ckpt:
        spec = ckpt.spec
        assert ckpt.detection.turbo and "SDXL Turbo" in ckpt.detection.turbo_source
        assert (spec.family, spec.turbo, spec.default_size) == ("sdxl", True, 512)
        assert spec.unet == dataclasses.replace(UNET_BASE, sample_size=PRESETS["sdxl-turbo"].unet.sample_size)
        repo, published = PUBLISHED_SCHEDULERS["sdxl-turbo"]
        assert repo in ckpt.scheduler_source and ckpt.scheduler_config["timestep_spacing"] == "trailing"
        assert ckpt.scheduler_config["_class_name"] == published["_class_name"]
        ckpt.load("unet")


# --- what is not SDXL, or not whole, is told ---------------------------------------------------------------


def test_detection_errors(files):
    from sdlite.weights.detect import UnsupportedModelError, detect

    shapes = {k: tuple(v.shape) for k, v in files["base"][3].items()}
    bigg = "conditioner.embedders.1.model."
    # an SD 1.x text encoder beside SDXL's
    mixed = {**shapes, "cond_stage_model.transformer.text_model.final_layer_norm.weight": (64,)}
    with pytest.raises(UnsupportedModelError, match=r"both SD 1\.x/2\.x \('cond_stage_model\.'\) and SDXL"):
        detect(mixed)
    # bigG without its projection (the pooled embedding cannot be made)
    with pytest.raises(UnsupportedModelError, match=rf"no projection \('{re.escape(bigg)}text_projection' is missing"):
        detect({k: v for k, v in shapes.items() if k != bigg + "text_projection"})
    # widths that do not add up to the UNet's context
    wide = {**shapes, bigg + "token_embedding.weight": (1000, 160)}
    with pytest.raises(UnsupportedModelError, match=r"context dim 192 .* not the width of its text encoders "
                                                    r"\(64 \+ 160"):
        detect(wide)
    # an added-conditioning input that is not the pooled text plus 6 ids of one width
    odd = {**shapes, "model.diffusion_model.label_emb.0.0.weight": (256, 96 + 6 * 8 + 1)}
    with pytest.raises(UnsupportedModelError, match=r"input width 145 .* pooled text embedding \(96"):
        detect(odd)
    # an SDXL-like file too incomplete to read says what it looks like
    with pytest.raises(UnsupportedModelError, match=r"an SDXL-like checkpoint \(has 'conditioner\.embedders.*but"):
        detect({k: v for k, v in shapes.items() if not k.startswith("model.diffusion_model.output_blocks.")})
    # a UNet with SDXL's context width but no added conditioning; one with added conditioning but an SD 2.x tower
    unet_only = {k: v for k, v in shapes.items() if k.startswith("model.diffusion_model.")}
    plain = {k: v for k, v in unet_only.items() if ".label_emb." not in k}
    assert detect(unet_only).family == "sdxl" and detect(unet_only).components == ("unet",)
    for k in [k for k in plain if k.endswith("attn2.to_k.weight") or k.endswith("attn2.to_v.weight")]:
        plain[k] = (plain[k][0], 2048)
    with pytest.raises(UnsupportedModelError, match=r"context dim is 2048 \(SDXL's\) but it has no added conditioning"):
        detect(plain)
    # SDXL inpainting is not supported (9 input channels)
    inpaint = {**shapes, "model.diffusion_model.input_blocks.0.0.weight": (64, 9, 3, 3)}
    with pytest.raises(UnsupportedModelError, match=r"SDXL UNet has 9 input channels"):
        detect(inpaint)


# --- errors name the file and the key ---------------------------------------------------------------------------


def test_missing_key(files, tmp_path):
    tensors = dict(files["base"][3])
    del tensors["conditioner.embedders.1.model.transformer.resblocks.2.attn.in_proj_weight"]
    save_file(tensors, tmp_path / "cut.safetensors")
    with open_model(tmp_path / "cut.safetensors") as ckpt:
        ckpt.load("text_encoder")  # the intact parts still load
        with pytest.raises(CheckpointError, match=r"cut\.safetensors: 3 text_encoder_2 keys are missing, first few: "
                                                  r"'text_model\.encoder\.layers\.2\.self_attn\.q_proj\.weight'"):
            ckpt.load("text_encoder_2")


def test_truncated_file(files, tmp_path):
    data = files["base"][2].read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"short\.safetensors"):
        open_model(tmp_path / "short.safetensors")


def test_shape_mismatch(files, tmp_path):
    tensors = dict(files["base"][3])
    key = "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"
    tensors[key] = torch.zeros(3 * 130, 128)
    key2 = "model.diffusion_model.output_blocks.1.1.proj_in.weight"
    tensors[key2] = torch.zeros(128, 130)
    save_file(tensors, tmp_path / "bad.safetensors")
    with open_model(tmp_path / "bad.safetensors") as ckpt:
        with pytest.raises(CheckpointError, match=rf"bad\.safetensors: tensor '{re.escape(key)}': the "
                                                  r"text_encoder_2 tensor has shape \[130, 128\] but the detected "
                                                  r"model needs \[128, 128\]"):
            ckpt.load("text_encoder_2")
        with pytest.raises(CheckpointError, match=rf"bad\.safetensors: tensor '{re.escape(key2)}': the unet tensor has "
                                                  r"shape \[128, 130\]"):
            ckpt.load("unet")


def test_written_layout_matches_real_file_key_names(files):
    """A few key names exactly as they appear in Stability's released files."""
    base, refiner = files["base"][3], files["refiner"][3]
    for key in ("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
                "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight",
                "conditioner.embedders.1.model.text_projection", "conditioner.embedders.1.model.ln_final.weight",
                "model.diffusion_model.label_emb.0.2.bias", "model.diffusion_model.input_blocks.3.0.op.weight",
                "model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight",
                "model.diffusion_model.output_blocks.2.2.conv.weight",
                "first_stage_model.decoder.up.0.block.0.conv1.weight"):
        assert key in base, key
    assert "conditioner.embedders.0.model.positional_embedding" in refiner


# --- the released files' key sets at full size (headers only) ---------------------------------------------------


def sparse_safetensors(path, tensors: dict, metadata: dict | None = None):
    """A safetensors file with the header of ``tensors`` (meta tensors will do) and a data section that is a hole
    in the file: opening reads only the header, so a full-size SDXL costs no disk and no time."""
    import json
    import struct

    codes = {torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for key, t in sorted(tensors.items()):
        n = t.numel() * t.element_size()
        header[key] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


# parameters of the released models (diffusers' UNet2DConditionModel, CLIPTextModel, CLIPTextModelWithProjection and
# AutoencoderKL built from the stabilityai/stable-diffusion-xl-{base,refiner}-1.0 configs)
FULL_SIZE_COUNTS = {
    "sdxl": {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840, "vae": 83_653_863},
    "sdxl-refiner": {"unet": 2_259_526_660, "text_encoder_2": 694_659_840, "vae": 83_653_863},
}


@pytest.mark.parametrize("family", ["sdxl", "sdxl-refiner"])
def test_full_size_files_give_the_presets(tmp_path, family):
    """The key set and shapes of sd_xl_base_1.0 / sd_xl_refiner_1.0 (fp16), made from the preset's networks by the
    test-side mapping, open as exactly the preset, with the released models' parameter counts. (Our networks' names
    are diffusers' and transformers', which the parity tests hold them to.)"""
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL

    preset = PRESETS[family]
    with torch.device("meta"):
        unet = UNet(preset.unet).half().state_dict()
        vae = AutoencoderKL(preset.vae).half().state_dict()
        text_2 = CLIPTextEncoder(preset.text2, projection=True).half().state_dict()
        text = CLIPTextEncoder(preset.text).half().state_dict() if preset.text is not None else None
        tensors = {"model.diffusion_model." + sgm_unet_key(k, preset.unet.attention, preset.unet.layers_per_block): v
                   for k, v in unet.items()}
        tensors.update(sgm_vae(vae, len(preset.vae.block_channels)))
        if text is not None:
            tensors.update(sgm_clip_l(text))
        tensors.update(sgm_bigg(text_2, f"conditioner.embedders.{0 if text is None else 1}.model."))
    path = sparse_safetensors(tmp_path / f"{family}.safetensors", tensors)
    with open_model(path) as ckpt:
        assert ckpt.detection.family == family and ckpt.storage_dtype == torch.float16
        assert ckpt.spec == preset
        assert ckpt.parameter_counts() == FULL_SIZE_COUNTS[family]
        assert ckpt.problems() == [] and not ckpt.notes


# --- writing them -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "refiner", "turbo"])
def test_export_writes_the_released_layout(files, tmp_path, name):
    """save_single_file writes what it read, key for key and bit for bit (all but the buffers nothing reads:
    CLIP's position_ids and OpenCLIP's logit_scale), and the file reads back as the same model."""
    from sdlite.export import save_single_file
    from sdlite.loader import load_model

    source = files[name] if name == "turbo" else files[name][2]
    original = files["base" if name == "turbo" else name][3]
    model = load_model(source, dtype=torch.float16 if name == "turbo" else torch.float32)
    written = save_single_file(model, tmp_path / "out.safetensors")
    from safetensors.torch import load_file

    back = load_file(written)
    skipped = {k for k in original if k.endswith(("position_ids", "logit_scale"))}
    assert set(back) == set(original) - skipped
    for key, value in back.items():
        assert torch.equal(value, original[key].to(value.dtype)), key
    with open_model(written) as ckpt:
        assert ckpt.spec == model.spec and ckpt.detection.turbo == (name == "turbo")
        assert ckpt.scheduler_config == model.scheduler_config
    if name != "turbo":  # and diffusers reads it without the buffers
        check_diffusers_reads(files[name][0], files[name][1], written, refiner=name == "refiner")
