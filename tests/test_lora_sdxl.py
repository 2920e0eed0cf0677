"""LoRA on SDXL (sdlite.adapters.lora): kohya SDXL files (the UNet in Stability's SGM block names, ``lora_te1_`` /
``lora_te2_``) and diffusers/PEFT files (``unet.`` / ``text_encoder.`` / ``text_encoder_2.``) merged into both text
encoders and the UNet, against diffusers' ``load_lora_weights`` + ``fuse_lora`` on the tiny SDXL pipeline of
tests/test_sdxl_pipeline.py; exact un-merging; memory modes 0 and 2 and streamed fp16 weights; the prompt tag; the
refusals (another family, a network the model lacks, the refiner given a base LoRA).

The LoRA is made with peft on diffusers' own modules and saved by diffusers (the PEFT file); the kohya file holds
the same factors under the published kohya SDXL names, written here by a mapping of this module's own (not
sdlite's converter table), and diffusers must read it to the same fused weights as the PEFT file."""
from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine, Request
from tests.reference import use_scheduler
from tests.test_sdxl_pipeline import SIZE, UNET_BASE, saved_pipelines

pytest.importorskip("peft", reason="the reference (diffusers' load_lora_weights) needs the PEFT backend")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"
WEIGHT = 0.8
RANK = {"unet": 4, "text_encoder": 4, "text_encoder_2": 8}
ALPHA = {"unet": 8.0, "text_encoder": 2.0, "text_encoder_2": 4.0}
TEXT_LAYERS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
KOHYA_PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
REQUEST = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=4, cfg_scale=6.0, sampler="euler", seed=11)


# --- the published kohya SDXL naming, written out independently of sdlite.weights.convert -------------------------

_RESNET_SGM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_FIXED_SGM = {"conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
              "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
              "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def sgm_name(name: str, cfg) -> str:
    """A diffusers UNet module path in Stability's SGM layout (what kohya's sd-scripts train SDXL on): the down path
    is ``input_blocks.N`` (N = 1 + level * (layers + 1) + j; slot 0 the ResBlock, 1 the transformer; the
    downsampler ``input_blocks.(level + 1) * (layers + 1).0.op``), the middle ``middle_block.0/1/2``, the up path
    ``output_blocks.N`` (N = level * (layers + 1) + j; the upsampler in the slot after the transformer, or after
    the ResBlock where the level has none)."""
    if name in _FIXED_SGM:
        return _FIXED_SGM[name]
    per = cfg.layers_per_block + 1
    up_attention = tuple(reversed(cfg.attention))
    parts = name.split(".")

    def inner(kind: str, rest: list[str]) -> str:
        if kind == "resnets":
            return ".".join(["0", _RESNET_SGM[rest[0]], *rest[1:]])
        return ".".join(["1", *rest])

    if parts[0] == "down_blocks":
        level, kind = int(parts[1]), parts[2]
        if kind == "downsamplers":
            return f"input_blocks.{(level + 1) * per}.0.op"
        return f"input_blocks.{1 + level * per + int(parts[3])}.{inner(kind, parts[4:])}"
    if parts[0] == "mid_block":
        block = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}[parts[1], parts[2]]
        return f"middle_block.{block}.{inner(parts[1], parts[3:])[2:]}"
    if parts[0] == "up_blocks":
        level, kind = int(parts[1]), parts[2]
        if kind == "upsamplers":
            return f"output_blocks.{level * per + per - 1}.{2 if up_attention[level] else 1}.conv"
        return f"output_blocks.{level * per + int(parts[3])}.{inner(kind, parts[4:])}"
    raise AssertionError(f"no SGM name for {name}")


def canonical(component: str, module: str) -> str:
    """transformers' module path of a text-encoder layer with its ``text_model.`` level (transformers 5's
    CLIPTextModel has none; kohya's names, and sdlite's, have it)."""
    if component == "unet" or module.startswith("text_model."):
        return module
    return "text_model." + module


def kohya_key(component: str, module: str) -> str:
    name = sgm_name(module, UNET_BASE) if component == "unet" else canonical(component, module)
    return KOHYA_PREFIX[component] + name.replace(".", "_")


# --- the LoRA, made with peft on diffusers' modules ---------------------------------------------------------------


