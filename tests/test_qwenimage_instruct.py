"""Qwen-Image-Edit and Edit Plus (2509 / 2511) against diffusers' QwenImageEditPipeline and QwenImageEditPlusPipeline
on tiny random models saved as diffusers folders: the source images through Qwen2.5-VL's vision tower into the
caption (the edit template, 64 tokens dropped, the image tokens' 3-D multimodal positions), their normalised mean
latents in the transformer's sequence, true CFG with a negative prompt, batch 2, two source images of other sizes,
and what the family refuses.

The reference text encoder is handed the token types (``mm_token_type_ids``) that transformers 5 needs to build the
3-D positions of the image tokens, which the pipelines do not pass (without them every token takes a 1-D position,
which is not how Qwen2.5-VL reads images)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.families.qwenimage_edit import EDIT_DROPPED_TOKENS, VAE_AREA, edit_size
from sdlite.pipeline import Engine, Request, RequestError
from tests.test_qwenimage_pipeline import (MAX_PIXEL_DIFF, QWEN_JSON, TEXT, TRANSFORMER, VAE, _generators, _pixels,
                                           _reference, _seeded)
from tests.reference import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_PAD = 151655
# a vision tower whose windows matter: 14-pixel patches merged 2 x 2, windows of 56 pixels (2 x 2 merged units), full
# attention in its second block
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=TEXT["hidden_size"],
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
PROCESSOR = dict(min_pixels=3136, max_pixels=12845056)   # Qwen/Qwen-Image-Edit's processor/preprocessor_config.json
INSTRUCTION, NEGATIVE = "make the circle green", "blurry, distorted"


def _source(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random picture with a disc: detail for the VAE and the vision tower to see."""
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / (7 + 3 * c) + g.uniform(0, 6)) * np.cos(y / (5 + 2 * c)) for c in range(3)], -1)
    disc = ((x - width / 2) ** 2 + (y - height / 2) ** 2) < (min(width, height) / 3) ** 2
    pixels = 127 + 90 * base + 30 * disc[..., None]
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _processor():
    """Qwen2VLProcessor with the released pixel limits, built without its video processor (which needs
    torchvision): the pipelines use only its text and image halves."""
    from transformers import Qwen2TokenizerFast, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    processor.tokenizer, processor.video_processor, processor.chat_template = tokenizer, None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id, processor.video_token_id = IMAGE_PAD, 151656
    return processor


def _text_encoder():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, vision_start_token_id=151652,
                              vision_end_token_id=151653, image_token_id=IMAGE_PAD, video_token_id=151656)
    config._attn_implementation = "sdpa"
    model = seed_all(Qwen2_5_VLForConditionalGeneration(config).eval(), 2, scale=0.2)
    forward = model.forward

    def with_token_types(*args, input_ids=None, **kw):   # the 3-D rope index needs the token types (see above)
        if input_ids is not None and kw.get("pixel_values") is not None:
            kw.setdefault("mm_token_type_ids", (input_ids == IMAGE_PAD).int())
        return forward(*args, input_ids=input_ids, **kw)

    model.forward = with_token_types
    return model


