"""LoRA (sdlite.adapters.lora): kohya/A1111 and diffusers/PEFT files, merged or applied on the fly, against diffusers'
``load_lora_weights`` + ``fuse_lora``; exact un-merging; refusals that name the file and the reason.

The coverage runs on the tiny model. Four LoRA cases (``PARITY_CASES``: kohya and PEFT, with and without LoCon
convolutions, alphas stored or implied, fp16 factors) also run as whole generations against diffusers' pipeline,
on the tiny model here and at the real SD 1.5 shapes in bench/parity.py, through the same functions; at the real
shapes the tests check on the meta device which layers each case's file reaches."""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdlite.adapters import lora as L
from sdlite.engine.packing import PackedConv2d, PackedLinear, prepack_available
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import diffusers_pipeline, saved_pipeline, use_scheduler, with_contrast

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "a red circle on a blue background"
NEGATIVE = "blurry, green"

ATTENTION = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
             "attn2.to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")
CONVS = ("conv1", "conv2", "conv_shortcut", "time_emb_proj")   # LoCon on the ResBlocks
TEXT = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


# --- building LoRA files ---------------------------------------------------------------------------------------


def layer_shapes(network) -> dict[str, tuple[int, ...]]:
    """Module path -> weight shape of every Linear / Conv2d (sdlite's networks, meta device is fine)."""
    return {name: tuple(m.weight.shape) for name, m in network.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


def targets(shapes, suffixes, every=1) -> dict[str, tuple[int, ...]]:
    chosen = sorted(n for n in shapes if n.endswith(tuple("." + s for s in suffixes)) or n in suffixes)
    return {n: shapes[n] for n in chosen[::every]}


def random_factors(shapes, rank, seed, strength=0.5):
    """name -> (down, up): ``up @ down`` has about ``strength / sqrt(fan_in)`` spread, as large as the weights
    of a default-initialised layer, so the image changes clearly. Kernels > 1x1 give LoCon factors."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        fan_in = int(np.prod(shape[1:]))
        down = torch.randn((rank, *shape[1:]), generator=g) / fan_in ** 0.5
        up = torch.randn((shape[0], rank, *([1, 1] if len(shape) == 4 else [])), generator=g) * strength / rank ** 0.5
        out[name] = (down, up)
    return out


def write_kohya(path, unet=None, te=None, alpha=None, dtype=torch.float32, names="diffusers", unet_network=None,
                metadata=None):
    """``unet`` / ``te``: name -> (down, up). ``names="ldm"`` spells the UNet's layers in the original layout."""
    rename = {}
    if names == "ldm":
        from sdlite.weights.convert import unet_to_original

        plan = unet_to_original([f"{n}.weight" for n in unet], unet_network.config, prefix="")
        rename = {e.sources[0][:-7]: k[:-7] for k, e in plan.entries.items()}
    state = {}
    for prefix, factors in (("lora_unet_", unet or {}), ("lora_te_", te or {})):
        for name, (down, up) in factors.items():
            key = prefix + rename.get(name, name).replace(".", "_")
            state[f"{key}.lora_down.weight"] = down.to(dtype).clone()
            state[f"{key}.lora_up.weight"] = up.to(dtype).clone()
            if alpha is not None:
                state[f"{key}.alpha"] = torch.tensor(float(alpha)).to(dtype)
    save_file(state, str(path), metadata=metadata)
    return path


def write_peft(path, unet=None, te=None, alpha=None, te_alpha=None, text_model_prefix=True, dtype=torch.float32):
    """diffusers' layout: ``unet.<module>.lora_A.weight``; alpha (when given) in ``lora_adapter_metadata`` as
    diffusers writes it, else implied = rank."""
    state, config = {}, {}
    for component, factors, a in (("unet", unet or {}, alpha), ("text_encoder", te or {}, te_alpha)):
        if component == "text_encoder" and not text_model_prefix:
            factors = {name.removeprefix("text_model."): f for name, f in factors.items()}
        for name, (down, up) in factors.items():
            state[f"{component}.{name}.lora_A.weight"] = down.to(dtype).clone()
            state[f"{component}.{name}.lora_B.weight"] = up.to(dtype).clone()
        if factors and a is not None:
            rank = next(iter(factors.values()))[0].shape[0]
            config.update({f"{component}.r": rank, f"{component}.lora_alpha": a, f"{component}.alpha_pattern": {},
                           f"{component}.rank_pattern": {}, f"{component}.use_dora": False,
                           f"{component}.use_rslora": False, f"{component}.peft_type": "LORA",
                           f"{component}.target_modules": sorted(factors)})
    metadata = {"format": "pt"}
    if config:
        metadata[L.METADATA_KEY] = json.dumps(config, indent=2, sort_keys=True)
    save_file(state, str(path), metadata=metadata)
    return path


# --- running ---------------------------------------------------------------------------------------------------


def request(size, steps, seed, sampler="euler"):
    return Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=steps, seed=seed, width=size, height=size,
                   sampler=sampler, cfg_scale=7.5)


def pixels(result) -> np.ndarray:
    return np.stack([np.asarray(im.convert("RGB")) for im in result.images]).astype(int)


def reference_pixels(pipe, r: Request) -> np.ndarray:
    use_scheduler(pipe, r.sampler)
    out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=r.steps, guidance_scale=r.cfg_scale,
               generator=[torch.Generator().manual_seed(r.seed)], height=r.height, width=r.width,
               output_type="np").images
    return (out * 255).round().astype(int)


def reference_with_lora(pipe, files_and_weights, r: Request) -> np.ndarray:
    """diffusers' own LoRA path: load_lora_weights, then fuse_lora(lora_scale=w); undone after."""
    pytest.importorskip("peft", reason="diffusers' load_lora_weights needs the PEFT backend (pip install peft)")
    names = []
    try:
        for i, (file, _) in enumerate(files_and_weights):
            pipe.load_lora_weights(str(file), adapter_name=f"l{i}")
            names.append(f"l{i}")
        if len(names) == 1:
            pipe.fuse_lora(lora_scale=files_and_weights[0][1], adapter_names=names)
        else:
            pipe.set_adapters(names, [w for _, w in files_and_weights])
            pipe.fuse_lora(adapter_names=names)
        return reference_pixels(pipe, r)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def diff(a, b) -> int:
    return int(np.abs(a - b).max())