def _layers(module, component):
    out = []
    for name, m in module.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        if component == "unet" or name.rsplit(".", 1)[-1] in TEXT_LAYERS:
            out.append(name)
    return sorted(out)


def peft_factors(pipe, seed=7, strength=4.0):
    """{component: ({module: (down, up)}, LoraConfig)}: peft adapters added to copies of the pipeline's networks
    (every Linear/Conv2d of the UNet: attention, ResBlocks as LoCon, samplers, conv_in/out, the time and added
    embeddings; the text encoders' attention and MLP), their factors randomised (``strength``: as strong as it
    takes for the tiny random model's images to show the LoRA clearly, about 10/255 on average)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    out = {}
    for component in ("unet", "text_encoder", "text_encoder_2"):
        network = copy.deepcopy(getattr(pipe, component))
        config = LoraConfig(r=RANK[component], lora_alpha=ALPHA[component],
                            target_modules=_layers(network, component), init_lora_weights=False)
        network.add_adapter(config)
        with torch.no_grad():
            for name, p in sorted(network.named_parameters()):
                if ".lora_A." in name:
                    p.copy_(torch.randn(p.shape, generator=g) / np.prod(p.shape[1:]) ** 0.5)
                elif ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * strength / p.shape[1] ** 0.5)
        state = get_peft_model_state_dict(network)
        factors = {}
        for key, t in state.items():
            module, _, part = key.rpartition(".lora_")
            factors.setdefault(module, [None, None])[0 if part.startswith("A") else 1] = t.detach().clone()
        out[component] = ({m: tuple(f) for m, f in factors.items()}, config)
    return out


def write_peft(made, folder):
    from diffusers import StableDiffusionXLPipeline

    StableDiffusionXLPipeline.save_lora_weights(
        folder, weight_name="xl_peft.safetensors",
        **{f"{c}_lora_layers": {f"{m}.lora_{ab}.weight": t for m, f in made[c][0].items() for ab, t in zip("AB", f)}
           for c in made},
        **{f"{c}_lora_adapter_metadata": made[c][1].to_dict() for c in made})
    return folder / "xl_peft.safetensors"


def write_kohya(made, path, components=("unet", "text_encoder", "text_encoder_2"), dtype=torch.float32):
    state = {}
    for component in components:
        for module, (down, up) in made[component][0].items():
            key = kohya_key(component, module)
            state[f"{key}.lora_down.weight"] = down.to(dtype)
            state[f"{key}.lora_up.weight"] = up.to(dtype)
            state[f"{key}.alpha"] = torch.tensor(ALPHA[component]).to(dtype)
    save_file(state, str(path), metadata={"ss_base_model_version": "sdxl_base_v1-0"})
    return path


# --- fixtures ----------------------------------------------------------------------------------------------------


def _half_copy(folder, to):
    """The diffusers folder with every weight file in fp16 (what SDXL downloads mostly are)."""
    shutil.copytree(folder, to)
    for f in to.rglob("*.safetensors"):
        save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(str(f)).items()}, str(f),
                  metadata={"format": "pt"})
    return to


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_sdxl")
    base, refiner = saved_pipelines(tmp)
    made = peft_factors(base)
    loras = tmp / "loras"
    loras.mkdir()
    files = {"peft": write_peft(made, loras), "kohya": write_kohya(made, loras / "xl_kohya.safetensors")}
    engine = Engine.load(tmp / "base", prepack=False, precision="exact")
    base_latents = engine.generate(REQUEST)
    return dict(base=base, refiner=refiner, engine=engine, plain=base_latents, files=files, made=made, tmp=tmp)


def pixels(result) -> np.ndarray:
    return np.stack([np.asarray(im.convert("RGB")) for im in result.images]).astype(int)


def reference_pixels(pipe, lora_file=None, weight=WEIGHT) -> np.ndarray:
    """diffusers' own path: load_lora_weights, then fuse_lora(lora_scale=w); undone after."""
    use_scheduler(pipe, "euler")
    if lora_file is not None:
        pipe.load_lora_weights(str(lora_file), adapter_name="x")
        pipe.fuse_lora(lora_scale=weight, adapter_names=["x"])
    try:
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=REQUEST.steps,
                   guidance_scale=REQUEST.cfg_scale, generator=torch.Generator().manual_seed(REQUEST.seed),
                   height=SIZE, width=SIZE, output_type="np").images
    finally:
        if lora_file is not None:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
    return np.round(np.clip(out, 0, 1) * 255).astype(int)