def _save(pipe, folder: Path, cls: str) -> None:
    """The pipeline as a diffusers folder of class ``cls``: its networks, scheduler and tokenizer as save_pretrained
    writes them, the processor's preprocessor_config.json as the Qwen-Image-Edit releases ship it."""
    from diffusers import QwenImagePipeline

    plain = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                              tokenizer=pipe.tokenizer, transformer=pipe.transformer)
    plain.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name=cls, processor=["transformers", "Qwen2VLProcessor"])
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "processor").mkdir()
    (folder / "processor" / "preprocessor_config.json").write_text(json.dumps({
        **PROCESSOR, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImageEditPlusPipeline, QwenImageTransformer2DModel)

    from sdlite.config.qwenimage import QWEN_IMAGE_SCHEDULER

    vae = _seeded(AutoencoderKLQwenImage(**VAE).eval(), 1, 0.1)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(8.0)
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**{k: v for k, v in QWEN_IMAGE_SCHEDULER.items()
                                                               if not k.startswith("_")}),
                 vae=vae, text_encoder=_text_encoder(), tokenizer=_processor().tokenizer, processor=_processor(),
                 transformer=_seeded(QwenImageTransformer2DModel(**TRANSFORMER).eval(), 4, 0.15))
    edit, plus = QwenImageEditPipeline(**parts), QwenImageEditPlusPipeline(**parts)
    tmp = tmp_path_factory.mktemp("qwen-edit")
    _save(edit, tmp / "edit", "QwenImageEditPipeline")
    _save(plus, tmp / "plus", "QwenImageEditPlusPipeline")
    for pipe in (edit, plus):
        pipe.set_progress_bar_config(disable=True)
    return {"edit": edit, "plus": plus, "folder": tmp,
            "edit_engine": Engine.load(tmp / "edit", precision="exact"),
            "plus_engine": Engine.load(tmp / "plus", precision="exact")}


def test_the_folders_open_as_edit_releases(models):
    edit, plus = models["edit_engine"], models["plus_engine"]
    assert edit.spec.family == "qwen-image-edit" and plus.spec.family == "qwen-image-edit-plus"
    assert edit.family.name == "qwen-image-edit" and edit.family.edits_from_images and not edit.family.plus
    assert plus.family.plus and plus.family.max_images == 3
    vision = edit.spec.text.vision
    assert vision.depth == 2 and vision.window_size == 56 and vision.out_hidden_size == TEXT["hidden_size"]
    assert (vision.min_pixels, vision.max_pixels) == (3136, 12845056)
    assert edit.spec.text.mrope_section == (2, 3, 3)
    assert edit.family.sampling_defaults["steps"] == 50 and edit.family.sampling_defaults["cfg"] == 4.0


def test_captions_with_the_image_equal_the_pipelines(models):
    """The edit template, the image tokens spliced in with 3-D positions, the 64 dropped tokens: each caption equals
    the pipeline's prompt embeds (Edit: the one image at about 1024^2 pixels; Plus: two at about 384^2)."""
    a, b = _source(80, 48, 1), _source(40, 72, 2)
    for key, images in (("edit", [a]), ("plus", [a, b])):
        pipe, engine = models[key], models[f"{key}_engine"]
        vision_images, _ = engine.family.prepared_images(Request(prompt="", reference_images=tuple(images)))
        for text in (INSTRUCTION, ""):
            prompt_image = vision_images[0] if key == "edit" else vision_images
            want, mask = pipe.encode_prompt(text, image=prompt_image, device="cpu")
            got = engine.family.encode_with_images(engine, [text], vision_images)[0]
            assert mask is None and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.shape[1] > 2 * 6   # both images' tokens are in the caption (Plus, the empty instruction)


