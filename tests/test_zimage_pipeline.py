"""Z-Image end to end against diffusers' ZImagePipeline on a tiny random model saved as a diffusers folder: the Qwen3
encoder's second-to-last hidden state over the chat-templated prompt's real tokens, captions of their own lengths,
the S3-DiT, flow matching with the Turbo's shift over linspace sigmas, the 16-channel VAE's shift and scale; batch 2,
two sizes (one not square), English and Chinese prompts, CFG with a negative prompt (diffusers' guidance_scale g is
cfg g + 1), and what the family refuses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import sdlite
from sdlite.config import VAEConfig
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import diffusers_vae, seed_all
from tests.test_qwen import QWEN3_CHAT_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
QWEN_JSON = Path(sdlite.__file__).parent / "data" / "qwen" / "tokenizer.json"
TEXT_WIDTH = 32
QWEN = dict(vocab_size=151936, hidden_size=TEXT_WIDTH, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            max_position_embeddings=1024, tie_word_embeddings=True)
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2,
                   n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=TEXT_WIDTH,
                   rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 12, 12], axes_lens=[1536, 512, 512])
VAE = VAEConfig(latent_channels=16, block_channels=(32, 64, 64, 64), layers_per_block=1, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, sample_size=64)
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"
PROMPT_ZH = "蓝色背景上的红色圆圈，一只猫"


def _qwen(seed: int, config: dict = QWEN, scale: float = 0.2):
    from transformers import Qwen3Config, Qwen3Model

    return seed_all(Qwen3Model(Qwen3Config(**config, attn_implementation="eager")).eval(), seed, scale=scale)


def _pipeline(folder: Path, *, transformer: dict = TRANSFORMER, qwen: dict = QWEN, vae: VAEConfig = VAE,
              scales: tuple[float, float] = (0.15, 0.2), contrast: float = 30.0):
    """A ZImagePipeline of random weights (the Turbo's scheduler: shift 3, no dynamic shifting), saved in ``folder``:
    tiny by default; ``transformer``, ``qwen`` and ``vae`` give other configs (bench/parity.py: the released widths
    at reduced depth), ``scales`` the transformer's and the encoder's weight scales and ``contrast`` the factor on the
    VAE's output layer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen2TokenizerFast

    from sdlite.config.zimage import ZIMAGE_TURBO_SCHEDULER

    vae = seed_all(diffusers_vae(vae), 1, scale=0.05)
    with torch.no_grad():   # contrast enough that 2/255 means something (tests.reference.with_contrast)
        vae.decoder.conv_out.weight.mul_(contrast)
    transformer = seed_all(ZImageTransformer2DModel(**transformer).eval(), 4, scale=scales[0])
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in ZIMAGE_TURBO_SCHEDULER.items()
                                                   if not k.startswith("_")})
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=_qwen(2, qwen, scales[1]), tokenizer=tokenizer,
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "z-image"
    pipe = _pipeline(folder)
    return pipe, Engine.load(folder, precision="exact"), folder


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _reference(pipe, width, height, **kw) -> np.ndarray:
    out = pipe(height=height, width=width, output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def test_folder_opens_as_zimage(model):
    _, engine, _ = model
    spec = engine.spec
    assert spec.family == "z-image-turbo" and spec.denoiser == "transformer"
    assert spec.text_encoders == ("text_encoder",)
    assert spec.text.hidden_size == TEXT_WIDTH and spec.text.num_hidden_layers == 3 and spec.text.qk_norm
    assert spec.transformer.dim == 64 and spec.transformer.n_layers == 2
    assert spec.vae.shift_factor == pytest.approx(0.1159) and spec.vae.scaling_factor == pytest.approx(0.3611)
    assert engine.family.sampling_defaults == {"steps": 8, "cfg": 1.0, "sampler": "euler", "timestep_spacing": None}
    assert engine.schedule.shift == 3.0 and not engine.schedule.use_dynamic_shifting


@pytest.mark.parametrize("prompt,steps,width,height", [(PROMPT, 4, 64, 64), (PROMPT_ZH, 3, 96, 64)])
def test_txt2img_matches_zimagepipeline(model, prompt, steps, width, height):
    """Batch 2 without guidance (the Turbo's way), at a square and a non-square size, in English and Chinese."""
    pipe, engine, _ = model
    expected = _reference(pipe, width, height, prompt=prompt, num_inference_steps=steps, guidance_scale=0.0,
                          num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (7, 8)])
    got = _pixels(engine.generate(Request(prompt=prompt, steps=steps, cfg_scale=1.0, seed=7, batch_size=2,
                                          width=width, height=height, sampler="euler")).images)
    assert got.shape == expected.shape == (2, height, width, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"


def test_cfg_is_diffusers_guidance_plus_one(model):
    """CFG with a negative prompt of another length than the prompt's: diffusers' guidance_scale 2.5 is cfg 3.5
    (A1111's uncond + cfg * (cond - uncond)); the captions are masked to their own lengths in the batched call."""
    pipe, engine, _ = model
    expected = _reference(pipe, 64, 64, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3,
                          guidance_scale=2.5, num_images_per_prompt=2,
                          generator=[torch.Generator().manual_seed(s) for s in (3, 4)])
    got = _pixels(engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=3.5, seed=3,
                                          batch_size=2, width=64, height=64, sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    unguided = _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, seed=3, batch_size=2,
                                               width=64, height=64, sampler="euler")).images)
    assert np.abs(got - unguided).max() > 10, "guidance should change the images"