@pytest.fixture(scope="module")
def reference(xl):
    """diffusers' image with the PEFT file (the kohya file is shown to read the same in diffusers below)."""
    return reference_pixels(xl["base"], xl["files"]["peft"])


def diff(a, b) -> int:
    return int(np.abs(a - b).max())


# --- reading ------------------------------------------------------------------------------------------------------


def test_kohya_sdxl_names_at_the_real_structure():
    """kohya's SDXL names resolve, at SDXL base's real structure (3 levels, transformer depths 1, 2, 10, the
    added-conditioning MLP), to the diffusers modules they denote; lora_te1_/lora_te2_ to the two encoders."""
    from sdlite.config import SDXL_BASE
    from sdlite.models.unet import UNet

    with torch.device("meta"):
        unet = UNet(SDXL_BASE.unet)
    expected = {
        "input_blocks_0_0": "conv_in",
        "input_blocks_1_0_in_layers_2": "down_blocks.0.resnets.0.conv1",
        "input_blocks_3_0_op": "down_blocks.0.downsamplers.0.conv",
        "input_blocks_4_0_skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
        "input_blocks_4_1_transformer_blocks_0_attn1_to_q":
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
        "input_blocks_5_1_transformer_blocks_1_attn2_to_k":
            "down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k",
        "input_blocks_8_1_transformer_blocks_9_ff_net_2":
            "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2",
        "input_blocks_7_1_proj_in": "down_blocks.2.attentions.0.proj_in",
        "middle_block_0_emb_layers_1": "mid_block.resnets.0.time_emb_proj",
        "middle_block_1_transformer_blocks_9_attn1_to_out_0":
            "mid_block.attentions.0.transformer_blocks.9.attn1.to_out.0",
        "middle_block_2_out_layers_3": "mid_block.resnets.1.conv2",
        "output_blocks_0_1_transformer_blocks_9_ff_net_0_proj":
            "up_blocks.0.attentions.0.transformer_blocks.9.ff.net.0.proj",
        "output_blocks_2_2_conv": "up_blocks.0.upsamplers.0.conv",
        "output_blocks_5_2_conv": "up_blocks.1.upsamplers.0.conv",
        "output_blocks_5_1_proj_out": "up_blocks.1.attentions.2.proj_out",
        "output_blocks_8_0_skip_connection": "up_blocks.2.resnets.2.conv_shortcut",
        "label_emb_0_0": "add_embedding.linear_1",
        "label_emb_0_2": "add_embedding.linear_2",
        "time_embed_0": "time_embedding.linear_1",
        "out_2": "conv_out",
    }
    assert {k: sgm_name(v, SDXL_BASE.unet).replace(".", "_") for k, v in expected.items()} == \
        {k: k for k in expected}   # the test's own mapping agrees with the published names
    layers = []
    for target, module in expected.items():
        shape = tuple(unet.get_submodule(module).weight.shape)
        layers.append(L.LoraLayer("unet", target, f"lora_unet_{target}.lora_down.weight", torch.zeros(2, *shape[1:]),
                                  torch.zeros(shape[0], 2, *([1, 1] if len(shape) == 4 else []))))
    got = L.resolve_targets(unet, L.Lora("x.safetensors", "kohya", layers), "unet", spec=SDXL_BASE)
    assert {k.split(".")[0].removeprefix("lora_unet_"): v for k, v in got.items()} == expected


