"""What the generic loop asks of a model family, and the pieces every family shares.

A :class:`Family` is an object the loop (:mod:`sdlite.pipeline`) asks things of, never a flag it tests:

* **conditioning** -- :meth:`Family.encode_prompt` (prompts to one context tensor) and :meth:`Family.conditioning`
  (a request's prompt and negative prompt as per-step conditioning, :class:`ScheduledConditioning`, with whatever
  added conditioning the network reads: pooled text embeddings, size ids);
* **latent format** -- :attr:`Family.latent` (:class:`LatentFormat`: channels, VAE scale and shift, downscale, the
  cheap preview's colours);
* **parameterisation** -- :attr:`Family.prediction_type` (eps or v; flow matching joins them as one more), and
  from it :meth:`Family.denoiser` and :meth:`Family.noise_schedule`;
* **default schedule and sizes** -- :attr:`Family.scheduler_config`, :attr:`Family.default_size`;
* **what it can do** -- :meth:`Family.check_generate` refuses a request the family cannot draw (the x4 upscaler
  draws no images from text), :meth:`Family.check_request` one its variant cannot (an inpainting model without a
  mask), and :meth:`Family.load_dtypes` picks the dtypes its networks load in.

The ``model`` the methods take is a loaded model (:class:`sdlite.families.loaded.LoadedModel`): its networks
(``models``), tokenizers, device and spec. A new family is a module here with a subclass, its networks in
:mod:`sdlite.models` and its key tables in :mod:`sdlite.weights`; :func:`sdlite.families.family_for` finds it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from ..conditioning import pad_to_same_length
from ..errors import RequestError
from ..prompts import ScheduledPrompt, prompt_schedule, text_at_step
from ..sampling.denoisers import Denoiser
from ..sampling.flow import FlowSchedule
from ..sampling.schedules import NoiseSchedule

# latent -> RGB in [-1, 1], one linear map per latent channel: the approximation of the SD 1.x/2.x VAE that the
# A1111 web UI calls "Approx cheap" (after https://discuss.huggingface.co/t/decoding-latents-to-rgb-without-upscaling/23204)
CHEAP_RGB = ((0.298, 0.207, 0.208), (0.187, 0.286, 0.173), (-0.158, 0.189, 0.264), (-0.184, -0.271, -0.473))
# the same for SDXL's VAE (the coefficients A1111 and other UIs use for SDXL's cheap preview)
CHEAP_RGB_SDXL = ((0.3448, 0.4168, 0.4395), (-0.1953, -0.0290, 0.0250), (0.1074, 0.0886, -0.0163),
                  (-0.3730, -0.2499, -0.2088))


@dataclass(frozen=True)
class LatentFormat:
    """What a family's latents are: ``channels`` at 1/``downscale`` of the image's size; the sampler works on VAE
    latents times ``scaling_factor`` (after subtracting ``shift_factor``); ``preview_rgb`` maps each channel to RGB
    for the cheap preview."""

    channels: int
    downscale: int
    scaling_factor: float
    shift_factor: float = 0.0
    preview_rgb: tuple = CHEAP_RGB

    def scale(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the sampler's: ``(latents - shift_factor) * scaling_factor``."""
        return (latents - self.shift_factor) * self.scaling_factor if self.shift_factor else \
            latents * self.scaling_factor

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's latents -> the VAE's: ``latents / scaling_factor + shift_factor``."""
        return latents / self.scaling_factor + self.shift_factor if self.shift_factor else \
            latents / self.scaling_factor


def initial_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """(B, *shape) standard normal noise, image i drawn from ``generators[i]`` (CPU), as the reference does."""
    return torch.cat([torch.randn((1, *shape), generator=g) for g in generators])


def latents_to_images(images: torch.Tensor) -> list:
    """Decoded images in [-1, 1] (B, 3, H, W) -> PIL images, rounded as the reference does."""
    arr = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in (arr * 255).round().astype(np.uint8)]


def approximate_images(latents: torch.Tensor, scale: int = 8, sdxl: bool = False, coefs=None) -> list:
    """Scaled latents (B, C, h, w) -> PIL images (scale h x scale w) through a fixed linear map of the channels
    (``coefs``, C rows of RGB; None: the SD 1.x/2.x VAE's, or with ``sdxl`` SDXL's): no network runs, so it costs
    next to nothing. Faithful for the VAE the coefficients were fitted to; for another (the demo model's) it shows
    where the shapes are, in approximate colours."""
    coefs = torch.tensor(coefs if coefs is not None else CHEAP_RGB_SDXL if sdxl else CHEAP_RGB, dtype=torch.float32)
    if latents.shape[1] != coefs.shape[0]:
        raise RequestError(f"the cheap preview needs {coefs.shape[0]} latent channels, not {latents.shape[1]}")
    rgb = torch.einsum("bchw,cr->brhw", latents.detach().float().cpu(), coefs)
    rgb = torch.nn.functional.interpolate(rgb, scale_factor=scale, mode="bilinear", align_corners=False)
    return latents_to_images(rgb)


@dataclass
class ScheduledConditioning:
    """Per-step conditioning: the prompt's (and negative prompt's) schedule of texts and their encodings."""

    prompt: list[ScheduledPrompt]
    negative: list[ScheduledPrompt] | None
    encoded: dict[str, torch.Tensor]     # text -> (1, 77 k, width)
    warnings: list[str] = field(default_factory=list)   # about the texts: a prompt cut, BREAK ignored
    # pooled text embeddings (text -> (1, proj)), the negative conditioning as zeros, (prompt, negative) size ids:
    # the added conditioning of the families that have it (SDXL)
    pooled: dict[str, torch.Tensor] | None = None
    zero_negative: bool = False
    time_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # the network's keyword for the pooled embedding: SDXL's UNet reads it with the time ids as ``text_embeds``,
    # SD3's transformer alone as ``pooled_projections``
    pooled_key: str = "text_embeds"
    # further network arguments, one value per image, the same for the prompt and the negative prompt (FLUX.1 dev's
    # distilled guidance scale): name -> (1,) tensor
    constants: dict[str, torch.Tensor] | None = None

    @property
    def changes(self) -> bool:
        return len(self.prompt) > 1 or (self.negative is not None and len(self.negative) > 1)

    def at(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(context, uncond) at 0-based sampler step ``step`` of the planned steps, each (batch, 77 k, width),
        the two of the same length (the shorter padded with the empty prompt's encoding, as A1111 does)."""
        cond = self.encoded[text_at_step(self.prompt, step)]
        if self.negative is None:
            return cond.expand(batch, -1, -1), None
        if self.zero_negative:
            return cond.expand(batch, -1, -1), torch.zeros_like(cond).expand(batch, -1, -1)
        uncond = self.encoded[text_at_step(self.negative, step)]
        if cond.shape[1] != uncond.shape[1]:
            cond, uncond = pad_to_same_length([cond, uncond], self.encoded[""])
        return cond.expand(batch, -1, -1), uncond.expand(batch, -1, -1)

    def extra_at(self, step: int, batch: int) -> dict:
        """The denoiser's conditioning arguments at ``step``: ``context`` and ``uncond`` (:meth:`at`) and, where the
        family has them, ``added`` and ``uncond_added``, the network's added conditioning (pooled text embeddings,
        and SDXL's time ids)."""
        context, uncond = self.at(step, batch)
        extra = {"context": context, "uncond": uncond}
        if self.pooled is None:
            return extra
        constants = {k: v.expand(batch) for k, v in (self.constants or {}).items()}
        pooled = self.pooled[text_at_step(self.prompt, step)]
        extra["added"] = {self.pooled_key: pooled.expand(batch, -1), **constants}
        if self.time_ids is not None:
            extra["added"]["time_ids"] = self.time_ids[0].expand(batch, -1)
        if self.negative is not None:
            neg = torch.zeros_like(pooled) if self.zero_negative else self.pooled[text_at_step(self.negative, step)]
            extra["uncond_added"] = {self.pooled_key: neg.expand(batch, -1), **constants}
            if self.time_ids is not None:
                extra["uncond_added"]["time_ids"] = self.time_ids[1].expand(batch, -1)
        return extra