def test_edit_matches_qwenimageeditpipeline(models):
    """One non-square source (its latents at about 1024^2 pixels, as the pipeline fixes them), batch 2 at a size of
    its own with true CFG and a negative prompt."""
    pipe, engine = models["edit"], models["edit_engine"]
    source = _source(80, 48, 3)
    expected = _reference(pipe, 64, 48, image=source, prompt=INSTRUCTION, negative_prompt=NEGATIVE,
                          true_cfg_scale=4.0, num_inference_steps=2, num_images_per_prompt=2,
                          generator=_generators(5, 6))
    got = _pixels(engine.generate(Request(prompt=INSTRUCTION, negative_prompt=NEGATIVE, reference_images=(source,),
                                          steps=2, cfg_scale=4.0, seed=5, batch_size=2, width=64, height=48,
                                          sampler="euler")).images)
    assert got.shape == expected.shape == (2, 48, 64, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10 and np.abs(got[0] - got[1]).max() > 10


def test_edit_plus_matches_with_two_source_images(models, monkeypatch):
    """Two sources of other sizes and aspect ratios (the vision tower at about 384^2 pixels each), true CFG with a
    negative prompt. The source latents' pixel count (the pipeline's VAE_IMAGE_SIZE, 1024^2) is made 512^2 on both
    sides to keep the test short: the same computation on fewer tokens."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as reference

    import sdlite.families.qwenimage_edit as family

    monkeypatch.setattr(reference, "VAE_IMAGE_SIZE", 512 * 512)
    monkeypatch.setattr(family, "VAE_AREA", 512 * 512)
    pipe, engine = models["plus"], models["plus_engine"]
    images = [_source(80, 48, 7), _source(40, 72, 8)]
    expected = _reference(pipe, 48, 64, image=images, prompt=INSTRUCTION, negative_prompt=NEGATIVE,
                          true_cfg_scale=4.0, num_inference_steps=2, generator=_generators(9))
    request = Request(prompt=INSTRUCTION, negative_prompt=NEGATIVE, reference_images=tuple(images), steps=2,
                      cfg_scale=4.0, seed=9, width=48, height=64, sampler="euler")
    got = _pixels(engine.generate(request).images)
    assert got.shape == expected.shape == (1, 64, 48, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10


def test_the_size_left_unset_is_the_pipelines(models):
    """About 1024^2 pixels at the source's aspect ratio, as the pipelines draw: the first image's (Edit), the last
    one's (Plus); sides multiples of 16."""
    a, b = _source(80, 48, 1), _source(40, 72, 2)
    edit = models["edit_engine"].family.resolve(Request(prompt="x", reference_images=(a, b)))
    assert (edit.width, edit.height) == edit_size(80, 48, VAE_AREA) == (1312, 800)
    plus = models["plus_engine"].family.resolve(Request(prompt="x", reference_images=(a, b)))
    assert (plus.width, plus.height) == tuple(v // 16 * 16 for v in edit_size(40, 72, VAE_AREA))
    assert edit_size(1024, 1024, VAE_AREA) == (1024, 1024) and edit_size(100, 100, 384 * 384) == (384, 384)


def test_refusals(models):
    edit, plus = models["edit_engine"], models["plus_engine"]
    source = _source(48, 48, 1)
    with pytest.raises(RequestError, match="edits an image: give the source image"):
        edit.generate(Request(prompt=INSTRUCTION, steps=2, width=32, height=32, sampler="euler"))
    with pytest.raises(RequestError, match="2 source images were given: Qwen-Image-Edit takes one"):
        edit.generate(Request(prompt=INSTRUCTION, steps=2, width=32, height=32, sampler="euler",
                              reference_images=(source, source)))
    with pytest.raises(RequestError, match="4 source images were given: .* take 3"):
        plus.generate(Request(prompt=INSTRUCTION, steps=2, width=32, height=32, sampler="euler",
                              reference_images=(source,) * 4))
    with pytest.raises(RequestError, match="reference image 1: .*needs the images, not latents"):
        edit.generate(Request(prompt=INSTRUCTION, steps=2, width=32, height=32, sampler="euler",
                              reference_images=(torch.zeros(1, 16, 4, 4),)))
    assert EDIT_DROPPED_TOKENS == 64


def test_memory_mode_0_streams_the_vision_tower_too(models, monkeypatch):
    """Memory mode 0 (every network streamed from its file, the vision tower's layers placeholders until they run)
    gives the image memory mode 1 gives, bit for bit (the sources' latents at a small area: the same computation on
    fewer tokens)."""
    import sdlite.families.qwenimage_edit as family

    monkeypatch.setattr(family, "VAE_AREA", 256 * 256)
    streamed = Engine.load(models["folder"] / "plus", precision="exact", memory_mode=0)
    request = Request(prompt=INSTRUCTION, reference_images=(_source(80, 48, 7),), steps=2, cfg_scale=1.0, seed=2,
                      width=32, height=32, sampler="euler")
    got = _pixels(streamed.generate(request).images)
    assert np.array_equal(got, _pixels(models["plus_engine"].generate(request).images))


def test_the_source_image_reaches_the_caption_and_the_sequence(models):
    """Random weights condition weakly, so the final image alone cannot show it: another source image changes the
    caption (through the vision tower) and, given the same caption, the transformer's velocity (through the source's
    latents in the sequence) by far more than rounding."""
    engine = models["edit_engine"]
    family = engine.family
    a, b = _source(64, 48, 1), _source(64, 48, 2)
    ca = family.encode_with_images(engine, [INSTRUCTION], [a])[0]
    cb = family.encode_with_images(engine, [INSTRUCTION], [b])[0]
    assert ca.shape == cb.shape and (ca - cb).abs().max() > 1e-2 * ca.abs().max()
    ra, rb = family.encode_sources(engine, [a, b])
    x, t = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.6])
    with torch.no_grad(), engine.models.use("transformer") as network:
        va, vb = (network(x, t, ca, references=(r,)) for r in (ra, rb))
    # fp32 rounding is about 1e-7 of the magnitude; the tiny random transformer leans on its references weakly
    # (about 7e-4 of the magnitude here), so the bar is 1e-4: a thousand times rounding
    assert (va - vb).abs().max() > 1e-4 * va.abs().max()


