"""FLUX.1 dev and schnell: a rectified-flow transformer (:mod:`sdlite.models.flux`) on SD3's kind of 16-channel
latents, conditioned on T5-XXL's states and CLIP-L's pooled output.

Conditioning, as diffusers' ``FluxPipeline`` builds it:

* T5-XXL's last hidden state over a fixed row of tokens (the prompt, its end token, padding; no attention mask):
  512 for dev, 256 for schnell (the length each model card runs; diffusers' pipeline argument
  ``max_sequence_length``); this is the whole token context;
* CLIP-L's pooled output (the final-normalised state at the end token, no projection) over one 77-token chunk, as the
  added input ``pooled_projections``; a longer prompt is cut there for CLIP, with a warning;
* dev only: the distilled guidance scale (``Request.guidance``, 3.5 by default; Forge's "Distilled CFG Scale"),
  embedded by the transformer like a second timestep. It is not classifier-free guidance: the default cfg scale is 1
  (off). A cfg scale above 1 runs true CFG with the negative prompt (diffusers' ``true_cfg_scale`` with a
  ``negative_prompt``), the negative computed in the same batch;
* A1111's emphasis weights T5's tokens as for SD3; prompt editing and alternation schedule the texts.

The latents: the VAE's 16 channels less 0.1159, times 0.3611. The schedule: FlowMatchEulerDiscreteScheduler's, with
FLUX's pipeline sigmas ``linspace(1, 1/steps, steps)``; dev shifts them by ``mu`` from the image's token count (2x2
latent patches), schnell not at all. Sides are multiples of 16 pixels (the pipelines resize others; sdlite names the
nearest); ComfyUI's sampling (``Request.noise="comfy"``, its KSampler) takes the multiples of 8 that ComfyUI's latents
have, the network padding an odd latent side (a Kontext reference's too) as ComfyUI's does
(:func:`~sdlite.models.layers.pad_to_patches`: wrapped around, cropped after). Z-Image takes them the same way; FLUX.2
does not: ComfyUI's FLUX.2 latent is already one position per 16 pixels (EmptyFlux2LatentImage rounds down to it).

Editing (dev's network: FLUX.1 dev and FLUX.1 Kontext, family ``flux-kontext``): reference images
(``Request.reference_images``) join the transformer's sequence as FLUX.1 Kontext's source image does
(:mod:`sdlite.families.flux_kontext`); both guidance halves see them. Without an explicit size the first reference's
(prepared) size is the output's. A Kontext release's guidance scale is 2.5 by default. A Kontext release inpaints
as FluxKontextInpaintPipeline does: the source as prepared is the reference, encoded (as every source image of a
Kontext release: image to image too) to its mean latent; reference images given take its place in the sequence.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config.flux import FLUX_FAMILIES
from ..conditioning import CHUNK_LENGTH, chunk_prompt, encode_chunks
from ..errors import RequestError
from ..hires import target_size as hires_target
from ..sampling.denoisers import FlowDenoiser
from ..sampling.flow import FlowSchedule
from ..sources import source_size
from .base import ReferenceConditioning, ScheduledConditioning
from .flux_kontext import (KONTEXT_FAMILY, KONTEXT_GUIDANCE, encode_references, inpaint_size, reference_size,
                           source_reference)
from .sd3 import _BREAK, SD3Family, _note

# latent -> RGB of FLUX's VAE for the cheap preview, one row per channel (the factors ComfyUI's Flux latent format
# uses)
CHEAP_RGB_FLUX = (
    (-0.0404, 0.0159, 0.0609), (0.0043, 0.0298, 0.0850), (0.0328, -0.0749, -0.0503), (-0.0245, 0.0085, 0.0549),
    (0.0966, 0.0894, 0.0530), (0.0035, 0.0399, 0.0123), (0.0583, 0.1184, 0.1262), (-0.0191, -0.0206, -0.0306),
    (-0.0324, 0.0055, 0.1001), (0.0955, 0.0659, -0.0545), (-0.0504, 0.0231, -0.0013), (0.0500, -0.0008, -0.0088),
    (0.0982, 0.0941, 0.0976), (-0.1233, -0.0280, -0.0897), (-0.0005, -0.0530, -0.0020), (-0.1273, -0.0932, -0.0680),
)
DEFAULT_GUIDANCE = 3.5        # FluxPipeline's guidance_scale default, the dev model card's
T5_TOKENS = {"flux-dev": 512, "flux-schnell": 256, "flux-kontext": 512}
PATCH_SIDE = 16               # FLUX.1's and Z-Image's image sides: multiples of 16 pixels (2x2 latent patches)


def check_sides(r, model: str) -> None:
    """Refuse a request whose given width or height is not a multiple of 16 pixels, naming the nearest sizes that
    are (a side left unset, image to image, is the source's, fitted by :func:`fit_to_patches`)."""
    given = [v for v in (r.width, r.height) if v is not None]
    if not any(v % PATCH_SIDE for v in given):
        return

    def size(rounded) -> str:
        return "x".join("(the source's)" if v is None else str(rounded(v)) for v in (r.width, r.height))

    down = size(lambda v: max(PATCH_SIDE, v // PATCH_SIDE * PATCH_SIDE))
    up = size(lambda v: -(-v // PATCH_SIDE) * PATCH_SIDE)
    nearest = down if down == up else f"{down} or {up}"
    raise RequestError(f"{model} draws images whose sides are multiples of {PATCH_SIDE} pixels (2x2 latent patches); "
                       f"{size(lambda v: v)} is not: the nearest that {'is' if down == up else 'are'}: {nearest}")


def check_hires_sides(r, model: str, downscale: int) -> None:
    """Refuse a hires fix whose target size (:func:`sdlite.hires.target_size`) is not a multiple of 16 pixels: its
    second pass is image to image at that size, so it is refused before the first pass runs."""
    if r.hires is None:
        return
    target = hires_target(r.width, r.height, r.hires, downscale)
    if target.width % PATCH_SIDE or target.height % PATCH_SIDE:
        h = r.hires
        asked = f"resize {h.resize_x}x{h.resize_y}" if h.resize_x or h.resize_y else f"scale {h.scale:g}"
        raise RequestError(f"the hires fix's target size {target.width}x{target.height} ({asked} of "
                           f"{r.width}x{r.height}) is not a multiple of {PATCH_SIDE} pixels, which {model} draws "
                           "(2x2 latent patches): choose a scale or resize that gives one")


def fit_to_patches(r):
    """Image to image that leaves the size to its source: the source's size, each side rounded down to a multiple of
    16 pixels, as diffusers' ZImageImg2ImgPipeline's image processor (a VaeImageProcessor of scale factor 16) fits a
    source it is given no size for, and FluxImg2ImgPipeline rounds its sizes (where A1111's rule, for a VAE of 8,
    rounds to 8); the source is then resized to it. Read before any model work."""
    if r.init_image is None or (r.width is not None and r.height is not None):
        return r
    width, height = source_size(r, PATCH_SIDE)
    return r.replace(width=width, height=height)


class FluxFamily(SD3Family):
    """FLUX.1: T5 context, CLIP-L pooled projections, (dev) the distilled guidance scale; flow matching."""

    name = "flux"
    preview_rgb = CHEAP_RGB_FLUX
    shared_source_sample = True   # FluxImg2ImgPipeline / FluxInpaintPipeline encode the one source once

    @classmethod
    def takes(cls, spec) -> bool:
        return spec.transformer is not None and spec.family in FLUX_FAMILIES

    @property
    def t5_tokens(self) -> int:
        return T5_TOKENS[self.spec.family]

    @property
    def guidance_embedded(self) -> bool:
        return self.spec.transformer.guidance_embeds

    @property
    def kontext(self) -> bool:
        """A FLUX.1 Kontext release: guidance 2.5, references resized to Kontext's preferred resolutions."""
        return self.spec.family == KONTEXT_FAMILY

    @property
    def takes_references(self) -> bool:
        """dev's network takes reference images (Kontext's source image); schnell's was never trained with them."""
        return self.guidance_embedded

    @property
    def edits_from_images(self) -> bool:
        """A Kontext release was trained to edit from its reference; plain dev takes one only when asked."""
        return self.kontext

    @property
    def source_latent(self) -> str:
        """A Kontext release encodes a source image to its latent distribution's mean, as every Kontext pipeline
        encodes its images (FluxKontextInpaintPipeline's ``sample_mode="argmax"``); dev and schnell draw a sample
        (FluxImg2ImgPipeline, FluxInpaintPipeline)."""
        return "mean" if self.kontext else "sample"

    def kontext_inpaint(self, r) -> bool:
        """Whether ``r`` is Kontext inpainting (FluxKontextInpaintPipeline): a Kontext release given a mask."""
        return self.kontext and r.is_inpaint

    @property
    def default_guidance(self) -> float:
        return KONTEXT_GUIDANCE if self.kontext else DEFAULT_GUIDANCE

    def resizes_references(self, r) -> bool:
        """Whether ``r``'s reference images go to Kontext's preferred resolutions: a Kontext release's do, unless
        the request turns it off (``reference_resize``)."""
        return self.kontext and r.reference_resize

    def noise_schedule(self, scheduler_config: dict):
        return dataclasses.replace(FlowSchedule.from_config(scheduler_config), sigma_spacing="linear")

    def schedule_for(self, schedule, width: int, height: int, steps: int | None = None):
        """mu (dev's dynamic shift) from the image's token count: one token per 2x2 patch of the latent."""
        return schedule.for_image((height // 16) * (width // 16))

    def resolve(self, r):
        """dev: the guidance scale 3.5 (Kontext: 2.5) where the request leaves it unset; schnell: none. Image to
        image without a size: the source's, fitted to 2x2 latent patches (:func:`fit_to_patches`); text to image
        with reference images and no size: the first reference's, as it is prepared. Kontext inpainting without a
        size: the source's Kontext size (:func:`~.flux_kontext.inpaint_size`)."""
        if self.kontext_inpaint(r):
            r = inpaint_size(r, self.resizes_references(r))
        r = fit_to_patches(r)
        if not self.guidance_embedded:
            return super().resolve(r)
        if r.guidance is None:
            r = r.replace(guidance=self.default_guidance)
        if r.reference_images and (r.width is None or r.height is None) and not r.is_img2img:
            width, height = reference_size(r.reference_images[0], 0, self.resizes_references(r))
            r = r.replace(width=r.width or width, height=r.height or height)
        return r

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        return FlowDenoiser(model, schedule, dtype=dtype, multiplier=1.0)   # the network takes sigma itself

    def check_request(self, r) -> None:
        if r.slg_layers:
            raise RequestError("skip-layer guidance is SD3.5's; FLUX.1 has no such option")
        if r.controls:
            raise RequestError("ControlNet for FLUX is a model kind of its own (FluxControlNetModel) that sdlite does "
                               "not run yet; the SD 1.x/SDXL ControlNets cannot steer a FLUX transformer")
        if r.noise != "comfy":   # ComfyUI's latents: any multiple of 8 pixels, padded to whole patches (module notes)
            check_sides(r, "FLUX")

    def info_lines(self) -> list[str]:
        d = self.sampling_defaults
        lines = [f"defaults:    {d['steps']} steps, cfg {d['cfg']} (off), {d['sampler']} (flow matching)"]
        if self.guidance_embedded:
            lines.append(f"guidance:    distilled, {self.default_guidance} by default (--guidance)")
        lines.append(f"T5:          {self.t5_tokens} tokens")
        if self.kontext:
            lines.append("editing:     a reference image (sdlite edit, --ref-image), resized to Kontext's preferred "
                         "resolutions (--no-ref-resize: not)")
            lines.append("inpainting:  the source also the reference, as FluxKontextInpaintPipeline (--init-image with "
                         "--mask)")
        elif self.guidance_embedded:
            lines.append("editing:     reference images as FLUX.1 Kontext's (--ref-image)")
        return lines

    @property
    def sampling_defaults(self) -> dict:
        """The model cards' settings: dev 28 steps (guidance 3.5), schnell 4 steps; no CFG (cfg 1); Euler."""
        steps = 28 if self.guidance_embedded else 4
        return {"steps": steps, "cfg": 1.0, "sampler": "euler", "timestep_spacing": None}

    def text_encoder_note(self, name: str) -> str:
        if name == "text_encoder_3":
            return f", last hidden state over {self.t5_tokens} tokens"
        return ", pooled output"

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each text's (1, t5_tokens, 4096) T5 context and (1, 768) CLIP-L pooled output."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for FLUX are not supported; remove embeddings_dir / "
                               "--embeddings for this model")
        if clip_skip != 1:
            raise RequestError("clip skip has no meaning for FLUX: it reads CLIP-L's pooled output, after the last "
                               "layer")
        notes: list[str] = []
        texts_in = []
        for t in texts:
            if _BREAK.search(t):
                _note(notes, "BREAK has no meaning for FLUX's text encoders (CLIP reads one chunk, T5 one row): "
                             "ignored")
                t = _BREAK.sub(",", t)
            texts_in.append(t)
        chunk_lists = []
        for t in texts_in:
            chunks, count = chunk_prompt(model.tokenizers["text_encoder"], t, None)
            if len(chunks) > 1:
                _note(notes, f"CLIP reads the first {CHUNK_LENGTH} tokens of a prompt for FLUX, as diffusers does; "
                             f"the rest ({count - CHUNK_LENGTH} tokens) reaches the model through T5 only")
            chunk_lists.append(chunks[:1])
        with torch.no_grad(), model.models.use("text_encoder") as encoder:
            _, pooled = encode_chunks(encoder, chunk_lists, 1, model.device, sdxl=True, pooled=True)
        contexts = self._t5(model, texts_in, notes)
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return contexts, [pooled[i] for i in range(len(texts_in))]

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        """The texts' conditioning and (dev's network) the reference images' latents
        (:func:`~.flux_kontext.encode_references`); Kontext inpainting without reference images: the source as
        prepared for the run (:func:`~.flux_kontext.source_reference`)."""
        cond = super().conditioning(model, r, use_cfg, embeddings)
        if r.reference_images:
            references = encode_references(self, model, r, self.resizes_references(r))
        elif self.kontext_inpaint(r):
            references = (source_reference(self, model, r),)
        else:
            return cond
        return ReferenceConditioning(**{f.name: getattr(cond, f.name) for f in dataclasses.fields(cond)},
                                     references=references)

    def scheduled(self, model, r, use_cfg, schedules, texts, contexts, pooled, warnings) -> ScheduledConditioning:
        constants = None
        if self.guidance_embedded:
            g = self.default_guidance if r.guidance is None else float(r.guidance)   # (resolve has set it)
            constants = {"guidance": torch.tensor([g], dtype=torch.float32, device=model.device)}
        return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                     warnings, pooled=dict(zip(texts, pooled)), pooled_key="pooled_projections",
                                     constants=constants)