# --- tiny model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_tiny")
    pipe = saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp)), tmp / "model")
    ckpt = open_model(tmp / "model")
    unet, te = ckpt.build_empty("unet"), ckpt.build_empty("text_encoder")
    return pipe, tmp / "model", unet, te, layer_shapes(unet), layer_shapes(te)


def unet_inputs(unet_config, batch=2, size=16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, unet_config.in_channels, size, size, generator=g)
    ctx = torch.randn(batch, 77, unet_config.context_dim, generator=g)
    return x, torch.tensor([500.0, 20.0][:batch]), ctx


def token_ids(pipe):
    return pipe.tokenizer(PROMPT, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids


def diffusers_outputs(pipe, files_and_weights, inputs, ids):
    """diffusers' UNet and text-encoder outputs with ``files_and_weights`` loaded and fused (none: without)."""
    pytest.importorskip("peft", reason="diffusers' load_lora_weights needs the PEFT backend (pip install peft)")
    names = []
    try:
        for i, (file, _) in enumerate(files_and_weights):
            pipe.load_lora_weights(str(file), adapter_name=f"l{i}")
            names.append(f"l{i}")
        if len(names) == 1:
            pipe.fuse_lora(lora_scale=files_and_weights[0][1], adapter_names=names)
        elif names:
            pipe.set_adapters(names, [w for _, w in files_and_weights])
            pipe.fuse_lora(adapter_names=names)
        x, t, ctx = inputs
        with torch.no_grad():
            return pipe.unet(x, t, encoder_hidden_states=ctx).sample, pipe.text_encoder(ids)[0]
    finally:
        if names:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def tiny_nets(tiny):
    """Our networks from the tiny folder, plain fp32 (no prepacking), and fixed inputs."""
    pipe, folder, *_ = tiny
    ckpt = open_model(folder)
    unet, te = ckpt.load("unet"), ckpt.load("text_encoder")
    inputs, ids = unet_inputs(unet.config), token_ids(pipe)
    return unet, te, inputs, ids


def our_outputs(unet, te, inputs, ids):
    x, t, ctx = inputs
    with torch.no_grad():
        return unet(x, t, ctx), te(ids)


def weights_of(module):
    """Every weight tensor object of a network (plain or packed), by name: to check that restoring puts the
    very same objects back."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, (PackedConv2d, PackedLinear)):
            out[name] = m.packed
        elif isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            out[name] = m._parameters["weight"]
    return out


def _tiny_case(case, tiny, tmp_path):
    """(files and weights) of one named case on the tiny model."""
    _, _, _, _, us, ts = tiny
    unet_locon = targets(us, ATTENTION + CONVS + ("downsamplers.0.conv", "upsamplers.0.conv"))
    if case == "kohya-r4":
        f = write_kohya(tmp_path / "k4.safetensors", random_factors(targets(us, ATTENTION), 4, 1),
                        random_factors(targets(ts, TEXT), 4, 2), alpha=2)
        return [(f, 1.0)]
    if case == "kohya-locon-r8-fp16":
        f = write_kohya(tmp_path / "k8.safetensors", random_factors(unet_locon, 8, 3),
                        random_factors(targets(ts, TEXT), 8, 4), alpha=4, dtype=torch.float16)
        return [(f, 0.5)]
    if case == "peft-r8-alpha":
        f = write_peft(tmp_path / "p8.safetensors", random_factors(targets(us, ATTENTION), 8, 5),
                       random_factors(targets(ts, TEXT), 8, 6), alpha=4, te_alpha=16, text_model_prefix=False)
        return [(f, 0.5)]
    if case == "peft-r4-conv-implied-alpha":
        f = write_peft(tmp_path / "p4.safetensors", random_factors(unet_locon, 4, 7),
                       random_factors(targets(ts, TEXT), 4, 8))
        return [(f, 1.0)]
    if case == "two-loras":
        return _tiny_case("kohya-r4", tiny, tmp_path) + [(_tiny_case("peft-r8-alpha", tiny, tmp_path)[0][0], -0.4)]
    raise AssertionError(case)


# The LoRA files of whole-generation parity, for the layers of any SD 1.x network (the tiny model's here, SD 1.5's
# in bench/parity.py and on the meta device below): (file, multiplier) lists by case.
PARITY_CASES = ["kohya-r4", "kohya-locon-r8-fp16", "peft-r8-alpha", "peft-r4-conv-implied-alpha"]


def parity_files(unet_shapes, te_shapes, folder) -> dict[str, list]:
    """``unet_shapes`` / ``te_shapes``: :func:`layer_shapes` of the model's networks; the files go to ``folder``.
    kohya rank 4 with alpha on attention; kohya LoCon rank 8, fp16, also on the ResBlocks' convolutions;
    PEFT rank 8 with alphas in diffusers' metadata and text-encoder keys without ``text_model.``; PEFT rank 4 with
    implied alphas on every other attention layer and the ResBlocks."""
    us, ts = unet_shapes, te_shapes
    every_other = dict(list(targets(us, ATTENTION).items())[::2])
    return {
        "kohya-r4": [(write_kohya(folder / "k4.safetensors", random_factors(targets(us, ATTENTION), 4, 1),
                                  random_factors(targets(ts, TEXT), 4, 2), alpha=2), 1.0)],
        "kohya-locon-r8-fp16": [(write_kohya(folder / "k8.safetensors",
                                             random_factors(targets(us, ATTENTION + CONVS), 8, 3),
                                             random_factors(targets(ts, TEXT), 8, 4), alpha=8,
                                             dtype=torch.float16), 0.5)],
        "peft-r8-alpha": [(write_peft(folder / "p8.safetensors", random_factors(targets(us, ATTENTION), 8, 5),
                                      random_factors(targets(ts, TEXT), 8, 6), alpha=4, te_alpha=8,
                                      text_model_prefix=False), 1.0)],
        "peft-r4-conv-implied-alpha": [(write_peft(folder / "p4.safetensors",
                                                   random_factors({**every_other, **targets(us, CONVS)}, 4, 7),
                                                   random_factors(targets(ts, TEXT), 4, 8)), 0.5)],
    }


def parity_request(size: int) -> Request:
    """3 Euler steps at ``size`` x ``size``, seed 42."""
    return request(size, 3, 42, "euler")


def parity_case(engine, pipe, files, size):
    """(sdlite's pixels, diffusers' pixels) of one generation with ``files``: ``engine_with_loras`` against
    diffusers' ``load_lora_weights`` + ``fuse_lora``."""
    r = parity_request(size)
    expected = reference_with_lora(pipe, files, r)
    with L.engine_with_loras(engine, files):
        got = pixels(engine.generate(r))
    return got, expected


TINY_CASES = ["kohya-r4", "kohya-locon-r8-fp16", "peft-r8-alpha", "peft-r4-conv-implied-alpha", "two-loras"]


@pytest.mark.parametrize("case", TINY_CASES)
def test_merged_networks_match_diffusers(tiny, tiny_nets, tmp_path, case):
    """UNet and text-encoder outputs with the LoRA merged equal diffusers' (load_lora_weights + fuse_lora) to
    fp32 rounding; restore() puts the very same weight tensors back."""
    pipe = tiny[0]
    unet, te, inputs, ids = tiny_nets
    files = _tiny_case(case, tiny, tmp_path)
    base_unet, base_te = our_outputs(unet, te, inputs, ids)
    before = {**weights_of(unet), **{f"te.{k}": v for k, v in weights_of(te).items()}}
    ref_unet, ref_te = diffusers_outputs(pipe, files, inputs, ids)
    handles = [L.merge(unet, files, "unet"), L.merge(te, files, "text_encoder")]
    try:
        got_unet, got_te = our_outputs(unet, te, inputs, ids)
    finally:
        for h in reversed(handles):
            h.restore()
    assert rel(got_unet, ref_unet) < 1e-5 and rel(got_te, ref_te) < 1e-5
    assert rel(got_unet, base_unet) > 0.05 and rel(got_te, base_te) > 0.05   # the LoRA does change both
    after = {**weights_of(unet), **{f"te.{k}": v for k, v in weights_of(te).items()}}
    assert all(after[k] is before[k] for k in before)
    again_unet, again_te = our_outputs(unet, te, inputs, ids)
    assert torch.equal(again_unet, base_unet) and torch.equal(again_te, base_te)


@pytest.fixture(scope="module")
def tiny_parity(tiny, tmp_path_factory):
    """The tiny model with a UNet whose prediction matters to the image (its output layer x20; else the few steps'
    images are mostly the starting noise and a LoRA moves them by about one level), diffusers' pipeline and the
    engine as loaded by default (prepacked where this CPU gains from it) on it, its no-LoRA image, and the parity
    cases' files for its layers."""
    tmp = tmp_path_factory.mktemp("lora_parity")
    pipe = with_contrast(diffusers_pipeline("sd1", tmp))
    with torch.no_grad():
        pipe.unet.conv_out.weight.mul_(20)
    pipe = saved_pipeline(pipe, tmp / "model")
    engine = Engine.load(tmp / "model", precision="exact")
    base = pixels(engine.generate(parity_request(64)))
    return pipe, engine, base, parity_files(tiny[4], tiny[5], tmp)


@pytest.mark.parametrize("case", PARITY_CASES)
def test_engine_image_matches_diffusers(tiny_parity, case):
    """A whole generation (64x64, 3 Euler steps) with the LoRA: PNG pixels within 2/255 of diffusers'
    load_lora_weights + fuse_lora, clearly another image than without it; after the block the same engine gives
    the no-LoRA image bit for bit."""
    pipe, engine, base, files = tiny_parity
    got, expected = parity_case(engine, pipe, files[case], 64)
    assert diff(got, expected) <= 2
    assert np.abs(got - base).mean() > 8, "the LoRA should change the image clearly"
    assert np.array_equal(pixels(engine.generate(parity_request(64))), base)


def test_separate_unet_and_text_encoder_weights(tiny, tiny_nets, tiny_parity, tmp_path):
    """A weight per network ({"unet": a, "text_encoder": b}, ComfyUI's strength_model and strength_clip): the UNet
    and text-encoder outputs equal diffusers' set_adapters with the same per-component weights, and each network
    gets what its single weight gives it; through Request.loras, equal weights give the single weight's latents bit
    for bit and text-encoder weight 0 those of the file without its text-encoder layers."""
    pytest.importorskip("peft", reason="diffusers' load_lora_weights needs the PEFT backend (pip install peft)")
    pipe = tiny[0]
    unet, te, inputs, ids = tiny_nets
    ((file, _),) = _tiny_case("kohya-r4", tiny, tmp_path)
    split = {"unet": 0.8, "text_encoder": -0.6}
    pipe.load_lora_weights(str(file), adapter_name="split")
    try:
        pipe.set_adapters(["split"], adapter_weights=[split])
        with torch.no_grad():
            ref_unet, ref_te = pipe.unet(inputs[0], inputs[1], encoder_hidden_states=inputs[2]).sample, \
                pipe.text_encoder(ids)[0]
    finally:
        pipe.unload_lora_weights()

    def outputs(weight):
        handles = [L.merge(unet, [(file, weight)], "unet"), L.merge(te, [(file, weight)], "text_encoder")]
        try:
            return our_outputs(unet, te, inputs, ids)
        finally:
            for h in reversed(handles):
                h.restore()
    got_unet, got_te = outputs(split)
    assert rel(got_unet, ref_unet) < 1e-5 and rel(got_te, ref_te) < 1e-5
    assert torch.equal(got_unet, outputs(0.8)[0]) and torch.equal(got_te, outputs(-0.6)[1])
    assert rel(got_te, outputs(0.8)[1]) > 0.05

    _, engine, _, files = tiny_parity
    ((file, _),) = files["kohya-r4"]
    r = parity_request(64)
    whole = engine.generate(r.replace(loras=((str(file), 0.8),))).latents
    same = engine.generate(r.replace(loras=((str(file), {"unet": 0.8, "text_encoder": 0.8}),))).latents
    assert torch.equal(same, whole)
    unet_only = tmp_path / "unet_only.safetensors"
    save_file({k: v for k, v in load_file(str(file)).items() if not k.startswith("lora_te")}, str(unet_only))
    no_text = engine.generate(r.replace(loras=((str(file), {"unet": 0.8, "text_encoder": 0}),))).latents
    assert torch.equal(no_text, engine.generate(r.replace(loras=((str(unet_only), 0.8),))).latents)
    assert not torch.equal(no_text, whole)
    with pytest.raises(RequestError, match="'clip'"):
        engine.generate(r.replace(loras=((str(file), {"clip": 1.0}),)))


def test_legacy_diffusers_keys_equal_peft(tiny, tiny_nets, tmp_path):
    """The older diffusers spellings (attention processors' to_q_lora, lora_linear_layer, .lora.down) read as
    the same layers as PEFT's lora_A/lora_B."""
    _, _, _, _, us, ts = tiny
    unet_f = random_factors(targets(us, ("attn1.to_q", "attn2.to_out.0", "proj_in", "ff.net.2")), 4, 11)
    te_f = random_factors(targets(ts, ("q_proj", "out_proj", "fc1")), 4, 12)
    peft = L.read_lora(write_peft(tmp_path / "p.safetensors", unet_f, te_f))
    state = {}
    for name, (down, up) in unet_f.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("to_q", "0") and ".attn" in name:
            attn = name.removesuffix(".to_out.0").removesuffix(".to_q")
            proc = "to_q_lora" if leaf == "to_q" else "to_out_lora"
            stem = f"unet.{attn}.processor.{proc}"
        else:
            stem = f"unet.{name}.lora"
        state[f"{stem}.down.weight"], state[f"{stem}.up.weight"] = down, up
    for name, (down, up) in te_f.items():
        if name.endswith(("q_proj", "out_proj")):
            attn, _, leaf = name.rpartition(".")
            stem = f"text_encoder.{attn}.{'to_q_lora' if leaf == 'q_proj' else 'to_out_lora'}"
        else:
            stem = f"text_encoder.{name}.lora_linear_layer"
        state[f"{stem}.down.weight"], state[f"{stem}.up.weight"] = down, up
    save_file(state, str(tmp_path / "legacy.safetensors"))
    legacy = L.read_lora(tmp_path / "legacy.safetensors")
    assert legacy.format == "diffusers-legacy" and peft.format == "peft"
    unet, te, inputs, ids = tiny_nets
    for lora_file in (peft, legacy):
        assert {layer.target for layer in lora_file.layers_of("unet")} == set(unet_f)
        assert sorted(L.resolve_targets(te, lora_file, "text_encoder").values()) == sorted(te_f)
    outputs = []
    for lora_file in (peft, legacy):
        with L.merge(unet, [(lora_file, 0.9)], "unet"), L.merge(te, [(lora_file, 0.9)], "text_encoder"):
            outputs.append(our_outputs(unet, te, inputs, ids))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_ldm_names_give_the_same_merge(tiny, tiny_nets, tmp_path):
    """kohya files that spell the UNet in the original layout (input_blocks / middle_block / output_blocks) merge
    into the same layers, bit for bit, as the diffusers-named ones."""
    _, _, _, _, us, _ = tiny
    unet, te, inputs, _ = tiny_nets
    factors = random_factors(targets(us, ATTENTION + CONVS + ("downsamplers.0.conv", "upsamplers.0.conv")), 4, 21)
    diffusers_named = write_kohya(tmp_path / "d.safetensors", factors, alpha=3)
    ldm_named = write_kohya(tmp_path / "l.safetensors", factors, alpha=3, names="ldm", unet_network=unet)
    keys = [layer.key for layer in L.read_lora(ldm_named).layers]
    assert any(k.startswith("lora_unet_input_blocks_1_1_") for k in keys)
    assert any(k.startswith("lora_unet_middle_block_1_") for k in keys)
    assert any(k.startswith("lora_unet_output_blocks_") for k in keys)
    outs = []
    for f in (diffusers_named, ldm_named):
        with L.merge(unet, [(f, 1.0)], "unet"):
            outs.append(unet(*inputs))
    assert torch.equal(outs[0], outs[1])


def test_ldm_names_at_the_sd15_structure():
    """The original-layout kohya names of SD 1.5 resolve to the diffusers modules A1111 maps them to."""
    from sdlite.config import SD15
    from sdlite.models.unet import UNet

    with torch.device("meta"):
        unet = UNet(SD15.unet)
    expected = {
        "input_blocks_1_1_proj_in": "down_blocks.0.attentions.0.proj_in",
        "input_blocks_1_0_in_layers_2": "down_blocks.0.resnets.0.conv1",
        "input_blocks_4_0_skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
        "input_blocks_8_1_transformer_blocks_0_attn2_to_k": "down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_k",
        "input_blocks_9_0_op": "down_blocks.2.downsamplers.0.conv",
        "middle_block_1_transformer_blocks_0_attn1_to_out_0": "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0",
        "middle_block_2_emb_layers_1": "mid_block.resnets.1.time_emb_proj",
        "output_blocks_2_1_conv": "up_blocks.0.upsamplers.0.conv",
        "output_blocks_3_1_proj_out": "up_blocks.1.attentions.0.proj_out",
        "output_blocks_11_1_transformer_blocks_0_ff_net_2": "up_blocks.3.attentions.2.transformer_blocks.0.ff.net.2",
        "output_blocks_5_2_conv": "up_blocks.1.upsamplers.0.conv",
        "down_blocks_3_resnets_1_conv2": "down_blocks.3.resnets.1.conv2",   # the diffusers spelling
    }
    layers = []
    for target in expected:
        shape = tuple(unet.get_submodule(expected[target]).weight.shape)
        layers.append(L.LoraLayer("unet", target, f"lora_unet_{target}.lora_down.weight",
                                  torch.zeros(2, *shape[1:]), torch.zeros(shape[0], 2, *([1, 1] if len(shape) == 4 else []))))
    got = L.resolve_targets(unet, L.Lora("x.safetensors", "kohya", layers), "unet")
    assert {k.split(".")[0].removeprefix("lora_unet_"): v for k, v in got.items()} == expected


# layers each parity case reaches in SD 1.5: (UNet, text encoder); of the UNet's, how many are 3x3 convolutions.
# SD 1.5 has 16 transformers (10 attention and feed-forward layers each, and a proj_in and proj_out), 22 ResBlocks
# (two 3x3 convolutions and a time projection each, 14 with a 1x1 shortcut) and 12 text-encoder layers (6 each).
SD15_PARITY_LAYERS = {"kohya-r4": (192, 72, 0), "kohya-locon-r8-fp16": (272, 72, 44),
                      "peft-r8-alpha": (192, 72, 0), "peft-r4-conv-implied-alpha": (176, 72, 44)}


def test_parity_cases_at_the_sd15_structure(sd15_meta, tmp_path):
    """The parity cases' files as bench/parity.py builds them for SD 1.5 (real shapes, from the meta device) read
    back with every layer, each resolved to the SD 1.5 module it was made for and fitting its shape (what the
    engine checks before merging): the layers, and how many, that each case changes at full size."""
    unet, te = sd15_meta
    us, ts = layer_shapes(unet), layer_shapes(te)
    for case, [(path, _)] in parity_files(us, ts, tmp_path).items():
        lora = L.read_lora(path)
        counts = []
        for component, network, shapes in (("unet", unet, us), ("text_encoder", te, ts)):
            layers = lora.layers_of(component)
            resolved = L.resolve_targets(network, lora, component)
            assert len(set(resolved.values())) == len(layers), (case, component)
            for layer in layers:
                shape = shapes[resolved[layer.key]]
                assert (layer.out_features, layer.in_features, layer.kernel) == \
                    (shape[0], shape[1], tuple(shape[2:]) or (1, 1)), (case, layer.key)
            counts.append(len(layers))
        counts.append(sum(layer.kernel == (3, 3) for layer in lora.layers_of("unet")))
        assert tuple(counts) == SD15_PARITY_LAYERS[case], case


# --- on the fly, memory modes, prepacking ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def half_folder(tiny, tmp_path_factory):
    """The tiny model stored in fp16."""
    from sdlite.export import save_diffusers
    from sdlite.loader import load_model

    folder = tmp_path_factory.mktemp("lora_half") / "half"
    save_diffusers(load_model(tiny[1]), folder, dtype=torch.float16)
    return folder


@pytest.mark.parametrize("stored", ["fp32-mode0", "fp16-weights"])
def test_on_the_fly_equals_merged(tiny, tiny_nets, half_folder, tmp_path, stored):
    """A streamed UNet (memory mode 0; fp16 weights up-cast block by block) with the LoRA applied on the fly
    gives the resident merged UNet's output bit for bit, and unwraps cleanly."""
    from sdlite.engine.memory import streamed_model

    files = _tiny_case("kohya-locon-r8-fp16", tiny, tmp_path)
    if stored == "fp32-mode0":
        ckpt = open_model(tiny[1])
        streamed = streamed_model(ckpt, "unet", torch.float32)
    else:
        ckpt = open_model(half_folder)
        streamed = streamed_model(ckpt, "unet", torch.float32, keep_pages=True, weight_dtype=torch.float16)
    resident = ckpt.load("unet", torch.float32)
    inputs = tiny_nets[2]
    with torch.no_grad():
        base = streamed(*inputs)
        with L.merge(resident, files, "unet") as merged_handle:
            merged = resident(*inputs)
        handle = L.merge(streamed, files, "unet")
        assert handle.mode == "on the fly" and merged_handle.mode == "merged"
        assert handle.layers == merged_handle.layers > 0
        on_the_fly = streamed(*inputs)
        assert streamed.conv_in.weight.device.type == "meta"   # still nothing resident between blocks
        handle.restore()
        after = streamed(*inputs)
    assert torch.equal(on_the_fly, merged)
    assert torch.equal(after, base) and not torch.equal(base, merged)


@pytest.fixture(scope="module")
def tiny_lora(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_files")
    return _tiny_case("kohya-locon-r8-fp16", tiny, tmp) + [(_tiny_case("peft-r8-alpha", tiny, tmp)[0][0], 0.7)]


TINY_REQUEST = request(64, 4, 9)


def _generate(engine, loras=None):
    if loras is None:
        return engine.generate(TINY_REQUEST).latents
    with L.engine_with_loras(engine, loras) as parsed:
        assert len(parsed) == len(loras)
        return engine.generate(TINY_REQUEST).latents


def test_engine_every_memory_mode(tiny, tiny_lora):
    """engine_with_loras gives the same latents in memory modes 0, 1 and 2 (plain weights: the same kernels), the
    text encoder loaded per prompt in modes 0/2 included; afterwards each engine gives its no-LoRA latents bit
    for bit, twice over (a long-lived engine serves requests with and without)."""
    results = {}
    for mode in (1, 0, 2):
        engine = Engine.load(tiny[1], memory_mode=mode, prepack=False, precision="exact")
        base = _generate(engine)
        with_lora = _generate(engine, tiny_lora)
        assert torch.equal(_generate(engine), base), f"mode {mode}: un-merged"
        assert torch.equal(_generate(engine, tiny_lora), with_lora), f"mode {mode}: merged again"
        assert torch.equal(_generate(engine), base)
        assert "get" not in engine.models.__dict__ and "_build" not in engine.models.__dict__
        results[mode] = (base, with_lora)
    for mode in (0, 2):
        assert torch.equal(results[mode][1], results[1][1]), f"mode {mode}"
    assert (results[1][1] - results[1][0]).abs().max() > 0.05


def test_engine_leaves_no_adapter_behind(tiny, tiny_lora):
    """Memory modes 0 and 2 load the text encoder per use: the LoRA reaches it through the manager's adapter hook,
    which is empty again afterwards, and the next request is the no-LoRA one bit for bit."""
    for mode in (0, 2):
        engine = Engine.load(tiny[1], memory_mode=mode, prepack=False, precision="exact")
        base = _generate(engine)
        with_lora = _generate(engine, tiny_lora)
        assert engine.models.adapters == []
        assert not torch.equal(with_lora, base)
        assert torch.equal(_generate(engine), base)


def test_engine_fp16_weights(half_folder, tiny_lora):
    """weight_dtype fp16 (weights streamed, LoRA on the fly) equals the fp16 file loaded resident in fp32 with the
    LoRA merged, as the engine without a LoRA does (tests/test_memory.py)."""
    streamed = Engine.load(half_folder, weight_dtype=torch.float16, prepack=False, precision="exact")
    resident = Engine.load(half_folder, prepack=False, precision="exact")
    base = _generate(streamed)
    got, expected = _generate(streamed, tiny_lora), _generate(resident, tiny_lora)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    assert (got - base).abs().max() > 0.05
    assert torch.equal(_generate(streamed), base)


@pytest.mark.skipif(not prepack_available(), reason="prepacking needs oneDNN on the CPU")
def test_engine_prepacked(tiny, tiny_lora):
    """Prepacked layers are unpacked, merged and packed again: the plain engine's result to fp32 rounding; the
    original packed weights come back (the same objects), and with them the no-LoRA image bit for bit."""
    packed = Engine.load(tiny[1], prepack=True, precision="exact")
    plain = Engine.load(tiny[1], prepack=False, precision="exact")
    unet = packed.models.get("unet")
    assert isinstance(unet.conv_in, PackedConv2d)
    before = weights_of(unet)
    base = _generate(packed)
    got, expected = _generate(packed, tiny_lora), _generate(plain, tiny_lora)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    after = weights_of(unet)
    assert all(after[k] is before[k] for k in before)
    assert torch.equal(_generate(packed), base)


def test_packed_layers_unpack_exactly():
    """to_dense() of a packed weight is the weight it was packed from (what merging into a packed layer uses),
    for UNet-like shapes including the 4-channel ends."""
    if not prepack_available():
        pytest.skip("prepacking needs oneDNN on the CPU")
    for conv in (torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.Conv2d(32, 4, 3, padding=1),
                 torch.nn.Conv2d(32, 32, 3, stride=2, padding=1), torch.nn.Conv2d(64, 32, 1)):
        assert torch.equal(PackedConv2d(conv).packed.to_dense(), conv.weight)
    linear = torch.nn.Linear(37, 32)
    assert torch.equal(PackedLinear(linear).packed.to_dense(), linear.weight)


def test_engine_error_changes_nothing(tiny, tmp_path):
    """A LoRA whose text-encoder part does not fit is refused before the UNet is touched (mode 2: the text
    encoder is not even loaded yet)."""
    _, folder, _, _, us, ts = tiny
    engine = Engine.load(folder, memory_mode=2, prepack=False, precision="exact")
    unet = engine.models.get("unet")
    before = weights_of(unet)
    te_f = random_factors(targets(ts, ("q_proj",)), 4, 1)
    te_f["text_model.encoder.layers.0.self_attn.nonexistent"] = te_f[next(iter(te_f))]
    f = write_kohya(tmp_path / "bad.safetensors", random_factors(targets(us, ATTENTION), 4, 2), te_f)
    with pytest.raises(L.LoraError, match=r"bad\.safetensors: 1 of its 4 text encoder layers match no layer of "
                                          r"this model: 'lora_te_text_model_encoder_layers_0_self_attn_nonexistent"):
        with L.engine_with_loras(engine, [(f, 1.0)]):
            raise AssertionError("not reached")
    assert all(weights_of(unet)[k] is v for k, v in before.items())
    assert "get" not in engine.models.__dict__


def test_requests_name_their_loras(tiny, tiny_lora, tmp_path):
    """The engine's own wiring (Request.loras, <lora:NAME:W> tags found in lora_dir) gives engine_with_loras'
    result, and the PNG parameters' "Lora hashes" as A1111 writes them."""
    import shutil

    engine = Engine.load(tiny[1], prepack=False, precision="exact")
    (file, weight), (other, other_weight) = tiny_lora
    expected = _generate(engine, tiny_lora)
    by_path = engine.generate(TINY_REQUEST.replace(loras=((str(file), weight), (str(other), other_weight))))
    assert torch.equal(by_path.latents, expected)
    folder = tmp_path / "loras" / "sub"
    folder.mkdir(parents=True)
    shutil.copy(file, folder / "styleA.safetensors")
    shutil.copy(other, tmp_path / "loras" / "styleB.safetensors")
    tagged = engine.generate(TINY_REQUEST.replace(prompt=f"{PROMPT} <lora:styleA:{weight}> <lora:styleB:{other_weight}>",
                                                  lora_dir=str(tmp_path / "loras")))
    assert torch.equal(tagged.latents, expected)
    assert tagged.infotext["Lora hashes"] == f"styleA: {L.lora_hash(file)}, styleB: {L.lora_hash(other)}"
    assert torch.equal(engine.generate(TINY_REQUEST).latents, _generate(engine))


def test_find_lora(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    save_file({"x": torch.ones(1)}, str(tmp_path / "a" / "b" / "MyStyle.safetensors"),
              metadata={"ss_output_name": "trained_name"})
    torch.save({"x": torch.ones(1)}, tmp_path / "a" / "old.pt")
    assert L.find_lora("MyStyle", tmp_path) == str(tmp_path / "a" / "b" / "MyStyle.safetensors")
    assert L.find_lora("mystyle", tmp_path) == str(tmp_path / "a" / "b" / "MyStyle.safetensors")
    assert L.find_lora("trained_name", tmp_path) == str(tmp_path / "a" / "b" / "MyStyle.safetensors")
    assert L.find_lora("old", tmp_path) == str(tmp_path / "a" / "old.pt")
    assert L.lora_name(tmp_path / "a" / "old.pt") == "old"
    with pytest.raises(L.LoraError, match=r"<lora:nope:\.\.\.>: no LoRA named 'nope' .* in .*; "
                                           r"there: 'MyStyle', 'demo_teal', 'old'"):   # the shipped one too
        L.find_lora("nope", tmp_path)


# --- refusals --------------------------------------------------------------------------------------------------

LYCORIS = {
    "LoHa": (["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"], r"LyCORIS LoHa"),
    "LoKr": (["lokr_w1", "lokr_w2", "alpha"], r"LyCORIS LoKr"),
    "IA3": (["weight", "on_input"], r"\(IA\)\^3"),
    "full": (["diff", "diff_b"], r"full weight difference"),
    "GLoRA": (["a1.weight", "a2.weight", "b1.weight", "b2.weight", "alpha"], r"GLoRA"),
    "norm": (["w_norm", "b_norm"], r"norm-layer"),
    "OFT": (["oft_blocks", "rescale"], r"OFT"),
    "CP LoCon": (["lora_down.weight", "lora_up.weight", "lora_mid.weight", "alpha"], r"lora_mid"),
    "DoRA": (["lora_down.weight", "lora_up.weight", "dora_scale", "alpha"], r"DoRA"),
}


@pytest.mark.parametrize("kind", list(LYCORIS))
def test_refuses_other_network_types(tmp_path, kind):
    parts, message = LYCORIS[kind]
    state = {f"lora_unet_down_blocks_0_attentions_0_proj_in.{p}": torch.ones(2, 2) for p in parts}
    state["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = torch.ones(2, 2)
    state["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"] = torch.ones(2, 2)
    path = tmp_path / f"{kind}.safetensors"
    save_file(state, str(path))
    with pytest.raises(L.LoraError, match=rf"{re.escape(str(path))}: not a plain LoRA: .*{message}.*sdlite applies "
                                          r"LoRA and LoCon"):
        L.read_lora(path)


def test_refuses_peft_dora_and_unknown_keys(tmp_path):
    save_file({"unet.a.lora_A.weight": torch.ones(2, 2), "unet.a.lora_B.weight": torch.ones(2, 2),
               "unet.a.lora_magnitude_vector": torch.ones(2)}, str(tmp_path / "dora.safetensors"))
    with pytest.raises(L.LoraError, match=r"dora\.safetensors: not a plain LoRA: DoRA"):
        L.read_lora(tmp_path / "dora.safetensors")
    save_file({"unet.a.lora_A.weight": torch.ones(2, 2), "unet.a.weird": torch.ones(2, 2)},
              str(tmp_path / "odd.safetensors"))
    with pytest.raises(L.LoraError, match=r"odd\.safetensors: 1 keys are neither kohya .* 'unet\.a\.weird'"):
        L.read_lora(tmp_path / "odd.safetensors")
    save_file({"lora_unet_a.lora_down.weight": torch.ones(2, 2)}, str(tmp_path / "half.safetensors"))
    with pytest.raises(L.LoraError, match=r"half\.safetensors: 'lora_unet_a\.lora_down\.weight' has no matching up"):
        L.read_lora(tmp_path / "half.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(L.LoraError, match=r"broken\.safetensors: "):
        L.read_lora(tmp_path / "broken.safetensors")
    with pytest.raises(L.LoraError, match=r"missing\.safetensors: "):
        L.read_lora(tmp_path / "missing.safetensors")


@pytest.fixture(scope="module")
def sd15_meta():
    """SD 1.5's networks on the meta device: the real shapes, no memory."""
    from sdlite.config import SD15
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet

    with torch.device("meta"):
        return UNet(SD15.unet), CLIPTextEncoder(SD15.text)


def test_refuses_another_family(tmp_path, sd15_meta):
    unet, te = sd15_meta
    to_k = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"
    sd2 = write_kohya(tmp_path / "sd2.safetensors", {to_k: (torch.ones(4, 1024), torch.ones(320, 4))},
                      {"text_model.encoder.layers.0.self_attn.q_proj": (torch.ones(4, 1024), torch.ones(1024, 4))})
    with pytest.raises(L.LoraError, match=r"sd2\.safetensors: made for SD 2\.x \(cross-attention width 1024\), this "
                                          r"model is SD 1\.x \(768\)"):
        L.merge(unet, [(sd2, 1.0)], "unet")
    with pytest.raises(L.LoraError, match=r"sd2\.safetensors: made for SD 2\.x \(text-encoder width 1024\), this model "
                                          r"is SD 1\.x \(768\)"):
        L.merge(te, [(sd2, 1.0)], "text_encoder")
    xl = tmp_path / "xl.safetensors"
    save_file({"lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.ones(4, 1280),
               "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.ones(1280, 4),
               "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k.lora_down.weight": torch.ones(4, 2048),
               "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k.lora_up.weight": torch.ones(640, 4)},
              str(xl))
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL \(cross-attention width 2048\), this "
                                          r"model is SD 1\.x \(768\)"):
        L.merge(unet, [(xl, 1.0)], "unet")
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL .*second text encoder.*this model is "
                                          r"SD 1\.x"):
        L.merge(te, [(xl, 1.0)], "text_encoder")


def test_refuses_unmatched_and_misshapen_layers(tiny, tiny_nets, tmp_path):
    _, _, _, _, us, _ = tiny
    unet = tiny_nets[0]
    good = random_factors(targets(us, ("attn1.to_q",)), 4, 1)
    bogus = {f"down_blocks.0.attentions.0.transformer_blocks.0.attn9.to_{c}": next(iter(good.values()))
             for c in "qkvxyz"}
    f = write_kohya(tmp_path / "unmatched.safetensors", {**good, **bogus})
    with pytest.raises(L.LoraError, match=r"unmatched\.safetensors: 6 of its 12 unet layers match no layer of this "
                                          r"model: 'lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn9"
                                          r"_to_k\.lora_down\.weight', .*, \.\.\.$"):
        L.merge(unet, [(f, 1.0)], "unet")
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    f = write_kohya(tmp_path / "shape.safetensors", {name: (torch.ones(4, 48), torch.ones(32, 4))})
    with pytest.raises(L.LoraError, match=r"shape\.safetensors: .*attn1_to_q\.lora_down\.weight' does not fit "
                                          rf"'{re.escape(name)}': the LoRA has 48 inputs, the layer has 32"):
        L.merge(unet, [(f, 1.0)], "unet")
    conv = "down_blocks.0.resnets.0.conv1"
    f = write_kohya(tmp_path / "kernel.safetensors", {conv: (torch.ones(4, 32), torch.ones(32, 4))})
    with pytest.raises(L.LoraError, match=r"a 1x1 kernel, the layer has 3x3"):
        L.merge(unet, [(f, 1.0)], "unet")


# --- parsing details, scale, hashes ----------------------------------------------------------------------------


def test_scale_is_multiplier_alpha_over_rank(tiny, tmp_path):
    _, _, _, _, us, ts = tiny
    f = random_factors(targets(us, ("attn1.to_q",)), 8, 1)
    kohya = L.read_lora(write_kohya(tmp_path / "k.safetensors", f, alpha=4, dtype=torch.float16))
    assert kohya.format == "kohya" and {layer.rank for layer in kohya.layers} == {8}
    assert all(layer.scale(0.5) == 0.5 * 4 / 8 and layer.kind == "linear" for layer in kohya.layers)
    no_alpha = L.read_lora(write_kohya(tmp_path / "n.safetensors", f))
    assert all(layer.alpha is None and layer.scale(0.7) == 0.7 for layer in no_alpha.layers)
    peft = L.read_lora(write_peft(tmp_path / "p.safetensors", f, alpha=16))
    assert all(layer.scale(1.0) == 2.0 for layer in peft.layers)
    implied = L.read_lora(write_peft(tmp_path / "i.safetensors", f))
    assert all(layer.scale(0.3) == 0.3 for layer in implied.layers)
    convs = L.read_lora(write_kohya(tmp_path / "c.safetensors", random_factors(targets(us, ("conv1",)), 4, 2)))
    assert {layer.kind for layer in convs.layers} == {"conv"}
    # rsLoRA and per-module alphas from diffusers' metadata
    config = {"unet.lora_alpha": 8, "unet.r": 4, "unet.use_rslora": True,
              "unet.alpha_pattern": {"attn1.to_q": 2}}
    state = {f"unet.{name}.lora_{ab}.weight": t for name, (down, up) in
             random_factors(targets(us, ("attn1.to_q", "attn1.to_k")), 4, 3).items() for ab, t in (("A", down), ("B", up))}
    save_file(state, str(tmp_path / "rs.safetensors"), metadata={L.METADATA_KEY: json.dumps(config)})
    scales = {layer.target.rsplit(".", 1)[-1]: layer.scale(1.0) for layer in L.read_lora(tmp_path / "rs.safetensors").layers}
    assert scales == {"to_q": 2 / 2.0, "to_k": 8 / 2.0}


def test_kohya_pickle_and_bare_peft_keys(tiny, tmp_path):
    """A kohya LoRA saved with torch.save reads as the safetensors one; PEFT keys without a component prefix go
    to the UNet (or the text encoder for text_model.*)."""
    _, _, _, _, us, ts = tiny
    f = random_factors(targets(us, ("attn2.to_k",)), 4, 1)
    st = write_kohya(tmp_path / "k.safetensors", f, alpha=2)
    from safetensors.torch import load_file

    torch.save(load_file(str(st)), tmp_path / "k.pt")
    a, b = L.read_lora(st), L.read_lora(tmp_path / "k.pt")
    assert [(x.target, x.alpha) for x in a.layers] == [(x.target, x.alpha) for x in b.layers]
    assert all(torch.equal(x.down, y.down) for x, y in zip(a.layers, b.layers))
    t = random_factors(targets(ts, ("q_proj",)), 4, 2)
    state = {f"base_model.model.{n}.lora_{ab}.weight": v for n, (d, u) in {**f, **t}.items() for ab, v in
             (("A", d), ("B", u))}
    save_file(state, str(tmp_path / "bare.safetensors"))
    bare = L.read_lora(tmp_path / "bare.safetensors")
    assert {layer.component for layer in bare.layers} == {"unet", "text_encoder"}


def test_lora_hash_is_a1111s(tmp_path):
    """A1111 (extensions-builtin/Lora/network.py, modules/hashes.py): the addnet hash of a safetensors file, i.e.
    the sha256 of the bytes after its header, first 12 hex digits; sshs_model_hash metadata wins; other formats
    hash the whole file."""
    path = tmp_path / "style.safetensors"
    save_file({"lora_unet_a.lora_down.weight": torch.arange(6.0).reshape(2, 3)}, str(path),
              metadata={"ss_output_name": "styleName"})
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    expected = hashlib.sha256(data[8 + n:]).hexdigest()
    assert L.lora_hash(path) == expected[:12] and L.lora_hash(path, short=False) == expected
    # the metadata is not hashed: the same tensors with other metadata have the same hash
    save_file({"lora_unet_a.lora_down.weight": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "b.safetensors"))
    assert L.lora_hash(tmp_path / "b.safetensors") == L.lora_hash(path)
    save_file({"x": torch.ones(1)}, str(tmp_path / "c.safetensors"), metadata={"sshs_model_hash": "abcdef0123456789"})
    assert L.lora_hash(tmp_path / "c.safetensors") == "abcdef012345"
    torch.save({"x": torch.ones(1)}, tmp_path / "d.pt")
    assert L.lora_hash(tmp_path / "d.pt") == hashlib.sha256((tmp_path / "d.pt").read_bytes()).hexdigest()[:12]
    assert L.lora_hashes_infotext([("my:style,v2", path), ("b", tmp_path / "b.safetensors")]) == \
        f"mystylev2: {expected[:12]}, b: {expected[:12]}"
    with pytest.raises(L.LoraError, match=r"nope\.safetensors: cannot read the file"):
        L.lora_hash(tmp_path / "nope.safetensors")
