"""TAESD, the tiny autoencoder: exact against diffusers' ``AutoencoderTiny`` (fp32, the real 64-channel
architecture, random weights); read from every form users have it in (a diffusers folder; A1111's and madebyollin's
``taesd_decoder.pth`` / ``.safetensors`` halves, bare or under a prefix; a folder of them), with one clear error
per kind of bad file; and its two uses: ``sdlite generate --vae-decoder`` and the server's "TAESD" live previews."""
from __future__ import annotations

import functools
import re
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.cli import main
from sdlite.config import TAESDConfig
from sdlite.demo import model_path
from sdlite.errors import CheckpointError, SDLiteError
from sdlite.images import parse_infotext, read_parameters
from sdlite.models.taesd import TinyAutoencoder
from sdlite.pipeline import Engine, Request, RequestError, latents_to_images
from sdlite.weights.vae_keys import taesd_from_original
from sdlite.weights.taesd import TAESDError, TAESDNotFound, load_taesd, resolve_taesd, variant_from_name
from tests import loopback
from tests.reference import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference():
    """diffusers' AutoencoderTiny at its default (= TAESD's) config, random weights."""
    from diffusers import AutoencoderTiny

    return seed_all(AutoencoderTiny(), seed=3, scale=0.05).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def madebyollin(state: dict, part: str, prefix: str = "") -> dict:
    """One half of a canonical (diffusers) state dict in madebyollin's layout: a bare nn.Sequential whose decoder
    has a parameterless Clamp first, so its indices are one higher."""
    shift = 1 if part == "decoder" else 0
    out = {}
    for key, value in state.items():
        m = re.fullmatch(rf"{part}\.layers\.(\d+)\.(.+)", key)
        if m:
            out[f"{prefix}{int(m.group(1)) + shift}.{m.group(2)}"] = value.clone()
    return out


def decoded(module, z):
    with torch.no_grad():
        return module.decode(z)


def reference_decoded(reference, z):
    with torch.no_grad():
        return reference.decode(z.float() / reference.config.scaling_factor).sample   # as diffusers' pipelines do


def reference_encoded(reference, x):
    with torch.no_grad():
        return reference.encode(x).latents


LATENTS = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(0)) * 2   # -> 32 x 48 images
IMAGES = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1


# --- the module ------------------------------------------------------------------------------------------------

def test_exact_against_diffusers(reference):
    ours = TinyAutoencoder(TAESDConfig()).eval()
    ours.load_state_dict(reference.state_dict())   # the same parameter names, strict
    out = decoded(ours, LATENTS)
    assert out.shape == (2, 3, 32, 48)
    assert torch.equal(out, reference_decoded(reference, LATENTS))
    assert out.std() > 0.05   # not a degenerate comparison
    with torch.no_grad():
        latents = ours.encode(IMAGES)
    assert latents.shape == (2, 4, 4, 6)
    assert torch.equal(latents, reference_encoded(reference, IMAGES))
    # latents <-> [0, 1] for 8-bit storage, as madebyollin's scale_latents / unscale_latents
    assert torch.equal(ours.scale_latents(latents), reference.scale_latents(latents))
    assert torch.equal(ours.unscale_latents(ours.scale_latents(latents)),
                       reference.unscale_latents(reference.scale_latents(latents)))


def test_bf16_runs_fused_convolutions_close_to_the_unfused_and_to_diffusers(reference, monkeypatch):
    """In bf16 on a CPU each convolution takes its ReLU (and a Block's sum) inside oneDNN: every convolution of both
    halves runs fused (where oneDNN runs bf16: not on AVX2 CPUs, where none is), and the result is as near diffusers' fp32 as the unfused bf16 layers'."""
    import sdlite.models.taesd as taesd

    ours = TinyAutoencoder(TAESDConfig()).eval()
    ours.load_state_dict(reference.state_dict())
    ours = ours.to(torch.bfloat16).to(memory_format=torch.channels_last)
    calls = []
    fused = taesd._fused
    monkeypatch.setattr(taesd, "_fused", lambda *a, **k: calls.append(k.get("add") is not None) or fused(*a, **k))
    z, x = LATENTS.to(torch.bfloat16), IMAGES.to(torch.bfloat16)
    with torch.no_grad():
        out, lat = ours.decode(z).float(), ours.encode(x).float()
        convs = sum(isinstance(m, torch.nn.Conv2d) for m in ours.modules())
        blocks = sum(isinstance(m, taesd.Block) for m in ours.modules())
        if taesd._onednn_bf16():
            assert len(calls) == convs and sum(calls) == blocks   # every convolution fused, a Block's sum with its last
        else:
            assert calls == []   # oneDNN runs no bf16 here (an AVX2 CPU): PyTorch's own convolutions
        monkeypatch.setattr(taesd, "_fusable", lambda x: False)
        plain_out, plain_lat = ours.decode(z).float(), ours.encode(x).float()
    want_out, want_lat = reference_decoded(reference, LATENTS), reference_encoded(reference, IMAGES)
    for got, plain, want in ((out, plain_out, want_out), (lat, plain_lat, want_lat)):
        scale = want.abs().max().item()
        # bf16 through 20-odd layers: both within 4 % of the output's range of fp32 at most (2 % measured), and the
        # fused layers' mean error no larger than the unfused ones' (equal within 2 % measured)
        assert (got - plain).abs().max().item() <= 0.04 * scale
        assert (got - want).abs().max().item() <= 0.04 * scale
        assert (got - want).abs().mean().item() <= (plain - want).abs().mean().item() * 1.2 + 1e-6


