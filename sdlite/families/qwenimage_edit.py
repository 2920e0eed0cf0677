"""Qwen-Image-Edit (Qwen team, 2025): instruction editing on Qwen-Image's network. The source images reach the model
twice, as diffusers' ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` give them:

* **through the text encoder**: Qwen2.5-VL's vision tower (:mod:`sdlite.models.qwen_vision`) turns each image into
  tokens that take the place of its ``<|image_pad|>`` in the prompt, with 3-D multimodal positions
  (:func:`~sdlite.models.qwen.mrope_positions`). The prompt's chat template has its own system turn
  (:data:`EDIT_SYSTEM_PROMPT`); the first :data:`EDIT_DROPPED_TOKENS` tokens (the system turn and the user turn's
  opening) are dropped and the rest, the image tokens included, is the caption;
* **in the transformer's sequence**: each image's normalised VAE latent (the distribution's mean, the pipelines'
  ``sample_mode="argmax"``) after the generated image's tokens, as further images of the sample
  (``QwenImage.forward``'s ``references``); Edit-2511's transformer modulates them as at timestep 0
  (``zero_cond_t``, the network's config).

The releases differ in how the images are prepared (family ``qwen-image-edit`` for Qwen-Image-Edit,
``qwen-image-edit-plus`` for Edit-2509 and Edit-2511):

* **Edit**: one image. It is resized (Lanczos) to about 1024^2 pixels at its aspect ratio, sides multiples of 32
  (:func:`edit_size`, the pipeline's ``calculate_dimensions``); that image goes both to the VAE and to the vision
  tower; the template holds ``<|vision_start|><|image_pad|><|vision_end|>`` before the instruction.
* **Edit Plus**: up to three images. Each goes to the vision tower at about 384^2 pixels and to the VAE at about
  1024^2, and the instruction follows ``Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: ...``.

The vision tower's processor then fits each image to multiples of 28 pixels within the processor's pixel limits
(:func:`~sdlite.tokenizers.qwen_images.vision_patches`). The output size left unset is the first image's
``edit_size`` (Edit) or the last image's (Edit Plus), as the pipelines choose it; a size given is drawn as given. The
rest is Qwen-Image's (:mod:`.qwenimage`): true CFG with its norm-preserving rescale, the schedule's dynamic shift from
the generated image's token count, 50 steps at cfg 4 by default.

Inpainting (``Request.init_image`` with ``mask``, ``mask_from_alpha`` or ``outpaint``), as diffusers'
``QwenImageEditInpaintPipeline`` runs it: the inpainting source is the image edited (the pipeline's ``image``):

* the size left unset is the source's :func:`edit_size` at about 1024^2 pixels (its outpaint border included); the
  pipeline always draws that size, sdlite draws a size given as given (the source resized to it, Lanczos);
* the source prepared as any inpainting source (:func:`~sdlite.sources.prepare`) goes to the VAE, and its posterior
  *sample* drawn by the first image's generator (shared by the batch, as for Qwen-Image's inpainting) is both the start
  (noised to ``strength``; at 1, pure noise) and the latent in the sequence (the pipeline's ``image_latents``, where
  the plain Edit pipeline takes the mean); after each step the unmasked region is set back to it noised to the next
  step's level, and to it itself after the last (the mask binarised at one half, nearest onto the latent grid);
* the vision tower sees the whole source as drawn, before any fill (:meth:`source_vision_image`), as the pipeline
  gives its processor the resized image; Edit Plus shows it at about 384^2 pixels;
* the pipeline's ``padding_mask_crop`` is ``inpaint_area="masked"`` with ``inpaint_padding`` (A1111's crop: the VAE
  and the sequence see the crop, the vision tower the whole source at its edit size, as the pipeline shows it);
  the mask blur and the overlay are A1111's (``mask_blur=0, overlay=False`` for the pipeline's hard mask and raw
  decode).

``Request.reference_images`` with an inpainting source: Qwen-Image-Edit takes one image, the source, and refuses
them; Edit Plus (no diffusers pipeline inpaints with it) reads them after the source, as Pictures 2 and 3 (up to 3
images in all), at their own edit sizes, their mean latents after the source's in the sequence.

A warm engine remembers the captions of its last requests' texts with their images (by content,
:meth:`QwenImageEditFamily.encoded_with_images`): a re-rolled seed runs neither the vision tower nor the 7B encoder
again; the inpainting source is encoded by the VAE once for the sequence and the start
(:meth:`~.loaded.LoadedModel.encode_image` remembers its moments).

Where sdlite differs from the pipelines: they guide only when a negative prompt is given; sdlite whenever cfg is
above 1, the negative prompt left empty encoding "" with the same images, as for Qwen-Image. The text encoder's
3-D positions for the image tokens are Qwen2.5-VL's own (transformers 4 computed them from the ids); diffusers with
transformers 5 does not hand the encoder the token types it now needs for them, and gives image tokens 1-D
positions instead.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from PIL import Image

from ..config.qwenimage import QWEN_IMAGE_EDIT_PLUS_FAMILY, QWEN_IMAGE_EDIT_FAMILIES, QwenImageConfig
from ..errors import RequestError
from ..models.qwen import mrope_positions
from ..prompts import prompt_schedule
from ..sources import Source, image_to_tensor, load_image, prepare, source_size, to_rgb
from ..tokenizers.qwen_images import image_tokens, vision_patches
from .base import ReferenceConditioning, ScheduledConditioning
from .qwenimage import QwenImageFamily
from .zimage import LengthsConditioning, _exact, plain_prompt

__all__ = ["QwenImageEditFamily", "EditConditioning", "edit_size", "EDIT_SYSTEM_PROMPT", "EDIT_DROPPED_TOKENS",
           "VISION_SLOT", "CONDITION_AREA", "VAE_AREA", "MAX_IMAGES"]

EDIT_SYSTEM_PROMPT = ("Describe the key features of the input image (color, shape, size, texture, objects, "
                      "background), then explain how the user's text instruction should alter or modify the image. "
                      "Generate a new image that meets the user's requirements while maintaining consistency with "
                      "the original input where appropriate.")
EDIT_DROPPED_TOKENS = 64   # the pipelines' prompt_template_encode_start_idx: the system turn and "<|im_start|>user\n"
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VAE_AREA = 1024 * 1024       # the pipelines' VAE_IMAGE_SIZE: the source latents' pixels
CONDITION_AREA = 384 * 384   # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: the vision tower's pixels
MAX_IMAGES = {"qwen-image-edit": 1, QWEN_IMAGE_EDIT_PLUS_FAMILY: 3}
SIDE = 32                    # edit_size's rounding


def edit_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels at the aspect ratio ``width / height``, each side rounded to the
    nearest multiple of 32 (Python's rounding, half to even: the pipelines' ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / SIDE) * SIDE, round(h / SIDE) * SIDE


def _digest(image: Image.Image) -> tuple:
    """An image by content: its mode, size and a hash of its pixels."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).digest()