def test_emphasis_and_break_are_read_as_plain_words(model):
    _, engine, _ = model
    plain = engine.generate(Request(prompt="a red circle BREAK on blue", steps=2, seed=1, width=64, height=64,
                                    sampler="euler"))
    weighted = engine.generate(Request(prompt="a (red:1.3) circle BREAK on [blue]", steps=2, seed=1, width=64,
                                       height=64, sampler="euler"))
    assert np.array_equal(_pixels(plain.images), _pixels(weighted.images))
    assert any("emphasis" in w for w in weighted.warnings) and any("BREAK" in w for w in weighted.warnings)


def test_refusals(model):
    _, engine, _ = model
    with pytest.raises(RequestError, match="multiples of 16"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=72, height=64, sampler="euler"))
    with pytest.raises(RequestError, match="clip skip"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=64, height=64, clip_skip=2, sampler="euler"))
    with pytest.raises(RequestError, match="skip-layer guidance"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=64, height=64, cfg_scale=2.0, slg_layers=(0,),
                                sampler="euler"))


def test_comfyui_sampling_takes_sides_of_multiples_of_8(model):
    """ComfyUI's sampling at 72 x 56 (a 9 x 7 latent, which ComfyUI's NextDiT pads to whole 2 x 2 patches; the
    network's padding against diffusers in tests.test_zimage_model) draws an image of that size, not the corner of a
    larger one; the A1111 sampling refuses the size, naming the nearest."""
    _, engine, _ = model
    r = Request(prompt=PROMPT, steps=2, width=72, height=56, sampler="euler", schedule="simple", noise="comfy", seed=3)
    odd = _pixels(engine.generate(r).images)
    assert odd.shape == (1, 56, 72, 3) and odd.std() > 5
    even = _pixels(engine.generate(r.replace(width=64, height=48)).images)
    assert np.abs(odd[:, :48, :64] - even).max() > 2
    with pytest.raises(RequestError, match=r"72x56 is not: the nearest that are: 64x48 or 80x64"):
        engine.generate(r.replace(noise="a1111", schedule=None))


def test_off_exact_the_encoder_reads_the_prompts_tokens_alone(model):
    """Away from exact, the Qwen encoder runs on the batch's longest chat-templated prompt rather than 512 positions
    (causal attention: no real token sees the pads after it). The captions are the same values; exact keeps the
    pipeline's 512 rows."""
    import dataclasses

    _, engine, _ = model
    texts = [PROMPT, PROMPT_ZH, ""]
    lengths = []
    with engine.models.use("text_encoder") as encoder:
        hook = encoder.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    try:
        exact, _ = engine.family.encode_texts(engine, texts, 1, None)
        precision = engine.precision
        engine.precision = dataclasses.replace(precision, name="fp32-fast")
        try:
            cut, _ = engine.family.encode_texts(engine, texts, 1, None)
        finally:
            engine.precision = precision
    finally:
        hook.remove()
    assert lengths[0] == 512 and lengths[1] == max(c.shape[1] for c in exact) < 40
    for a, b in zip(exact, cut):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision,kept", [("int8", 31), ("int4", 27)])
def test_low_bit_precisions_keep_the_blocks_and_the_encoder_quantized(model, precision, kept):
    """--precision int8 / int4: the transformer's block Linears (its joint and refiner blocks; int4 where the inputs
    are whole groups of 64) and the Qwen encoder's decoder layers (int8 under both, as T5's) stay quantised."""
    from sdlite.engine.lowbit import LowBitLinear

    _, _, folder = model
    engine = Engine.load(folder, precision=precision)
    with engine.models.use("transformer") as transformer:
        assert sum(isinstance(m, LowBitLinear) for m in transformer.modules()) == kept
    with engine.models.use("text_encoder") as encoder:
        layers = [m for m in encoder.modules() if isinstance(m, LowBitLinear)]
        assert len(layers) == 7 * QWEN["num_hidden_layers"]
    got = _pixels(engine.generate(Request(prompt=PROMPT, steps=2, seed=1, width=64, height=64,
                                          sampler="euler")).images)
    assert got.std() > 10