def test_key_table():
    plan = taesd_from_original(["1.weight", "1.bias", "3.conv.4.bias", "19.weight", "0.x"], "decoder")
    assert {k: e.sources[0] for k, e in plan.entries.items()} == {
        "decoder.layers.0.weight": "1.weight", "decoder.layers.0.bias": "1.bias",
        "decoder.layers.2.conv.4.bias": "3.conv.4.bias", "decoder.layers.18.weight": "19.weight"}
    assert plan.unexpected == ["0.x"]   # the decoder's layer 0 is the parameterless clamp
    plan = taesd_from_original(["encoder.0.weight", "encoder.2.weight", "other"], "encoder", prefix="encoder.")
    assert {k: e.sources[0] for k, e in plan.entries.items()} == {
        "encoder.layers.0.weight": "encoder.0.weight", "encoder.layers.2.weight": "encoder.2.weight"}


def test_variant_from_name():
    assert [variant_from_name(n) for n in ("taesd_decoder.pth", "TAESDXL_decoder.safetensors", "taesd3_encoder.pth",
                                           "taef1", "vae_tiny")] == ["sd", "sdxl", "sd3", "flux", None]


# --- reading what users have -----------------------------------------------------------------------------------

def test_diffusers_folder(reference, tmp_path):
    reference.save_pretrained(tmp_path / "taesdxl")
    taesd = load_taesd(tmp_path / "taesdxl", parts=("decoder", "encoder"))
    assert taesd.config.variant == "sdxl" and taesd.name == "taesdxl"
    assert not taesd.training and not any(p.requires_grad for p in taesd.parameters())
    assert torch.equal(decoded(taesd, LATENTS), reference_decoded(reference, LATENTS))
    with torch.no_grad():
        assert torch.equal(taesd.encode(IMAGES), reference_encoded(reference, IMAGES))
    only_decoder = load_taesd(tmp_path / "taesdxl", "sdxl")
    assert only_decoder.encoder is None and torch.equal(decoded(only_decoder, LATENTS), decoded(taesd, LATENTS))
    with pytest.raises(TAESDNotFound, match="is a TAESD for sdxl latents"):
        load_taesd(tmp_path / "taesdxl", "sd")