def test_kohya_and_peft_files_read_alike(xl):
    """Both files parse to the same layers, factors and scales (kohya's alpha keys, diffusers' per-component
    metadata); and diffusers reads the kohya file to the same fused weights as the PEFT file."""
    kohya, peft = (L.read_lora(xl["files"][k]) for k in ("kohya", "peft"))
    assert (kohya.format, peft.format) == ("kohya", "peft")
    assert kohya.components() == peft.components() == ["text_encoder", "text_encoder_2", "unet"]
    assert kohya.made_for_sdxl and peft.made_for_sdxl
    engine = xl["engine"]
    for component in ("unet", "text_encoder", "text_encoder_2"):
        with engine.models.use(component) as network:
            by_module = []
            for lora in (kohya, peft):
                names = L.resolve_targets(network, lora, component, spec=engine.spec)
                by_module.append({names[x.key]: x for x in lora.layers_of(component)})
        made = {canonical(component, m) for m in xl["made"][component][0]}
        assert set(by_module[0]) == set(by_module[1]) == made, component
        for name, a in by_module[0].items():
            b = by_module[1][name]
            assert torch.equal(a.down, b.down) and torch.equal(a.up, b.up), name
            assert a.scale(WEIGHT) == b.scale(WEIGHT) == WEIGHT * ALPHA[component] / RANK[component]

    pipe = xl["base"]
    fused = []
    for f in (xl["files"]["kohya"], xl["files"]["peft"]):
        pipe.load_lora_weights(str(f), adapter_name="x")
        pipe.fuse_lora(lora_scale=WEIGHT, adapter_names=["x"])
        try:
            fused.append({f"{c}.{k.replace('.base_layer.', '.')}": v.clone()
                          for c in ("unet", "text_encoder", "text_encoder_2")
                          for k, v in getattr(pipe, c).state_dict().items() if "lora_" not in k})
        finally:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
    assert fused[0].keys() == fused[1].keys()
    changed = [k for k in fused[0] if not torch.equal(fused[0][k], fused[1][k])]
    assert all(torch.allclose(fused[0][k], fused[1][k], rtol=1e-5, atol=1e-6) for k in changed), changed[:5]
    plain = {f"{c}.{k}": v for c in ("unet", "text_encoder", "text_encoder_2")
             for k, v in getattr(pipe, c).state_dict().items()}
    touched = {k for k in plain if not torch.equal(plain[k], fused[1][k])}
    assert len(touched) == sum(len(xl["made"][c][0]) for c in xl["made"])   # every layer's weight, no other


# --- images -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["kohya", "peft"])
def test_images_match_diffusers_and_unmerge_exactly(xl, reference, form):
    """Both files give diffusers' image (load_lora_weights + fuse_lora(lora_scale=0.8)) within 2/255, clearly
    another image than without the LoRA; afterwards the engine gives the no-LoRA image bit for bit."""
    engine = xl["engine"]
    with L.engine_with_loras(engine, [(xl["files"][form], WEIGHT)]) as parsed:
        assert [lora.format for lora in parsed] == [form]
        got = engine.generate(REQUEST)
    assert diff(pixels(got), reference) <= 2
    assert np.abs(pixels(got) - pixels(xl["plain"])).mean() > 5, "the LoRA should change the image clearly"
    after = engine.generate(REQUEST)
    assert torch.equal(after.latents, xl["plain"].latents)
    assert np.array_equal(pixels(after), pixels(xl["plain"]))


def test_each_network_gets_its_part(xl):
    """The kohya file's layers of each network alone (the UNet, lora_te1_, lora_te2_) change the result: none of
    them is lost on the way to its network."""
    engine = xl["engine"]
    for component in ("unet", "text_encoder", "text_encoder_2"):
        path = write_kohya(xl["made"], xl["tmp"] / f"only-{component}.safetensors", components=(component,))
        with L.engine_with_loras(engine, [(path, WEIGHT)]):
            got = engine.generate(REQUEST).latents
        change = ((got - xl["plain"].latents).abs().max() / xl["plain"].latents.abs().max()).item()
        assert change > 5e-3, f"{component}: {change}"   # about 0.02 for each text encoder, 0.2 for the UNet


def test_prompt_tag_and_lora_hashes(xl, reference):
    """``<lora:xl_kohya:0.8>`` in the prompt (looked up in the request's LoRA folder) is the same as applying the
    file; the PNG parameters get A1111's "Lora hashes" entry."""
    engine = xl["engine"]
    path = xl["files"]["kohya"]
    got = engine.generate(REQUEST.replace(prompt=f"{PROMPT} <lora:xl_kohya:{WEIGHT}>", lora_dir=str(path.parent)))
    assert diff(pixels(got), reference) <= 2
    assert got.infotext["Lora hashes"] == f"xl_kohya: {L.lora_hash(path)}"
    assert torch.equal(engine.generate(REQUEST).latents, xl["plain"].latents)