@dataclass
class ReferenceConditioning(ScheduledConditioning):
    """Per-step conditioning with the reference images' latents, each (1, channels, h_i, w_i) in the sampler's
    scaling, passed to the network with every call (both guidance halves): FLUX.2 klein's and FLUX.1 Kontext's
    editing."""

    references: tuple = ()

    def extra_at(self, step: int, batch: int) -> dict:
        extra = super().extra_at(step, batch)
        if self.references:
            extra["references"] = self.references
        return extra


@dataclass(frozen=True)
class LoraSampling:
    """How a distilled LoRA is sampled (Qwen-Image-Lightning's): the scheduler config it was distilled on, which
    replaces the model's while it is applied, and the steps and cfg it is made for (the defaults of a run that leaves
    them unset)."""

    lora: str          # the LoRA's name (its file's stem, or the prompt tag's name)
    kind: str          # what it is, for the notes: "Qwen-Image-Lightning"
    scheduler: dict    # a scheduler_config.json's fields
    steps: int
    cfg: float

    def note(self, steps: int, cfg: float) -> str:
        """The run's note: the schedule switched, and whether the run's ``steps`` and ``cfg`` are the LoRA's."""
        text = (f"{self.kind} LoRA ({self.lora}): sampled on the schedule it was distilled with, in place of the "
                f"model's")
        if (steps, float(cfg)) == (self.steps, float(self.cfg)):
            return f"{text}, at its {self.steps} steps and cfg {self.cfg:g}"
        return (f"{text}; its settings are {self.steps} steps at cfg {self.cfg:g}, this run's {steps} steps at cfg "
                f"{float(cfg):g} (left unset, steps and cfg take its)")