def test_captions_with_images_are_remembered(models, monkeypatch):
    """A re-rolled seed with the same source image (another object of the same pixels) and the same texts runs the
    vision tower (and the encoder) once; another image or another instruction runs it again; the images are those of
    an engine that remembers nothing. While a LoRA changes the text encoder nothing is reused or remembered; one that
    changes the transformer alone leaves the captions to be reused."""
    import sdlite.families.qwenimage_edit as family

    monkeypatch.setattr(family, "VAE_AREA", 256 * 256)   # the sources at a small area: fewer tokens
    engine = models["edit_engine"]
    engine._image_text_cache.clear()   # what earlier tests encoded
    calls = []
    with engine.models.use("text_encoder") as encoder:
        tower = type(encoder.visual)
    forward = tower.forward
    monkeypatch.setattr(tower, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    source = _source(64, 48, 1)
    request = Request(prompt=INSTRUCTION, negative_prompt=NEGATIVE, reference_images=(source,), steps=2,
                      cfg_scale=4.0, seed=1, width=32, height=32, sampler="euler")
    first = _pixels(engine.generate(request).images)
    assert len(calls) == 1
    again = _pixels(engine.generate(request.replace(seed=2, reference_images=(source.copy(),))).images)
    assert len(calls) == 1 and not np.array_equal(first, again)
    engine.generate(request.replace(reference_images=(_source(64, 48, 2),)))
    assert len(calls) == 2
    engine.generate(request.replace(prompt="make the circle blue"))
    assert len(calls) == 3

    def lora_of(*networks):
        def adapter(name, module, resident):
            pass
        adapter.components = frozenset(networks)   # as sdlite.adapters.lora.engine_with_loras marks its adapter
        return adapter

    for networks, runs in ((("text_encoder", "transformer"), 2), (("transformer",), 0)):
        adapter = lora_of(*networks)
        engine.models.adapters.append(adapter)
        try:
            before = len(calls)
            engine.generate(request)
            engine.generate(request)
            assert len(calls) - before == runs, networks
        finally:
            engine.models.adapters.remove(adapter)
    engine.generate(request)
    assert len(calls) == 5   # remembered from before the text encoder's LoRA

    monkeypatch.setattr(type(engine), "remembered", lambda self, key, compute, network="text_encoder": compute())
    assert np.array_equal(first, _pixels(engine.generate(request).images))
    assert np.array_equal(again, _pixels(engine.generate(request.replace(seed=2)).images))
    assert len(calls) == 7