def test_diffusers_folder_of_another_config(tmp_path):
    from diffusers import AutoencoderTiny

    reference = seed_all(AutoencoderTiny(latent_channels=16, encoder_block_out_channels=(32,) * 4,
                                         decoder_block_out_channels=(32,) * 4), seed=5, scale=0.08).eval()
    reference.save_pretrained(tmp_path / "taef1")
    taesd = load_taesd(tmp_path / "taef1", parts=("decoder", "encoder"))
    assert (taesd.config.variant, taesd.config.latent_channels, taesd.config.decoder_channels) == ("flux", 16,
                                                                                                   (32,) * 4)
    z = torch.randn(1, 16, 3, 5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(decoded(taesd, z), reference_decoded(reference, z))
    with torch.no_grad():
        assert torch.equal(taesd.encode(IMAGES[:1, :, :24, :40]), reference_encoded(reference, IMAGES[:1, :, :24, :40]))


def test_a1111_files(reference, tmp_path):
    from safetensors.torch import save_file

    state = reference.state_dict()
    torch.save(madebyollin(state, "decoder"), tmp_path / "taesd_decoder.pth")   # a plain state dict, as published
    torch.save(madebyollin(state, "encoder"), tmp_path / "taesd_encoder.pth")
    save_file(madebyollin(state, "decoder", "decoder."), tmp_path / "taesdxl_decoder.safetensors")
    want = reference_decoded(reference, LATENTS)

    decoder = load_taesd(tmp_path / "taesd_decoder.pth")
    assert decoder.config.variant == "sd" and decoder.name == "taesd_decoder.pth" and decoder.encoder is None
    assert torch.equal(decoded(decoder, LATENTS), want)
    encoder = load_taesd(tmp_path / "taesd_encoder.pth", parts=("encoder",))
    with torch.no_grad():
        assert torch.equal(encoder.encode(IMAGES), reference_encoded(reference, IMAGES))
    xl = load_taesd(tmp_path / "taesdxl_decoder.safetensors", "sdxl")
    assert xl.config.variant == "sdxl" and torch.equal(decoded(xl, LATENTS), want)

    # a folder of them (A1111's models/VAE-approx): the variant asked for
    sd = load_taesd(tmp_path, "sd", parts=("decoder", "encoder"))
    assert sd.config.variant == "sd" and sd.name == "taesd_decoder.pth+taesd_encoder.pth"
    with torch.no_grad():
        assert torch.equal(sd.encode(IMAGES), reference_encoded(reference, IMAGES))
    assert load_taesd(tmp_path, "sdxl").name == "taesdxl_decoder.safetensors"
    with pytest.raises(TAESDError, match=r"several latent spaces \(sd, sdxl\); say which"):
        load_taesd(tmp_path)
    with pytest.raises(TAESDNotFound, match="has no taesdxl_decoder and taesdxl_encoder file"):
        load_taesd(tmp_path, "sdxl", parts=("decoder", "encoder"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TAESDNotFound, match="has no taesd_decoder file .*; it has: no TAESD files"):
        load_taesd(tmp_path / "empty", "sd")


def test_pth_is_read_without_running_its_code(reference, tmp_path):
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("ran",))

    torch.save({**madebyollin(reference.state_dict(), "decoder"), "x": Payload()}, tmp_path / "taesd_decoder.pth")
    with pytest.raises(CheckpointError, match="taesd_decoder.pth"):
        load_taesd(tmp_path / "taesd_decoder.pth")
    assert ran == []


@pytest.mark.parametrize("change,words", [
    (lambda s: s.update({"3.conv.9.weight": torch.zeros(1)}), ["not a TAESD decoder of the known architecture",
                                                                 "1 unexpected keys", "'3.conv.9.weight'"]),
    (lambda s: s.pop("5.conv.2.bias"), ["1 missing keys", "'decoder.layers.4.conv.2.bias'"]),
    (lambda s: s.update({"3.conv.0.weight": torch.zeros(64, 64, 1, 1)}),
     ["tensor '3.conv.0.weight': has shape [64, 64, 1, 1], but the TAESD decoder needs [64, 64, 3, 3] there "
      "(decoder.layers.2.conv.0.weight)"]),
    (lambda s: s.update({"1.weight": torch.zeros(64, 4, 3)}),
     ["tensor '1.weight': has shape [64, 4, 3], not that of a convolution weight"]),
    (lambda s: [s.clear(), s.update({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3)})],
     ["is not a TAESD: none of its 1 keys is a TAESD layer", "'encoder.conv_in.weight'"]),
    (lambda s: s.update({"0.weight": torch.zeros(64, 3, 3, 3)}),
     ["is named as a TAESD decoder but holds the layers of a TAESD encoder"]),
])
def test_bad_files_name_file_key_and_shape(reference, tmp_path, change, words):
    state = madebyollin(reference.state_dict(), "decoder")
    change(state)
    path = tmp_path / "taesd_decoder.pth"
    torch.save(state, path)
    with pytest.raises(TAESDError) as info:
        load_taesd(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for word in words:
        assert word in message, message


def test_bad_folders(reference, tmp_path):
    reference.save_pretrained(tmp_path / "tiny")
    config = tmp_path / "tiny" / "config.json"
    config.write_text(config.read_text().replace('"relu"', '"silu"'))
    with pytest.raises(TAESDError, match=r"config.json: TAESD config field act_fn='silu' is not supported"):
        load_taesd(tmp_path / "tiny")
    (tmp_path / "tiny" / "diffusion_pytorch_model.safetensors").unlink()
    config.write_text(config.read_text().replace('"silu"', '"relu"'))
    with pytest.raises(TAESDError, match="has a config.json but no weights"):
        load_taesd(tmp_path / "tiny")
    with pytest.raises(TAESDNotFound, match="no such file or folder"):
        load_taesd(tmp_path / "nothing")


# --- the engine: the final decode and the previews -------------------------------------------------------------

def test_engine_decodes_with_taesd(engine, reference, tmp_path):
    torch.save(madebyollin(reference.state_dict(), "decoder"), tmp_path / "taesd_decoder.pth")
    request = Request(prompt="a red circle on a blue background", steps=2, seed=7)
    plain = engine.generate(request)
    engine.set_vae_decoder(load_taesd(tmp_path / "taesd_decoder.pth", "sd"))
    try:
        fast = engine.generate(request)
    finally:
        engine.set_vae_decoder(None)
    assert torch.equal(fast.latents, plain.latents)
    # diffusers' pipeline with an AutoencoderTiny as its VAE: vae.decode(latents / vae.config.scaling_factor)
    want = latents_to_images(reference_decoded(reference, fast.latents))
    assert np.array_equal(np.asarray(fast.images[0]), np.asarray(want[0]))
    assert fast.infotext["VAE decoder"] == "taesd_decoder.pth" and "VAE decoder" not in plain.infotext
    assert engine.generate(request).images[0].tobytes() == plain.images[0].tobytes()   # None: the VAE again


def test_engine_refuses_a_taesd_of_other_latents(engine, reference):
    with pytest.raises(RequestError, match=r"taesdxl is a TAESD for sdxl latents; this model \(sd1\) needs one for sd"):
        taesd = TinyAutoencoder(TAESDConfig(variant="sdxl"), encoder=False)
        taesd.name = "taesdxl"
        engine.set_vae_decoder(taesd)
    with pytest.raises(RequestError, match="decodes 16-channel latents 8x; this model's are 4-channel, 8x"):
        engine.set_vae_decoder(TinyAutoencoder(TAESDConfig(latent_channels=16)))
    with pytest.raises(RequestError, match="holds no TAESD decoder"):
        engine.set_preview_decoder(TinyAutoencoder(TAESDConfig(), decoder=False))
    assert engine.vae_decoder is None and engine.preview_decoder is None


def test_engine_preview_with_taesd(engine, reference):
    taesd = TinyAutoencoder(TAESDConfig(variant="sd"), encoder=False).eval()
    taesd.load_state_dict({k: v for k, v in reference.state_dict().items() if k.startswith("decoder.")})
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    cheap = engine.preview(latents, tiny=True)[0]   # no preview decoder: the cheap approximation
    assert cheap.tobytes() == engine.preview(latents)[0].tobytes()
    engine.set_preview_decoder(taesd)
    try:
        image = engine.preview(latents, tiny=True)[0]
    finally:
        engine.set_preview_decoder(None)
    assert image.size == (64, 64)
    assert image.tobytes() == latents_to_images(reference_decoded(reference, latents))[0].tobytes()


# --- sdlite generate --vae-decoder ------------------------------------------------------------------------------

def demo_with_taesd(reference, folder):
    """The demo model's folder (its parts linked) with a TAESD in its vae_tiny subfolder."""
    folder.mkdir()
    demo = model_path()
    for part in demo.iterdir():
        (folder / part.name).symlink_to(part, target_is_directory=part.is_dir())
    reference.save_pretrained(folder / "vae_tiny")
    return folder


def test_cli_vae_decoder(reference, engine, tmp_path, capsys):
    model = demo_with_taesd(reference, tmp_path / "demo")
    args = ["generate", "a red circle on a blue background", "--steps", "2", "--seed", "5"]
    assert main([*args, "--model", str(model), "--vae-decoder", "taesd", "--output", str(tmp_path / "a.png")]) == 0
    params = parse_infotext(read_parameters(tmp_path / "a.png"))
    assert params["VAE decoder"] == "vae_tiny"
    engine.set_vae_decoder(load_taesd(model / "vae_tiny", "sd"))
    try:
        want = engine.generate(Request(prompt="a red circle on a blue background", steps=2, seed=5)).images[0]
    finally:
        engine.set_vae_decoder(None)
    with Image.open(tmp_path / "a.png") as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(want))

    torch.save(madebyollin(reference.state_dict(), "decoder"), tmp_path / "taesd_decoder.pth")
    assert main([*args, "--vae-decoder", str(tmp_path / "taesd_decoder.pth"), "--output",
                 str(tmp_path / "b.png")]) == 0
    assert parse_infotext(read_parameters(tmp_path / "b.png"))["VAE decoder"] == "taesd_decoder.pth"
    capsys.readouterr()