def _resized(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """``image`` at ``size`` (Lanczos, the pipelines' image processor's), itself where the size is already that."""
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


@dataclass
class EditConditioning(ReferenceConditioning, LengthsConditioning):
    """Captions of their own lengths (:class:`~.zimage.LengthsConditioning`) and the source images' latents, each
    (1, 16, h_i, w_i) in the sampler's scaling, passed to the transformer with every call
    (:class:`~.base.ReferenceConditioning`)."""


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit and Edit Plus (2509, 2511): the source images in the caption and in the sequence."""

    name = "qwen-image-edit"
    takes_references = True
    edits_from_images = True

    @classmethod
    def takes(cls, spec) -> bool:
        return isinstance(spec.transformer, QwenImageConfig) and spec.family in QWEN_IMAGE_EDIT_FAMILIES

    @property
    def plus(self) -> bool:
        """Edit-2509 / 2511: several images, each to the vision tower at about 384^2 pixels."""
        return self.spec.family == QWEN_IMAGE_EDIT_PLUS_FAMILY

    @property
    def max_images(self) -> int:
        return MAX_IMAGES[self.spec.family]

    def resolve(self, r):
        """No size given: the first image's :func:`edit_size` (Edit Plus: the last image's), sides rounded down to
        multiples of 16, as the pipelines draw; image to image keeps the source's size; inpainting takes the
        source's :func:`edit_size` (its outpaint border included), as QwenImageEditInpaintPipeline draws."""
        if r.is_inpaint and (r.width is None or r.height is None):
            width, height = edit_size(*source_size(r.replace(width=None, height=None), 1), VAE_AREA)
            r = r.replace(width=r.width or width // 16 * 16, height=r.height or height // 16 * 16)
        r = super().resolve(r)
        if r.reference_images and (r.width is None or r.height is None) and not r.is_img2img:
            source = r.reference_images[-1 if self.plus else 0]
            width, height = edit_size(*self._size_of(source, len(r.reference_images) - 1 if self.plus else 0),
                                      VAE_AREA)
            r = r.replace(width=r.width or width // 16 * 16, height=r.height or height // 16 * 16)
        return r

    @staticmethod
    def _size_of(source, index: int) -> tuple[int, int]:
        if isinstance(source, torch.Tensor):
            raise RequestError(f"reference image {index + 1}: Qwen-Image-Edit reads its source images with its text "
                               "encoder's vision tower too, so it needs the images, not latents")
        if isinstance(source, Image.Image):
            return source.size
        return load_image(source, f"reference image {index + 1}").size

    def check_request(self, r) -> None:
        super().check_request(r)
        if r.is_inpaint:   # the inpainting source is the image edited: the first of the images
            if r.reference_images and not self.plus:
                raise RequestError("Qwen-Image-Edit takes one image, and when it inpaints that is the source "
                                   "(init_image, --init-image / sdlite edit IMAGE --mask): remove the reference "
                                   "images (Qwen-Image-Edit-2509 / 2511 take up to 2 beside the source)")
            if 1 + len(r.reference_images) > self.max_images:
                raise RequestError(f"the inpainting source and {len(r.reference_images)} reference images: "
                                   f"Qwen-Image-Edit-2509 / 2511 take {self.max_images} images in all")
            return
        if not r.reference_images:
            raise RequestError("Qwen-Image-Edit edits an image: give the source image (sdlite edit IMAGE "
                               "\"instruction\", --ref-image PATH, Request.reference_images), or an init image "
                               "with a mask to inpaint (--init-image PATH --mask PATH)")
        if len(r.reference_images) > self.max_images:
            which = "Qwen-Image-Edit-2509 / 2511 take" if self.plus else \
                "Qwen-Image-Edit takes one; Qwen-Image-Edit-2509 / 2511 take up to 3"
            raise RequestError(f"{len(r.reference_images)} source images were given: {which} "
                               f"{self.max_images if self.plus else ''}".rstrip())

    @property
    def sampling_defaults(self) -> dict:
        """The model cards': 50 steps at true CFG 4, Euler (the pipelines' defaults)."""
        return super().sampling_defaults

    def info_lines(self) -> list[str]:
        images = "up to 3 source images" if self.plus else "one source image"
        return [*super().info_lines(), f"editing:     {images} (sdlite edit IMAGE \"instruction\", --ref-image), read "
                                       "by the text encoder's vision tower and placed in the sequence",
                "inpainting:  the source is the image edited, as QwenImageEditInpaintPipeline (sdlite edit IMAGE "
                "--mask, --init-image with --mask)"]

    def text_encoder_note(self, name: str) -> str:
        return (f", edit template with the source images through the vision tower, last hidden state (the first "
                f"{EDIT_DROPPED_TOKENS} tokens dropped)")

    # -- the source images ----------------------------------------------------------------------------------------

    def prepared_images(self, r) -> tuple[list[Image.Image], list[Image.Image]]:
        """The request's source images as the pipelines prepare them: (for the vision tower, for the VAE)."""
        vision, vae = [], []
        for i, source in enumerate(r.reference_images):
            self._size_of(source, i)   # a latent is refused by name
            image = to_rgb(load_image(source, f"reference image {i + 1}"))
            big = _resized(image, edit_size(*image.size, VAE_AREA))
            vae.append(big)
            vision.append(_resized(image, edit_size(*image.size, CONDITION_AREA)) if self.plus else big)
        return vision, vae

    def source_vision_image(self, source: Source) -> Image.Image:
        """What the vision tower sees of a prepared inpainting source: the whole source as it is drawn, before any
        fill (the pipeline's processor gets the resized image). Generating only a crop around the mask (A1111's
        "masked" area, the pipeline's ``padding_mask_crop``), the whole source at its :func:`edit_size`. Edit Plus:
        at about 384^2 pixels, as it shows every image."""
        image = source.overlay_source
        if self.plus:
            return _resized(image, edit_size(*image.size, CONDITION_AREA))
        return image if source.paste_box is None else _resized(image, edit_size(*image.size, VAE_AREA))

    def source_latent_of(self, model, source: Source, seed: int) -> torch.Tensor:
        """The inpainting source's latent (1, 16, h, w) in the sampler's scaling, as the loop's start takes it: the
        posterior's sample drawn by the first image's generator (seed ``seed``; the family's ``source_latent``
        "mean": the mean). It is the pipeline's ``image_latents``: the start, the region kept and the sequence's
        reference at once. The engine draws the start again by a generator of the same seed from the moments
        :meth:`~.loaded.LoadedModel.encode_image` remembers, so the source is encoded once."""
        draw = [torch.Generator().manual_seed(seed)] if self.source_latent == "sample" else None
        return model.encode_image(image_to_tensor(source.image), draw)

    def encode_sources(self, model, images: list[Image.Image]) -> tuple[torch.Tensor, ...]:
        """Each image's normalised mean latent (1, 16, h/8, w/8)."""
        out = []
        for image in images:
            with torch.no_grad(), model.models.use("vae") as vae:
                mean, _ = vae.encode_moments(image_to_tensor(image).to(model.device, vae.dtype))
            out.append(self.latent.scale(mean.float()))
        return tuple(out)

    def prompt_prefix(self, count: int) -> str:
        """What comes before the instruction in the user's turn: the image slots."""
        if self.plus:
            return "".join(f"Picture {i + 1}: {VISION_SLOT}" for i in range(count))
        return VISION_SLOT

    # -- conditioning ---------------------------------------------------------------------------------------------

    def encode_with_images(self, model, texts: list[str], images: list[Image.Image],
                           warnings: list[str] | None = None) -> list[torch.Tensor]:
        """Each text's caption (1, L, 3584) with the images in its prompt: the vision tower run once over the images,
        its tokens spliced into every row."""
        notes: list[str] = []
        plain = [plain_prompt(t, notes, "Qwen-Image-Edit") for t in texts]
        tokenizer = model.tokenizers["text_encoder"]
        vision = self.spec.text.vision
        pixels, grids = vision_patches(images, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                                       patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                       temporal_patch_size=vision.temporal_patch_size)
        counts = image_tokens(grids, vision.spatial_merge_size)
        pad = tokenizer.encode(IMAGE_PAD)[0]
        prefix = self.prompt_prefix(len(images))
        rows = []
        for t in plain:
            ids = tokenizer.encode(tokenizer.chat_prompt(prefix + t, system=EDIT_SYSTEM_PROMPT))
            expanded, k = [], 0
            for token in ids:   # each image's one <|image_pad|> becomes its tokens, as the processor expands it
                if token == pad:
                    expanded += [pad] * counts[k]
                    k += 1
                else:
                    expanded.append(token)
            rows.append(expanded)
        grid_list = [tuple(int(v) for v in g) for g in grids]
        with torch.no_grad(), model.models.use("text_encoder") as encoder:
            features = encoder.visual(pixels.to(model.device, encoder.dtype), grids.to(model.device))
            if _exact(model):   # each text alone, as the pipelines encode one prompt per call
                hidden = [self._run(encoder, model, [ids], features, grid_list, pad, vision.spatial_merge_size)
                          for ids in rows]
            else:
                states = self._run(encoder, model, rows, features, grid_list, pad, vision.spatial_merge_size)
                hidden = [states[i:i + 1, :len(ids)] for i, ids in enumerate(rows)]
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return [h[:, EDIT_DROPPED_TOKENS:] for h in hidden]

    def encoded_with_images(self, model, texts: list[str], images: list[Image.Image],
                            warnings: list[str] | None = None) -> list[torch.Tensor]:
        """:meth:`encode_with_images`, remembered by the model (:meth:`~.loaded.LoadedModel.remembered`) for the next
        requests with the same texts and the same images by content: a re-rolled seed runs neither the vision tower
        nor the encoder again. Keyed by what the captions depend on besides the encoder's weights: the texts, each
        image's pixels, the template (the release's image slots, its system prompt, the tokens dropped) and the
        precision (which also says whether the texts run one by one)."""
        key = ("qwen-image-edit captions", tuple(texts), tuple(_digest(im) for im in images),
               self.prompt_prefix(len(images)), EDIT_SYSTEM_PROMPT, EDIT_DROPPED_TOKENS,
               repr(getattr(model, "precision", None)))

        def encode():
            notes: list[str] = []
            return self.encode_with_images(model, texts, images, notes), notes

        contexts, notes = model.remembered(key, encode)
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return contexts

    @staticmethod
    def _run(encoder, model, rows, features, grids, pad: int, merge: int) -> torch.Tensor:
        """The last hidden states (P, N, width) of token rows holding the images, right-padded to the longest."""
        longest = max(len(ids) for ids in rows)
        tokenizer = model.tokenizers["text_encoder"]
        padded = [tokenizer.pad(ids, longest) for ids in rows]
        ids = torch.tensor([p[0] for p in padded], dtype=torch.long)
        mask = torch.tensor([p[1] for p in padded], dtype=torch.long)
        positions = mrope_positions(ids, mask, grids * len(rows), pad, merge)
        return encoder(ids.to(model.device), mask.to(model.device), hidden_states=-1,
                       image_features=features.repeat(len(rows), 1), image_token_id=pad,
                       positions=positions.to(model.device))

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        """The texts' captions with the source images in them, and the images' latents for the sequence."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for Qwen-Image-Edit are not supported; remove "
                               "embeddings_dir / --embeddings for this model")
        if r.clip_skip != 1:
            raise RequestError("clip skip has no meaning for Qwen-Image-Edit: it reads its text encoder's last hidden "
                               "state, always")
        schedules = [prompt_schedule(r.prompt, r.steps)]
        if use_cfg:
            schedules.append(prompt_schedule(r.negative_prompt, r.steps))
        texts = list(dict.fromkeys(p.text for schedule in schedules for p in schedule))
        vision, vae = self.prepared_images(r)
        references = self.encode_sources(model, vae)
        if r.is_inpaint:   # the source first, in the caption and in the sequence
            source = prepare(r)
            vision = [self.source_vision_image(source), *vision]
            references = (self.source_latent_of(model, source, r.seed), *references)
        warnings: list[str] = []
        contexts = self.encoded_with_images(model, texts, vision, warnings)
        return EditConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                warnings, references=references)