def test_memory_modes_0_and_2(xl):
    """Memory mode 0 (UNet and both text encoders streamed from the file, the LoRA applied on the fly) and mode 2
    (text encoders loaded per prompt, merged as they are built) give mode 1's latents; each engine gives its
    no-LoRA latents again after, and no adapter is left behind."""
    files = [(xl["files"]["kohya"], WEIGHT)]
    with L.engine_with_loras(xl["engine"], files):
        expected = xl["engine"].generate(REQUEST).latents
    for mode in (0, 2):
        engine = Engine.load(xl["tmp"] / "base", memory_mode=mode, prepack=False, precision="exact")
        streamer = getattr(engine.models.get("unet"), "_streamer", None)
        assert (streamer is not None) == (mode == 0)
        provider = streamer and streamer.provider
        with L.engine_with_loras(engine, files):
            got = engine.generate(REQUEST).latents
            assert streamer is None or streamer.provider is not provider   # mode 0: merged on the fly
        assert engine.models.adapters == [] and (streamer is None or streamer.provider is provider)
        assert torch.allclose(got, expected, rtol=0, atol=1e-5), f"mode {mode}: {(got - expected).abs().max()}"
        assert torch.allclose(engine.generate(REQUEST).latents, xl["plain"].latents, rtol=0, atol=1e-5)


def test_streamed_fp16_weights(xl):
    """An fp16 folder: SDXL's default on the CPU keeps the weights in fp16 and computes block by block, the LoRA
    merged on the fly as each block's weights are up-cast; it equals the same file loaded whole in fp32 with the
    LoRA merged, and un-merges exactly."""
    half = _half_copy(xl["tmp"] / "base", xl["tmp"] / "base-fp16")
    streamed = Engine.load(half, precision="exact")
    resident = Engine.load(half, weight_dtype=torch.float32, prepack=False, precision="exact")
    unet = streamed.models.get("unet")
    assert unet._streamer is not None and getattr(resident.models.get("unet"), "_streamer", None) is None
    files = [(xl["files"]["peft"], WEIGHT)]
    before = streamed.generate(REQUEST).latents
    provider = unet._streamer.provider
    with L.engine_with_loras(streamed, files):
        assert unet._streamer.provider is not provider   # merged on the fly
        got = streamed.generate(REQUEST).latents
    assert unet._streamer.provider is provider
    with L.engine_with_loras(resident, files):
        expected = resident.generate(REQUEST).latents
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    assert (got - before).abs().max() > 0.05
    assert torch.equal(streamed.generate(REQUEST).latents, before)


def test_second_text_encoder_only_on_the_refiner(xl):
    """A LoRA of the second text encoder alone fits the refiner too (it shares bigG with the base): merged, it
    changes the refiner's image, and un-merges exactly."""
    path = write_kohya(xl["made"], xl["tmp"] / "te2.safetensors", components=("text_encoder_2",))
    refiner = Engine.load(xl["tmp"] / "refiner", prepack=False, precision="exact")
    request = REQUEST.replace(init_image=xl["plain"].images[0], strength=0.6)
    before = refiner.generate(request).latents
    with L.engine_with_loras(refiner, [(path, 1.0)]):
        got = refiner.generate(request).latents
    assert (got - before).abs().max() > 1e-3
    assert torch.equal(refiner.generate(request).latents, before)


# --- refusals -----------------------------------------------------------------------------------------------------


def _write(path, layers):
    """kohya layers {key stem: (in, out)} with rank-2 factors."""
    state = {}
    for stem, (inp, out) in layers.items():
        state[f"{stem}.lora_down.weight"] = torch.ones(2, inp)
        state[f"{stem}.lora_up.weight"] = torch.ones(out, 2)
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def real_meta():
    """SD 1.5's, SDXL base's and the refiner's networks on the meta device: the real shapes, no memory."""
    from sdlite.config import SD15, SDXL_BASE, SDXL_REFINER
    from sdlite.loader import build_network

    with torch.device("meta"):
        return {spec.family: (spec, {c: build_network(c, spec) for c in ("unet", *spec.text_encoders)})
                for spec in (SD15, SDXL_BASE, SDXL_REFINER)}


