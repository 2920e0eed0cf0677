"""SD3 LoRAs in the layouts they are published in, against diffusers' ``load_lora_weights`` + ``fuse_lora`` on a
tiny random SD3.5-Medium-like pipeline (MMDiT-X with a dual-attention block, CLIP-L, bigG, T5):

* diffusers / PEFT ``transformer.*``, ``text_encoder.*``, ``text_encoder_2.*`` with the alphas in
  ``lora_adapter_metadata``: the reference itself;
* kohya's underscored diffusers paths (``lora_transformer_*``, ``lora_te1_``/``lora_te2_``);
* kohya sd-scripts' original MMDiT layout (``lora_unet_joint_blocks_N_x_block_attn_qkv``: q, k and v stacked, and
  the (shift, scale) modulations in Stability's order),

all made of the same factors, so all three give diffusers' image. Also: memory mode 0 (applied on the fly as the
blocks stream) and resident merging agree; the weights come back exactly; the wrong family's LoRA is refused by
name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.adapters import lora as L
from sdlite.config import SD15
from sdlite.errors import SDLiteError
from sdlite.pipeline import Engine, Request
from sdlite.weights.mmdit_keys import mmdit_to_original
from tests.test_sd3_pipeline import MAX_PIXEL_DIFF, NEGATIVE, PROMPT, _pipeline, _pixels, _reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, ALPHA, WEIGHT = 4, 2.0, 0.8
# the transformer's layers a LoRA trainer targets (diffusers' SD3 training script's set and more: the
# modulations, the embedders and the output layers, whose original names differ most)
TRANSFORMER_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                       "attn2.to_out.0", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                       "norm1.linear", "norm1_context.linear", "norm_out.linear", "proj_out", "context_embedder",
                       "time_text_embed.timestep_embedder.linear_1")
TEXT_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
# q, k and v of one attention share their down factor, so the stacked layer of the original layout holds them
_FUSED = {"to_q": ("to_k", "to_v"), "add_q_proj": ("add_k_proj", "add_v_proj")}


def _linears(network, suffixes) -> dict[str, tuple[int, int]]:
    return {name: tuple(m.weight.shape) for name, m in network.named_modules()
            if isinstance(m, torch.nn.Linear) and (name.endswith(tuple("." + s for s in suffixes)) or name in suffixes)}


def _factors(shapes: dict, seed: int, strength: float = 0.6) -> dict:
    """name -> (down, up), strong enough to change the image clearly; q/k/v of one attention share ``down``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, cols) in sorted(shapes.items(), key=lambda item: not item[0].endswith(tuple(_FUSED))):
        head, _, leaf = name.rpartition(".")
        shared = next((f"{head}.{q}" for q, kv in _FUSED.items() if leaf in kv and f"{head}.{q}" in shapes), None)
        down = out[shared][0] if shared else torch.randn(RANK, cols, generator=g) / cols ** 0.5
        out[name] = (down, torch.randn(rows, RANK, generator=g) * strength / RANK ** 0.5)
    return out


def _write(path, layers: dict, metadata: dict | None = None, kohya: bool = False) -> str:
    """``layers``: file name of the layer -> (down, up). kohya: ``.lora_down/.lora_up/.alpha`` keys; else PEFT's."""
    state = {}
    for name, (down, up) in layers.items():
        if kohya:
            state.update({f"{name}.lora_down.weight": down.clone(), f"{name}.lora_up.weight": up.clone(),
                          f"{name}.alpha": torch.tensor(ALPHA if name.startswith(("lora_transformer_", "lora_unet_"))
                                                        else float(RANK))})
        else:
            state.update({f"{name}.lora_A.weight": down.clone(), f"{name}.lora_B.weight": up.clone()})
    save_file(state, str(path), metadata=metadata)
    return str(path)


