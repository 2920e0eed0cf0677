"""What a warm engine keeps between requests, and what stands in for the VAE: a request's text encodings are
remembered (the same prompt again encodes nothing, the image is the same bit for bit) unless anything they depend
on changed (clip skip, the embeddings' files, a LoRA that changes a text encoder; one of the UNet alone keeps them),
and a TAESD decoder computes as the VAE does under the engine's precision (its dtype, prepacked / Winograd layers,
channels-last) without changing the module it was given."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch

from sdlite.config import TAESDConfig
from sdlite.demo import model_path
from sdlite.engine.memory import ModelManager
from sdlite.families.loaded import TEXT_CACHE_SIZE
from sdlite.models.taesd import TinyAutoencoder
from sdlite.pipeline import Engine, Request
from tests.reference import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = Path(str(resources.files("sdlite").joinpath("data", "loras", "demo_teal.safetensors")))


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


@pytest.fixture
def counted(engine, monkeypatch):
    """The texts the family's text encoders were run on, call by call."""
    calls: list[tuple[str, ...]] = []
    encode = engine.family.encode_texts

    def counting(model, texts, *args, **kwargs):
        calls.append(tuple(texts))
        return encode(model, texts, *args, **kwargs)

    monkeypatch.setattr(engine.family, "encode_texts", counting)
    engine._text_cache.clear()
    yield calls
    engine._text_cache.clear()


def request(**kw) -> Request:
    return Request(**{"prompt": "a red circle on a blue background", "negative_prompt": "green", "steps": 2,
                      "seed": 3, **kw})


def test_same_prompt_is_encoded_once(engine, counted):
    first = engine.generate(request())
    again = engine.generate(request(seed=4))
    same = engine.generate(request())
    assert counted == [("a red circle on a blue background", "green", "")]
    assert same.images[0].tobytes() == first.images[0].tobytes()
    assert again.images[0].tobytes() != first.images[0].tobytes()
    assert same.timings["text"] < first.timings["text"]   # nothing ran: a dict lookup against a text encoder pass


def test_what_the_encoding_depends_on_is_encoded_again(engine, counted, tmp_path):
    engine.generate(request())
    engine.generate(request(clip_skip=2))
    engine.generate(request(prompt="a blue square"))
    assert len(counted) == 3
    # embeddings: another folder with another file of the same name gives other vectors, so it is encoded again
    width = engine.spec.text.width
    results = []
    for sign in (1, -1):
        folder = tmp_path / f"emb{sign}"
        folder.mkdir()
        torch.save({"string_to_param": {"*": sign * torch.ones(1, width)}}, folder / "shapey.pt")
        with_emb = request(prompt="a shapey circle", embeddings_dir=str(folder))
        results.append(engine.generate(with_emb))
        engine.generate(with_emb)
    assert len(counted) == 5 and results[0].images[0].tobytes() != results[1].images[0].tobytes()


def test_nothing_is_reused_while_loras_are_applied(engine, counted):
    r = request(loras=((str(LORA), 1.0),))
    engine.generate(r)
    engine.generate(r)
    assert len(counted) == 2
    plain = engine.generate(request())     # without the LoRA: encoded once more, then remembered
    assert engine.generate(request()).images[0].tobytes() == plain.images[0].tobytes()
    assert len(counted) == 3


