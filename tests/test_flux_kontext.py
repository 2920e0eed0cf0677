"""FLUX.1 Kontext against diffusers' FluxKontextPipeline on tiny random models saved as diffusers folders: the source
image resized to Kontext's preferred resolutions (and not, with the flag off), encoded to its mean latent with FLUX's
shift and scale, its tokens after the image's with first-axis ids 1, their outputs dropped; Kontext's default guidance
2.5; batch 2; a FLUX.1 dev folder given the same reference; several references placed as ComfyUI places chained
ReferenceLatents (the transformer against diffusers' on those ids); the single file's name; the CLI's flag."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.pipeline import Engine, Request, RequestError
from tests.test_flux_pipeline import MAX_PIXEL_DIFF, PROMPT, SIZE, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import FluxKontextPipeline

    tmp = tmp_path_factory.mktemp("kontext")
    dev = _pipeline(tmp, "dev")
    kontext = FluxKontextPipeline(**dev.components)
    kontext.set_progress_bar_config(disable=True)
    kontext.save_pretrained(tmp / "kontext")
    return {"pipe": kontext, "kontext": Engine.load(tmp / "kontext", precision="exact"),
            "dev": Engine.load(tmp / "dev", precision="exact"), "folder": tmp}


def _image(seed: int, width: int, height: int) -> Image.Image:
    """A smooth random picture (the VAE's latents of noise would say little)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def _expected(pipe, image, width=SIZE, height=SIZE, seeds=(7,), **kw) -> np.ndarray:
    out = pipe(prompt=PROMPT, image=image, height=height, width=width, max_area=width * height,
               num_inference_steps=3, max_sequence_length=512, num_images_per_prompt=len(seeds),
               generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def test_the_folder_is_a_kontext_release(models):
    engine = models["kontext"]
    assert engine.spec.family == "flux-kontext" and engine.spec.transformer.guidance_embeds
    assert engine.family.takes_references and engine.family.kontext
    assert engine.family.sampling_defaults["steps"] == 28
    assert not models["dev"].family.kontext and models["dev"].family.takes_references


def test_auto_resize_matches_fluxkontextpipeline(models):
    """An 80x48 source (aspect 5:3) resized to Kontext's 1328x800, drawn at 96x64; Kontext's default guidance 2.5
    (given to the pipeline, whose own default is 3.5); batch 2, each image its own generator, the source encoded
    once."""
    source = _image(1, 80, 48)
    expected = _expected(models["pipe"], source, 96, 64, seeds=(7, 8), guidance_scale=2.5)
    got = models["kontext"].generate(Request(prompt=PROMPT, reference_images=(source,), width=96, height=64,
                                             steps=3, sampler="euler", cfg_scale=1.0, seed=7, batch_size=2))
    assert got.request.guidance == 2.5
    assert _pixels(got.images).shape == expected.shape == (2, 64, 96, 3)
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert _pixels(got.images).std() > 10


def test_resize_off_matches_the_pipelines_auto_resize_off(models):
    """A 72x56 source kept at its own size rounded down to multiples of 16 (64x48, Lanczos), as the pipeline with
    ``_auto_resize=False``; with no size given the output is that size."""
    source = _image(2, 72, 56)
    expected = _expected(models["pipe"], source, 64, 48, guidance_scale=4.0, _auto_resize=False)
    got = models["kontext"].generate(Request(prompt=PROMPT, reference_images=(source,), reference_resize=False,
                                             guidance=4.0, steps=3, sampler="euler", cfg_scale=1.0, seed=7))
    assert got.images[0].size == (64, 48)
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_the_reference_changes_the_image(models):
    source = _image(3, SIZE, SIZE)
    r = Request(prompt=PROMPT, width=SIZE, height=SIZE, steps=3, sampler="euler", cfg_scale=1.0, seed=7)
    edited = _pixels(models["kontext"].generate(r.replace(reference_images=(source,))).images)
    plain = _pixels(models["kontext"].generate(r).images)
    assert np.abs(edited - plain).max() > 10 * MAX_PIXEL_DIFF


def test_a_dev_model_takes_the_reference_the_same_way(models):
    """FLUX.1 dev's folder given a reference (ComfyUI's ReferenceLatent on any FLUX.1 model): Kontext's conditioning
    without the resize, at dev's guidance 3.5; the output takes the reference's size."""
    source = _image(4, 64, 48)
    expected = _expected(models["pipe"], source, 64, 48, guidance_scale=3.5, _auto_resize=False)
    got = models["dev"].generate(Request(prompt=PROMPT, reference_images=(source,), steps=3, sampler="euler",
                                         cfg_scale=1.0,
                                         seed=7))
    assert got.request.guidance == 3.5 and got.images[0].size == (64, 48)
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_several_references_are_placed_as_comfyui_chains_them(models):
    """The transformer with two references against diffusers' FluxTransformer2DModel given the sequence and ids as
    ComfyUI builds them: the first at (1, 0, 0), the second below it (it is wider than tall) from row 3 of
    patches."""
    from diffusers import FluxPipeline

    pipe, engine = models["pipe"], models["kontext"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=gen)
    refs = (torch.randn(1, 16, 6, 4, generator=gen), torch.randn(1, 16, 4, 8, generator=gen))
    context, pooled = torch.randn(2, 512, 48, generator=gen), torch.randn(2, 32, generator=gen)
    t, guidance = torch.tensor([0.7, 0.7]), torch.tensor([2.5, 2.5])
    with torch.no_grad(), engine.models.use("transformer") as net:
        got = net(x, t, context, pooled, guidance, references=refs)

    def ids(h, w, first=0.0, down=0):
        grid = FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32)
        grid[:, 0] = first
        grid[:, 1] += down
        return grid

    def packed(latent):
        b, c, h, w = latent.shape
        return FluxPipeline._pack_latents(latent, b, c, h, w)

    tokens = torch.cat([packed(x), packed(refs[0]).expand(2, -1, -1), packed(refs[1]).expand(2, -1, -1)], dim=1)
    img_ids = torch.cat([ids(4, 4), ids(3, 2, 1.0), ids(2, 4, 1.0, down=3)])
    with torch.no_grad():
        out = pipe.transformer(hidden_states=tokens, timestep=t, guidance=guidance, pooled_projections=pooled,
                               encoder_hidden_states=context, txt_ids=torch.zeros(512, 3), img_ids=img_ids,
                               return_dict=False)[0][:, :16]
    expected = FluxPipeline._unpack_latents(out, 64, 64, 8)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    one = engine.generate(Request(prompt=PROMPT, reference_images=(_image(5, 64, 64),), steps=2, sampler="euler",
                                  cfg_scale=1.0,
                                  seed=1, reference_resize=False))
    two = engine.generate(Request(prompt=PROMPT, reference_images=(_image(5, 64, 64), _image(6, 64, 32)), steps=2,
                                  sampler="euler", cfg_scale=1.0, seed=1, reference_resize=False))
    assert two.images[0].size == (64, 64)
    assert np.abs(_pixels(two.images) - _pixels(one.images)).max() > MAX_PIXEL_DIFF


def test_refusals_name_the_problem(models, tmp_path):
    schnell = _pipeline(tmp_path, "schnell")
    del schnell
    engine = Engine.load(tmp_path / "schnell", precision="exact")
    source = _image(0, SIZE, SIZE)
    with pytest.raises(RequestError, match=r"reference images .* FLUX.1 dev / Kontext .*\(flux-schnell\) takes none"):
        engine.generate(Request(prompt=PROMPT, reference_images=(source,), steps=1, sampler="euler", cfg_scale=1.0))
    with pytest.raises(RequestError, match="reference_resize 'no' is not valid"):
        models["kontext"].generate(Request(prompt=PROMPT, reference_images=(source,), reference_resize="no",
                                           steps=1, sampler="euler", cfg_scale=1.0))
    with pytest.raises(RequestError, match=r"reference image 1: a latent of shape \(1, 4, 8, 8\); this model's "
                                           "references are 16-channel latents"):
        models["kontext"].generate(Request(prompt=PROMPT, reference_images=(torch.zeros(1, 4, 8, 8),),
                                           width=SIZE, height=SIZE, steps=1, sampler="euler", cfg_scale=1.0))
    with pytest.raises(RequestError, match="reference image 1 is 12x40: both sides must be at least 16 pixels"):
        models["kontext"].generate(Request(prompt=PROMPT, reference_images=(_image(0, 12, 40),), width=SIZE,
                                           height=SIZE, reference_resize=False, steps=1, sampler="euler",
                                           cfg_scale=1.0))


def test_comfyui_latents_of_odd_sides_are_references_on_comfyuis_sampling(models):
    """A ReferenceLatent's latent of odd sides (a VAEEncode of an image whose sides are multiples of 8 pixels but not
    of 16) runs on ComfyUI's sampling, the network padding it as ComfyUI does (against diffusers in
    tests.test_flux_model); the A1111 sampling still asks for even sides."""
    latent = torch.randn(1, 16, 5, 7, generator=torch.Generator().manual_seed(2))
    r = Request(prompt=PROMPT, reference_images=(latent,), width=SIZE, height=SIZE, steps=2, sampler="euler",
                schedule="simple", cfg_scale=1.0, seed=1, noise="comfy")
    got = models["kontext"].generate(r)
    assert got.images[0].size == (SIZE, SIZE)
    with pytest.raises(RequestError, match=r"reference image 1: a latent of shape \(1, 16, 5, 7\).*even sides"):
        models["kontext"].generate(r.replace(noise="a1111", schedule=None))


def test_preferred_sizes():
    from sdlite.families.flux_kontext import kontext_size, preferred_size

    assert preferred_size(1000, 1000) == (1024, 1024)
    assert preferred_size(1920, 1080) == (1392, 752)   # 16:9 -> 1.85, the nearest of the list
    assert preferred_size(600, 1200) == (720, 1456)
    assert kontext_size(83, 50, resize=False) == (80, 48)
    assert kontext_size(83, 50, resize=True) == (1328, 800)


def test_a_single_file_named_kontext_is_a_kontext_release(tmp_path):
    """BFL's and ComfyUI's files are dev's in shape: the name tells the release."""
    from safetensors.torch import save_file

    from sdlite.loader import open_model
    from tests.test_flux_files import CLIP_L, T5, TEXT_L, TRANSFORMER, _parts

    parts = _parts(_pipeline(tmp_path, "dev", text_l=TEXT_L, save=False, **TRANSFORMER))
    aio = {**{"model.diffusion_model." + k: v for k, v in parts["transformer"].items()},
           **{"vae." + k: v for k, v in parts["vae"].items()},
           **{CLIP_L + k: v for k, v in parts["clip_l"].items()}, **{T5 + k: v for k, v in parts["t5"].items()}}
    save_file(aio, tmp_path / "flux1-kontext-dev.safetensors")
    save_file(aio, tmp_path / "flux1-dev.safetensors")
    assert open_model(tmp_path / "flux1-kontext-dev.safetensors").spec.family == "flux-kontext"
    assert open_model(tmp_path / "flux1-dev.safetensors").spec.family == "flux-dev"


def test_cli_edit_with_no_ref_resize(models, tmp_path, capsys):
    from sdlite.cli import main

    source = tmp_path / "source.png"
    _image(7, 72, 56).save(source)
    out = tmp_path / "edited.png"
    main(["edit", str(source), PROMPT, "-m", str(models["folder"] / "kontext"), "--no-ref-resize", "--steps", "2",
          "--seed", "3", "--precision", "exact", "-o", str(out)])
    got = np.asarray(Image.open(out).convert("RGB"), np.int16)
    expected = models["kontext"].generate(Request(prompt=PROMPT, reference_images=(str(source),),
                                                  reference_resize=False, steps=2, seed=3, sampler="euler",
                                                  cfg_scale=1.0))
    assert got.shape == (48, 64, 3) and np.array_equal(got, _pixels(expected.images)[0])
    main(["info", str(models["folder"] / "kontext")])
    info = capsys.readouterr().out
    assert "FLUX.1 Kontext" in info and "2.5 by default" in info and "--no-ref-resize" in info


def test_only_editing_models_take_the_servers_images_as_references(models):
    """The servers' image routes (A1111 img2img, OpenAI edits without a mask) hand their images to a model as
    references only where it was trained to edit from them: a Kontext release does; plain FLUX.1 dev takes a
    reference when asked (ReferenceLatent, --ref-image) but keeps image to image on those routes."""
    from sdlite.server.a1111.api import Plan
    from sdlite.server.a1111.references import with_references

    kontext, dev = models["kontext"].family, models["dev"].family
    assert kontext.takes_references and kontext.edits_from_images
    assert dev.takes_references and not dev.edits_from_images
    source = _image(1, SIZE, SIZE)
    request = Request(prompt=PROMPT, init_image=source, strength=0.6)
    for family, routed in ((kontext, True), (dev, False)):
        plan = Plan(kind="img2img", requests=[request], parameters={}, sampler=None, checkpoint=None,
                    references=(source,), reference_mode="a1111")
        (out,) = with_references(plan, [request], family.edits_from_images)
        assert (out.reference_images == (source,)) is routed and out.init_image is source