def _original(transformer: dict) -> dict:
    """The transformer's factors under kohya sd-scripts' names for Stability's layout: q/k/v stacked (one ``down``,
    the ``up``s one above the other), the modulations that layout stores as (shift, scale) swapped."""
    plan = mmdit_to_original([f"{n}.weight" for n in transformer], prefix="").entries
    out = {}
    for original, entry in plan.items():
        names = [s.removesuffix(".weight") for s in entry.sources]
        if not original.endswith(".weight") or names[0] not in transformer:
            continue
        down = transformer[names[0]][0]
        ups = [transformer[n][1] for n in names]
        if entry.transform.op == "cat":
            assert all(transformer[n][0] is down for n in names)
            up = torch.cat(ups)
        elif entry.transform.op == "swap_halves":
            half = ups[0].shape[0] // 2
            up = torch.cat([ups[0][half:], ups[0][:half]])
        else:
            up = ups[0]
        out["lora_unet_" + original.removesuffix(".weight").replace(".", "_")] = (down, up)
    assert len(out) < len(transformer)   # some layers were stacked
    return out


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """The tiny pipeline, its saved folder loaded by sdlite (modes 1 and 0), and LoRA files of one set of factors
    in three layouts."""
    tmp = tmp_path_factory.mktemp("sd3_lora")
    pipe = _pipeline(tmp)
    pipe.save_pretrained(tmp / "sd3")
    transformer = _factors(_linears(pipe.transformer, TRANSFORMER_TARGETS), 11)
    clip_l = _factors(_linears(pipe.text_encoder, TEXT_TARGETS), 12)
    clip_g = _factors(_linears(pipe.text_encoder_2, TEXT_TARGETS), 13)
    config = {}   # diffusers' lora_adapter_metadata: each component's peft LoraConfig
    for component, factors, alpha in (("transformer", transformer, ALPHA), ("text_encoder", clip_l, RANK),
                                      ("text_encoder_2", clip_g, RANK)):
        config.update({f"{component}.r": RANK, f"{component}.lora_alpha": alpha, f"{component}.alpha_pattern": {},
                       f"{component}.rank_pattern": {}, f"{component}.use_dora": False,
                       f"{component}.use_rslora": False, f"{component}.peft_type": "LORA",
                       f"{component}.target_modules": sorted(factors)})
    files = {
        "peft": _write(tmp / "peft.safetensors",
                       {**{f"transformer.{n}": f for n, f in transformer.items()},
                        **{f"text_encoder.{n}": f for n, f in clip_l.items()},
                        **{f"text_encoder_2.{n}": f for n, f in clip_g.items()}},
                       metadata={"format": "pt", L.METADATA_KEY: json.dumps(config)}),
        "kohya": _write(tmp / "kohya.safetensors",
                        {**{"lora_transformer_" + n.replace(".", "_"): f for n, f in transformer.items()},
                         **{"lora_te1_" + n.replace(".", "_"): f for n, f in clip_l.items()},
                         **{"lora_te2_" + n.replace(".", "_"): f for n, f in clip_g.items()}}, kohya=True),
        "sd-scripts": _write(tmp / "sd_scripts.safetensors",
                             {**_original(transformer),
                              **{"lora_te1_" + n.replace(".", "_"): f for n, f in clip_l.items()},
                              **{"lora_te2_" + n.replace(".", "_"): f for n, f in clip_g.items()}}, kohya=True),
    }
    engine = Engine.load(tmp / "sd3", precision="exact")
    return pipe, engine, files, tmp


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "negative_prompt": NEGATIVE, "steps": 3, "cfg_scale": 5.0,
                      "sampler": "euler", "seed": 21, "batch_size": 2, **kw})


@pytest.fixture(scope="module")
def expected(sd3):
    """diffusers' image with the PEFT file fused at WEIGHT, and without a LoRA."""
    pytest.importorskip("peft", reason="diffusers' load_lora_weights needs the PEFT backend")
    pipe, _, files, _ = sd3
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3, guidance_scale=5.0,
              num_images_per_prompt=2)
    seeds = lambda: [torch.Generator().manual_seed(s) for s in (21, 22)]   # noqa: E731
    base = _reference(pipe, generator=seeds(), **kw)
    pipe.load_lora_weights(files["peft"], adapter_name="style")
    try:
        pipe.fuse_lora(lora_scale=WEIGHT, adapter_names=["style"])
        with_lora = _reference(pipe, generator=seeds(), **kw)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert np.abs(with_lora - base).mean() > 8, "the LoRA should change the image clearly"
    return with_lora, base


@pytest.mark.parametrize("layout", ["peft", "kohya", "sd-scripts"])
def test_each_layout_gives_diffusers_image(sd3, expected, layout):
    _, engine, files, _ = sd3
    with_lora, base = expected
    lora = L.read_lora(files[layout])
    assert {"text_encoder", "text_encoder_2"} <= set(lora.components())
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - with_lora).max() <= MAX_PIXEL_DIFF
    # the weights came back exactly: the next image without the LoRA is diffusers' base image
    assert np.abs(_pixels(engine.generate(_request()).images) - base).max() <= MAX_PIXEL_DIFF


def test_prompt_tag_and_low_memory_mode(sd3, expected):
    """A1111's ``<lora:name:weight>`` tag finds the file in the LoRA folder; memory mode 0 streams the transformer
    and applies the LoRA to each block as it is read: the same image as the resident merge."""
    _, engine, files, tmp = sd3
    with_lora, _ = expected
    low = Engine.load(tmp / "sd3", precision="exact", memory_mode=0)
    r = _request(prompt=f"{PROMPT} <lora:sd_scripts:{WEIGHT}>", lora_dir=str(tmp))
    got = _pixels(low.generate(r).images)
    assert np.abs(got - with_lora).max() <= MAX_PIXEL_DIFF
    assert np.array_equal(got, _pixels(engine.generate(r).images))


def test_the_wrong_family_is_refused(sd3, tmp_path):
    _, engine, files, _ = sd3
    sd15_like = _write(tmp_path / "sd15.safetensors", {
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k": (torch.zeros(RANK, 768),
                                                                                  torch.zeros(320, RANK))}, kohya=True)
    with pytest.raises(SDLiteError, match=r"sd15\.safetensors: made for SD 1\.x .*this model is SD3\.5 Medium, "
                                          "whose denoiser is a transformer"):
        engine.generate(_request(loras=((sd15_like, 1.0),)))
    with pytest.raises(L.LoraError, match=r"peft\.safetensors: made for a transformer model such as SD3 .*"
                                          "this model is SD 1.x, whose denoiser is a UNet"):
        L.check_denoiser(L.read_lora(files["peft"]), SD15)
    # a stacked q/k/v layer whose rows are not the three projections'
    down, up = torch.zeros(RANK, 32), torch.zeros(3 * 32 + 1, RANK)
    bad = _write(tmp_path / "bad.safetensors", {"lora_unet_joint_blocks_0_x_block_attn_qkv": (down, up)}, kohya=True)
    with pytest.raises(SDLiteError, match=r"bad\.safetensors: 'lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down"
                                          r".weight' does not fit 'transformer_blocks\.0\.attn\.to_q' \+ .*97 outputs, "
                                          "the layers have 32 \\+ 32 \\+ 32"):
        engine.generate(_request(loras=((bad, 1.0),)))