@pytest.mark.parametrize("value,words", [
    ("taesd", ["--vae-decoder taesd:", "no TAESD kept with the model: none of the folders vae_tiny, taesd exists"]),
    ("nowhere/taesd_decoder.pth", ["--vae-decoder nowhere/taesd_decoder.pth:", "no such file or folder"]),
])
def test_cli_vae_decoder_errors(tmp_path, capsys, value, words):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["generate", "x", "--steps", "1", "--vae-decoder", value, "--output", str(out / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and "Traceback" not in err
    for word in words:
        assert word in err, err
    assert list(out.iterdir()) == []


def test_cli_vae_decoder_of_other_latents(reference, tmp_path, capsys):
    torch.save(madebyollin(reference.state_dict(), "decoder"), tmp_path / "taesdxl_decoder.pth")
    assert main(["generate", "x", "--steps", "1", "--vae-decoder", str(tmp_path / "taesdxl_decoder.pth"),
                 "--output", str(tmp_path / "x.png")]) == 2
    assert "is a TAESD for sdxl latents (its name says so); this model needs one for sd" in capsys.readouterr().err


def test_resolve_taesd(reference, tmp_path):
    model = demo_with_taesd(reference, tmp_path / "demo")
    assert resolve_taesd("taesd", model) == model / "vae_tiny"
    assert resolve_taesd("taesd", model / "model_index.json") == model / "vae_tiny"   # beside a single file
    with pytest.raises(SDLiteError, match="no TAESD kept with the model"):
        resolve_taesd("taesd", tmp_path)


# --- the server's "TAESD" live previews -------------------------------------------------------------------------

API = "/sdapi/v1"
wait_for = functools.partial(loopback.wait_for, timeout=60.0, every=0.02)
COLOUR = (0.9, 0.1, 0.5)   # what the flat TAESD below decodes everything to (in [0, 1])


def flat_taesd(reference, path):
    """A TAESD decoder whose last convolution ignores its input: every preview it makes is COLOUR."""
    state = madebyollin(reference.state_dict(), "decoder")
    state["19.weight"].zero_()
    state["19.bias"].copy_(torch.tensor(COLOUR))
    torch.save(state, path)


def preview_of_a_long_job(client):
    """Start a long txt2img, wait for a preview, interrupt it; the preview and the response's warnings."""
    from fastapi.testclient import TestClient  # noqa: F401 (the server extra)
    import base64
    import io
    import json

    results = {}
    worker = threading.Thread(target=lambda: results.update(r=client.post(
        f"{API}/txt2img", json={"prompt": "a red circle on a blue background", "steps": 400, "seed": 3})))
    worker.start()
    try:
        body = wait_for(lambda: (b := client.get(f"{API}/progress").json())["current_image"] and b)
    finally:
        client.post(f"{API}/interrupt")
        worker.join(60)
    assert results["r"].status_code == 200
    with Image.open(io.BytesIO(base64.b64decode(body["current_image"]))) as image:
        preview = np.asarray(image.convert("RGB"))
    return preview, json.loads(results["r"].json()["info"])["warnings"]


def test_server_taesd_previews(reference, tmp_path):
    from fastapi.testclient import TestClient

    from sdlite.server import create_app
    from sdlite.server.limits import Limits

    (tmp_path / "approx").mkdir()
    flat_taesd(reference, tmp_path / "approx" / "taesd_decoder.pth")
    flat_taesd(reference, tmp_path / "approx" / "taesdxl_decoder.pth")   # for SDXL models: not used by the demo
    options = {"show_progress_type": "TAESD", "show_progress_every_n_steps": 1}
    expected = np.asarray(latents_to_images(torch.tensor(COLOUR).view(1, 3, 1, 1) * 2 - 1)[0])[0, 0]
    app = create_app(engine_options={"taesd": str(tmp_path / "approx")}, limits=Limits(max_steps=1000))
    with TestClient(app) as client:
        assert client.post(f"{API}/options", json=options).json() == {}
        preview, warnings = preview_of_a_long_job(client)
        assert preview.shape == (64, 64, 3) and (preview == expected).all()
        assert not any("TAESD" in w for w in warnings), warnings

    # a server whose --taesd has none for the model's latents: the cheap preview, and a warning
    (tmp_path / "approx" / "taesd_decoder.pth").unlink()
    app = create_app(engine_options={"taesd": str(tmp_path / "approx")}, limits=Limits(max_steps=1000))
    with TestClient(app) as client:
        assert client.post(f"{API}/options", json=options).json() == {}
        preview, warnings = preview_of_a_long_job(client)
        assert preview.shape == (64, 64, 3) and not (preview == expected).all()
        assert any("show_progress_type 'TAESD' needs a TAESD for this model's latents" in w for w in warnings), \
            warnings