def test_refuses_other_families_at_real_shapes(tmp_path, real_meta):
    sd1_spec, sd1 = real_meta["sd1"]
    xl_spec, xl = real_meta["sdxl"]
    ref_spec, ref = real_meta["sdxl-refiner"]
    to_k = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
    sd1_lora = _write(tmp_path / "sd1.safetensors", {to_k: (768, 640),
                                                       "lora_te_text_model_encoder_layers_0_mlp_fc1": (768, 3072)})
    with pytest.raises(L.LoraError, match=r"sd1\.safetensors: made for SD 1\.x \(cross-attention width 768\), this "
                                          r"model is SDXL \(2048\)"):
        L.merge(xl["unet"], [(sd1_lora, 1.0)], "unet", spec=xl_spec)
    sd2_te = _write(tmp_path / "sd2.safetensors",
                    {"lora_te_text_model_encoder_layers_0_self_attn_q_proj": (1024, 1024)})
    with pytest.raises(L.LoraError, match=r"sd2\.safetensors: made for SD 2\.x \(text-encoder width 1024\), this "
                                          r"model is SDXL \(768\)"):
        L.merge(xl["text_encoder"], [(sd2_te, 1.0)], "text_encoder", spec=xl_spec)
    xl_lora = _write(tmp_path / "xl.safetensors", {
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k": (2048, 640),
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj": (768, 768),
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj": (1280, 1280)})
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL \(cross-attention width 2048\), this "
                                          r"model is SD 1\.x \(768\)"):
        L.merge(sd1["unet"], [(xl_lora, 1.0)], "unet", spec=sd1_spec)
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL \(it has layers of a second text encoder"
                                          r".*\), this model is SD 1\.x$"):
        L.merge(sd1["text_encoder"], [(xl_lora, 1.0)], "text_encoder", spec=sd1_spec)
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL \(it has layers of a second text encoder"
                                          r".*\), this model is SD 1\.x, which has one text encoder"):
        L.check_components(L.read_lora(xl_lora), sd1_spec)
    # the same file fits SDXL base: checks pass for every network
    for component, network in xl.items():
        L.check_family(L.read_lora(xl_lora), component, network, spec=xl_spec)
    L.check_components(L.read_lora(xl_lora), xl_spec)
    # and the refiner: its UNet has another cross-attention width, it has no first text encoder
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for SDXL \(cross-attention width 2048\), this "
                                          r"model is the SDXL refiner \(1280\)"):
        L.merge(ref["unet"], [(xl_lora, 1.0)], "unet", spec=ref_spec)
    with pytest.raises(L.LoraError, match=r"xl\.safetensors: made for the SDXL base model \(it has layers of a first "
                                          r"text encoder.*\), this model is the SDXL refiner, whose only text encoder "
                                          r"is text_encoder_2"):
        L.check_components(L.read_lora(xl_lora), ref_spec)


def test_engine_refusals_change_nothing(xl):
    """On the tiny engines: the refiner given the base LoRA (its UNet's cross-attention width differs; a first text
    encoder it lacks), an SD 1.x-sized LoRA on the base. Nothing is merged, no adapter is left behind."""
    refiner = Engine.load(xl["tmp"] / "refiner", prepack=False, precision="exact")
    with pytest.raises(L.LoraError, match=r"xl_kohya\.safetensors: made for a model of cross-attention width 72, this "
                                          r"model is the SDXL refiner \(40\)"):
        with L.engine_with_loras(refiner, [(xl["files"]["kohya"], 1.0)]):
            pass
    te1 = write_kohya(xl["made"], xl["tmp"] / "te1.safetensors", components=("text_encoder",))
    with pytest.raises(L.LoraError, match=r"te1\.safetensors: made for the SDXL base model .*this model is the SDXL "
                                          r"refiner, whose only text encoder is text_encoder_2"):
        with L.engine_with_loras(refiner, [(te1, 1.0)]):
            pass
    assert refiner.models.adapters == []
    engine = xl["engine"]
    small = _write(xl["tmp"] / "small.safetensors", {
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k": (32, 64)})
    with pytest.raises(L.LoraError, match=r"small\.safetensors: made for a model of cross-attention width 32, this "
                                          r"model is SDXL \(72\)"):
        with L.engine_with_loras(engine, [(xl["files"]["peft"], 1.0), (small, 1.0)]):
            pass
    assert engine.models.adapters == []
    assert torch.equal(engine.generate(REQUEST).latents, xl["plain"].latents)