@pytest.fixture(scope="module")
def split_loras(tmp_path_factory):
    """The demo LoRA cut in two files: its UNet's layers alone, and its text encoder's alone."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("split-loras")
    state = load_file(LORA)
    made = {}
    for part, prefix in (("unet", "lora_unet_"), ("te", "lora_te_")):
        kept = {k: v for k, v in state.items() if k.startswith(prefix)}
        assert kept and len(kept) < len(state)
        save_file(kept, folder / f"demo_teal_{part}.safetensors")
        made[part] = str(folder / f"demo_teal_{part}.safetensors")
    return made


def test_a_lora_of_the_denoiser_alone_keeps_the_text_cache(engine, counted, split_loras):
    """A LoRA that changes only the UNet leaves the text encoders as they are: the prompt encoded without it is
    reused (one encoder call in all), the LoRA still applied (another image), and the image is the one of a run that
    encodes the prompt afresh."""
    plain = engine.generate(request())
    r = request(loras=((split_loras["unet"], 1.0),))
    cached = engine.generate(r)
    assert engine.generate(r).images[0].tobytes() == cached.images[0].tobytes()
    assert len(counted) == 1
    assert cached.images[0].tobytes() != plain.images[0].tobytes()
    engine._text_cache.clear()
    assert engine.generate(r).images[0].tobytes() == cached.images[0].tobytes()
    assert len(counted) == 2


def test_a_lora_of_the_text_encoder_is_never_served_from_the_cache(engine, counted, split_loras):
    """A LoRA that changes the text encoder: its prompt is encoded each time (not the plain encoding remembered
    before, not its own), and the image differs from the plain one (the LoRA changed only the encoding) and equals the
    one of a run with an empty cache."""
    plain = engine.generate(request())
    r = request(loras=((split_loras["te"], 1.0),))
    first = engine.generate(r)
    again = engine.generate(r)
    assert len(counted) == 3
    assert first.images[0].tobytes() == again.images[0].tobytes() != plain.images[0].tobytes()
    engine._text_cache.clear()
    assert engine.generate(r).images[0].tobytes() == first.images[0].tobytes()
    assert engine.generate(request()).images[0].tobytes() == plain.images[0].tobytes()


def test_the_cache_is_bounded(engine, counted):
    for i in range(TEXT_CACHE_SIZE + 2):
        engine.generate(request(prompt=f"circle {i}", steps=1))
    assert len(engine._text_cache) == TEXT_CACHE_SIZE
    engine.generate(request(prompt="circle 0", steps=1))   # the oldest went first
    assert len(counted) == TEXT_CACHE_SIZE + 3


# --- a TAESD decoder under the engine's precision ----------------------------------------------------------------

@pytest.fixture(scope="module")
def taesd():
    return seed_all(TinyAutoencoder(TAESDConfig(variant="sd"), encoder=False), seed=5, scale=0.05).eval()


LATENTS = torch.randn(1, 4, 40, 40, generator=torch.Generator().manual_seed(0))  # 320 px: Winograd's sizes


def decode(module, latents=LATENTS):
    with torch.no_grad():
        return module.decode(latents.to(module.dtype)).float()


def test_taesd_as_the_exact_vae(taesd):
    adapted = ModelManager(None).adapt_like_vae(taesd)
    assert adapted is not taesd and adapted.dtype == torch.float32
    assert torch.equal(decode(adapted), decode(taesd))   # the exact path: diffusers' bits (tests/test_taesd.py)


def test_taesd_as_the_fp32_fast_vae(taesd):
    manager = ModelManager(None, prepack=False, winograd=True, channels_last=True, fp32_kernels=True)
    adapted = manager.adapt_like_vae(taesd)
    conv = next(m for m in adapted.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] == 3)
    assert type(conv) is torch.nn.Conv2d and conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert (decode(adapted) - decode(taesd)).abs().max() < 1e-4   # channels-last convolutions sum in another order


def test_taesd_in_bf16_channels_last(taesd):
    manager = ModelManager(None, dtype=torch.bfloat16, vae_dtype=torch.bfloat16, channels_last=True)
    adapted = manager.adapt_like_vae(taesd)
    assert adapted.dtype == torch.bfloat16 and taesd.dtype == torch.float32
    conv = next(m for m in adapted.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] == 3)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    got, want = decode(adapted), decode(taesd)
    # bf16 keeps 8 bits of mantissa: the images, as the engine clamps them to [-1, 1], agree to ~50 dB
    mse = ((got.clamp(-1, 1) - want.clamp(-1, 1)) / 2).square().mean()
    assert 10 * torch.log10(1 / mse) > 45


def test_the_hires_fix_records_its_taesd_decoder(engine, taesd):
    from sdlite.hires import Hires

    engine.set_vae_decoder(taesd)
    try:
        result = engine.generate(request(steps=1, hires=Hires(scale=1.5, steps=2)))
    finally:
        engine.set_vae_decoder(None)
    assert result.infotext["VAE decoder"] == taesd.name and result.images[0].size == (96, 96)