class Family:
    """A model family: what the loop asks of the networks a :class:`~sdlite.config.ModelSpec` describes. Subclasses
    say which specs they take (:meth:`takes`) and override what differs."""

    name = "sd"
    preview_rgb = CHEAP_RGB   # the cheap preview's colours for its VAE's latents
    # image to image and inpainting from one source image: False, each image of a batch draws its own sample of the
    # source's latent from its generator (diffusers' SD and SDXL pipelines encode the source once per image); True,
    # the first image's generator draws one sample that the batch shares (Z-Image's pipelines encode it once)
    shared_source_sample = False
    # the source image's latent: "sample" (a draw of the VAE's distribution from the image's generator, as diffusers'
    # img2img and inpaint pipelines encode it) or "mean" (the distribution's mean, no draw: FLUX.2 klein's pipelines)
    source_latent = "sample"
    # reference images (Request.reference_images): the family conditions on them (FLUX.2's editing); others refuse
    takes_references = False
    # an editing model (FLUX.2 klein, FLUX.1 Kontext, Qwen-Image-Edit): trained to edit from reference images, so the servers' image
    # routes (A1111 img2img, OpenAI edits without a mask, MCP edit_image) hand it their images as references. A model
    # that takes references without being trained on them (plain FLUX.1 dev) gets them only when asked explicitly
    edits_from_images = False
    # ComfyUI's sampling shift of the family's models where its ModelSampling differs from what the model's schedule
    # implies (its model_sampling settings: FLUX.2's mu 2.02); None: the schedule's (sdlite.sampling.comfy.FlowTable)
    comfy_shift: float | None = None
    # a prompt and a negative prompt of different lengths are padded with the empty prompt's encoding (A1111's rule),
    # so classifier-free guidance encodes "" too; False where the family pads otherwise or its lengths are fixed
    pads_with_empty = True
    # its VAE decodes in tiles (sdlite.engine.tiling: AutoencoderKL's structure); False decodes whole (Qwen-Image's)
    tiles_vae = True
    # classifier-free guidance of the family's own (CFGDenoiser's ``combine``): None, A1111's
    # ``uncond + cfg * (cond - uncond)``; Qwen-Image's true CFG rescales the result
    guidance = None

    def __init__(self, spec):
        self.spec = spec
        vae = spec.vae
        self.latent = LatentFormat(vae.latent_channels, vae.downscale, vae.scaling_factor, vae.shift_factor,
                                   preview_rgb=self.preview_rgb)

    @classmethod
    def takes(cls, spec) -> bool:
        """Whether this family runs models of ``spec``."""
        raise NotImplementedError

    @property
    def prediction_type(self) -> str:
        return self.spec.prediction_type

    def noise_schedule(self, scheduler_config: dict):
        """The training noise schedule the samplers walk, from the model's scheduler config."""
        return NoiseSchedule.from_config(scheduler_config)

    def schedule_for(self, schedule, width: int, height: int, steps: int | None = None):
        """The model's noise schedule for a ``width`` x ``height`` image sampled in ``steps`` steps (a shift that
        depends on them sets it here); by default the schedule itself."""
        return schedule

    def resolve(self, r):
        """The validated request ``r`` with this family's own defaults filled in (FLUX.1 dev's guidance scale) and
        the options it has no use for cleared (a distilled guidance scale, which only FLUX.1 dev embeds)."""
        return r.replace(guidance=None) if r.guidance is not None else r

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        """The denoiser (:mod:`sdlite.sampling.denoisers`) over network ``model`` run in ``dtype``: what turns its
        output (eps, v) into the estimate of the clean latent."""
        return Denoiser(model, schedule, self.prediction_type, dtype=dtype)

    @property
    def default_size(self) -> int:
        return self.spec.default_size

    @property
    def scheduler_config(self) -> dict:
        return self.spec.scheduler

    @property
    def inpainting(self) -> bool:
        """An inpainting variant: its UNet reads the mask and the masked image's latents beside the latent."""
        return self.spec.unet.in_channels != self.latent.channels

    def latent_mask(self, mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """An inpainting mask (1, 1, H, W) in [0, 1] (1 = repaint) at the latent's ``size`` (h, w): nearest, as
        diffusers' inpainting pipelines take it."""
        return torch.nn.functional.interpolate(mask, size=size)

    def check_generate(self, request) -> None:
        """Refuse (:class:`~sdlite.errors.RequestError`) any request, before it is validated, where this family
        draws no images through the loop."""

    def check_request(self, r) -> None:
        """Refuse a validated request this model cannot run: a UNet whose input channels are neither the latent's
        nor an inpainting model's, an inpainting model asked for image to image without a mask."""
        if r.slg_layers:
            raise RequestError(f"skip-layer guidance skips blocks of SD3.5's transformer; this model "
                               f"({self.spec.family}) has none to skip")
        unet_in, channels = self.spec.unet.in_channels, self.latent.channels
        if self.inpainting and unet_in != 2 * channels + 1:
            raise RequestError(f"this UNet takes {unet_in} input channels: sdlite runs {channels} (text to image, "
                               f"image to image) or {2 * channels + 1} (inpainting models)")
        if self.inpainting and r.is_img2img and not r.is_inpaint:
            raise RequestError(f"{self.spec.family} is an inpainting model: image to image needs a mask "
                               "(--mask, --mask-from-alpha or --outpaint); without one it would repaint everything")

    @property
    def sampling_defaults(self) -> dict | None:
        """The steps, cfg, sampler and timestep spacing a front-end gives a request that leaves them unset, where
        this family has settings of its own (None: the front-end's, A1111's)."""
        return None

    def lora_sampling(self, names: list[str]) -> LoraSampling | None:
        """The sampling of a distilled LoRA among the LoRAs ``names`` (file stems, prompt tags' names) a run applies,
        where this family knows one by its name (Qwen-Image-Lightning); None: the model's own schedule."""
        return None

    def sampling_defaults_for(self, names: list[str]) -> dict | None:
        """:attr:`sampling_defaults` for a run applying the LoRAs ``names``: a distilled LoRA's steps and cfg
        (:meth:`lora_sampling`) in place of the model's. What front-ends fill a request's unset fields with."""
        own = self.lora_sampling(names)
        defaults = self.sampling_defaults
        if own is None or defaults is None:
            return defaults
        return {**defaults, "steps": own.steps, "cfg": own.cfg}

    def check_loras(self, paths: list) -> None:
        """Refuse (:class:`~sdlite.errors.RequestError`) LoRAs where this family's networks take none (the files are
        checked against the model's layers later, when they are merged)."""

    def info_lines(self) -> list[str]:
        """Lines ``sdlite info`` adds for this family (after the native size)."""
        return []

    def text_encoder_note(self, name: str) -> str:
        """What ``sdlite info`` adds to the line of text encoder ``name``: how this family reads it."""
        return ""

    def load_dtypes(self, ckpt, plan, device: torch.device, memory_mode: int, prepack, weight_dtype):
        """(weight dtype, VAE dtype) for a model of this family loaded under precision ``plan``: by default the
        plan's, and resident weights in ``weight_dtype`` as asked (None: the compute dtype)."""
        return weight_dtype, plan.vae_dtype

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings, warnings: list[str] | None = None):
        """Each text's conditioning, in one pass per text encoder: (contexts, pooled or None)."""
        raise NotImplementedError

    def encode_prompt(self, model, prompts: list[str], clip_skip: int = 1,
                      embeddings=None) -> tuple[torch.Tensor, list[str]]:
        """(P, 77 k, width) contexts of P prompts in one text-encoder pass, by A1111's rules
        (:mod:`sdlite.conditioning`); prompts with fewer chunks are padded with the empty prompt's encoding. Returns
        the warnings too (a cut prompt, an ignored BREAK)."""
        warnings: list[str] = []
        encoded = self.encode_texts(model, list(prompts), clip_skip, embeddings, warnings)[0]
        empty = self.encode_texts(model, [""], clip_skip, None)[0][0] if len({e.shape[1] for e in encoded}) > 1 \
            else None
        return torch.cat(pad_to_same_length(encoded, empty) if empty is not None else encoded), warnings

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        """The request's prompt and negative prompt (network tags already removed) as per-step conditioning:
        A1111's prompt editing and alternation (:func:`sdlite.prompts.prompt_schedule`) over ``r.steps``, each
        distinct text encoded once, in one text-encoder pass."""
        schedules = [prompt_schedule(r.prompt, r.steps)]
        if use_cfg:
            schedules.append(prompt_schedule(r.negative_prompt, r.steps))
        texts = list(dict.fromkeys(p.text for schedule in schedules for p in schedule))
        if use_cfg and self.pads_with_empty:
            texts.append("")  # the padding of a prompt and negative of different lengths
        warnings: list[str] = []
        contexts, pooled = model.encoded_texts(texts, r.clip_skip, embeddings, warnings)
        return self.scheduled(model, r, use_cfg, schedules, texts, contexts, pooled, warnings)

    def scheduled(self, model, r, use_cfg, schedules, texts, contexts, pooled, warnings) -> ScheduledConditioning:
        """The conditioning of :meth:`conditioning` from the encoded texts (families with added conditioning add
        it here)."""
        return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                     warnings)


class FlowFamily(Family):
    """A rectified-flow transformer family of the LLM generation (Z-Image, FLUX.2 [klein], Qwen-Image): flow
    prediction, no inpainting variant of the network (inpainting re-imposes the source's latents after each step), and
    the pipelines' sigmas ``linspace(1, 1/steps, steps)`` before the model's shift."""

    @property
    def prediction_type(self) -> str:
        return "flow"

    @property
    def inpainting(self) -> bool:
        return False

    def noise_schedule(self, scheduler_config: dict):
        return dataclasses.replace(FlowSchedule.from_config(scheduler_config), sigma_spacing="linear")
