"""Qwen-Image (Alibaba's Qwen team, 2025): a 20B double-stream MMDiT (:mod:`sdlite.models.qwenimage`) on the
normalised 16-channel latents of a causal 3D VAE run on one frame (:mod:`sdlite.models.qwenimage_vae`), conditioned on
the last hidden state of Qwen2.5-VL-7B's language model (:mod:`sdlite.models.qwen`). Text to image, image to image
and inpainting.

Conditioning, as diffusers' ``QwenImagePipeline`` builds it:

* each prompt in a fixed chat template: a system turn asking for a description of the image (:data:`SYSTEM_PROMPT`),
  the prompt as the user's turn, the assistant's turn opened; tokenized to at most 1024 + 34 tokens;
* the encoder's last hidden state (after its final norm) of the real tokens, the template's first 34 tokens dropped
  (:data:`DROPPED_TOKENS`: the system turn and the user turn's opening), cut to 512 (the pipeline's
  ``max_sequence_length``): a caption of its own length (1, L, 3584) for each text. A prompt and a negative prompt of
  different lengths run in one batch with the shorter one masked (:class:`~.zimage.LengthsConditioning`, the network's
  ``context_mask``), as the pipeline runs them in two calls each with its own mask;
* A1111's prompt syntax where it has a meaning, as for Z-Image: prompt editing and alternation schedule the texts;
  emphasis and BREAK are read as plain text, with a warning.

Guidance: the pipeline's true CFG (``true_cfg_scale``), ``uncond + cfg * (cond - uncond)`` on the velocity, then
rescaled token by token (2 x 2 latent patches, 64 values) to the norm of the prompt's own velocity
(:func:`true_cfg`). diffusers guides only with a negative prompt given; sdlite whenever cfg is above 1, the negative
prompt left empty encoding "" (the model card's is " "). Defaults: the model card's 50 steps at cfg 4, 1328 x 1328.

The latents: the VAE's (B, 16, H/8, W/8), normalised per channel by the VAE config's ``latents_mean`` and
``latents_std`` (:class:`NormalizedLatents`); the transformer packs them into 2 x 2 patches itself. The schedule:
FlowMatchEulerDiscreteScheduler's over the sigmas ``linspace(1, 1/steps, steps)`` with the dynamic shift ``mu`` from
the image's token count (``calculate_shift``, one token per 16 x 16 pixels), stretched to ``shift_terminal``. The
network takes ``sigma`` (the training timestep / 1000) and returns the velocity. Sides are multiples of 16 pixels (the
pipelines resize others; sdlite names the nearest); ComfyUI's sampling (``Request.noise="comfy"``, its KSampler)
takes the multiples of 8 that ComfyUI's latents have, the network padding an odd latent side as ComfyUI's does
(:func:`~sdlite.models.layers.pad_to_patches`: wrapped around, cropped after).

Image to image and inpainting, as ``QwenImageImg2ImgPipeline`` and ``QwenImageInpaintPipeline`` run them: the one
source image encoded once, a sample of its posterior drawn by the first image's generator and shared by the batch
(``retrieve_latents`` with the default ``sample_mode``), normalised; each image's noise from its own generator after it;
the schedule's first ``int(steps - steps * strength)`` steps skipped (the pipelines' ``get_timesteps``). Inpainting: the mask binarised at half white and
nearest-resized to the latent, the masked image encoded too (its draw taken from the first generator, its latents
unused by the 16-channel transformer), the unmasked region put back after each step (the source noised to the next
step's sigma, the clean source after the last).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..adapters.lora_files import lora_names
from ..config.qwenimage import QWEN_IMAGE_FAMILY, QWEN_IMAGE_LIGHTNING_SCHEDULER, QwenImageConfig
from ..errors import RequestError
from ..models.flux import pack_latents, unpack_latents
from ..sampling.comfy import DiscreteFlowShift
from ..sampling.denoisers import FlowDenoiser
from .base import FlowFamily, LatentFormat, LoraSampling, ScheduledConditioning
from .flux import check_hires_sides, check_sides, fit_to_patches
from .zimage import LengthsConditioning, _exact, _note, plain_prompt

__all__ = ["QwenImageFamily", "NormalizedLatents", "Velocity", "true_cfg", "SYSTEM_PROMPT", "DROPPED_TOKENS",
           "MAX_TOKENS", "CHEAP_RGB_QWEN_IMAGE"]

SYSTEM_PROMPT = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                 "relationships of the objects and background:")
DROPPED_TOKENS = 34       # the pipeline's prompt_template_encode_start_idx: the template's tokens before the prompt
TOKENIZER_MAX = 1024      # the pipeline's tokenizer_max_length: the templated text is cut to this + DROPPED_TOKENS
MAX_TOKENS = 512          # QwenImagePipeline's max_sequence_length default: the caption's tokens kept
DEFAULT_CFG = 4.0         # the pipeline's true_cfg_scale default and the model card's
DEFAULT_STEPS = 50
MIN_STEPS = 2             # the fewest a schedule stretched to shift_terminal runs (QwenImageFamily.check_steps)
# a Qwen-Image-Lightning LoRA's file name: "Lightning", then the steps it was distilled for ("8steps", "4-steps")
LIGHTNING = re.compile(r"lightning.*?(\d+)[-_ ]?steps?", re.IGNORECASE)

# ComfyUI's preview factors of the Wan 2.1 latent (Qwen-Image's VAE is Wan 2.1's): RGB of each normalised channel
CHEAP_RGB_QWEN_IMAGE = (
    (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747), (0.0372, 0.2344, 0.1420),
    (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665), (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975),
    (-0.0412, 0.0267, -0.1364), (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
    (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950), (0.1984, 0.0913, 0.1861),
)


@dataclass(frozen=True)
class NormalizedLatents(LatentFormat):
    """Qwen-Image's latents: the VAE latent (B, 16, h, w) normalised per channel, ``(z - mean) / std``; back as the
    pipeline writes it, ``z / (1 / std) + mean``."""

    mean: tuple = ()
    std: tuple = ()

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.mean) != like.shape[1] or len(self.std) != like.shape[1]:
            raise RequestError(f"Qwen-Image latents of {like.shape[1]} channels, but the VAE's latent statistics "
                               f"(latents_mean, latents_std in vae/config.json) have {len(self.mean)} and "
                               f"{len(self.std)} values")
        shape = (1, like.shape[1], 1, 1)
        return (torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(shape),
                torch.tensor(self.std, dtype=like.dtype, device=like.device).view(shape))

    def scale(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the sampler's."""
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's latents -> the VAE's."""
        mean, std = self._stats(latents)
        return latents / (1.0 / std) + mean


class Velocity:
    """Qwen-Image's transformer as the flow network the denoiser calls: ``(x, t, context, context_lengths=None,
    cache=None, references=()) -> v``, each row's caption masked after its own length, the edit's source latents
    (``references``) in the sequence after the image's tokens."""

    def __init__(self, network):
        self.network = network

    def __call__(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                 context_lengths: torch.Tensor | None = None, cache=None, references=(), **extra) -> torch.Tensor:
        if extra:
            raise RequestError(f"Qwen-Image's transformer takes no {', '.join(sorted(extra))}")
        if references:   # Qwen-Image-Edit's source latents
            extra["references"] = references
        mask = None
        if context_lengths is not None:
            positions = torch.arange(context.shape[1], device=context.device)
            mask = (positions[None, :] < context_lengths.to(context.device)[:, None]).long()   # (B, M)
        if cache is not None:   # a step cache wraps the network with its own cache argument otherwise
            extra["cache"] = cache
        return self.network(x, t, context, mask, **extra)


def true_cfg(x: torch.Tensor, sigma: torch.Tensor, uncond: torch.Tensor, cond: torch.Tensor,
             scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG on the denoised estimates of a flow model (``denoised = x - sigma v``): on the
    velocities, ``comb = v_uncond + scale (v_cond - v_uncond)``, then each token's 64 values (a 2 x 2 patch of the 16
    channels, as the pipeline packs them) times ``|v_cond| / |comb|``; the estimate of the result. A latent of an odd
    side (ComfyUI's, :func:`~sdlite.models.layers.pad_to_patches`) takes the norms of its last, half patches over
    the values it has (padded with zeros, cropped after)."""
    s = sigma.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))                  # (B, 1, 1, 1)
    if bool((s == 0).any()):   # no velocity to read back: plain guidance (the samplers never call sigma 0)
        return uncond + scale * (cond - uncond)
    v_uncond, v_cond = (x - uncond) / s, (x - cond) / s
    h, w = x.shape[2:]
    pad = (0, w % 2, 0, h % 2)
    comb = v_uncond + scale * (v_cond - v_uncond)
    if any(pad):
        comb, v_cond = F.pad(comb, pad), F.pad(v_cond, pad)
    comb = pack_latents(comb)                                                 # (B, N, 64)
    cond_norm = torch.norm(pack_latents(v_cond), dim=-1, keepdim=True)        # (B, N, 1)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    v = unpack_latents(comb * (cond_norm / comb_norm), h + h % 2, w + w % 2)
    return x - s * v[:, :, :h, :w]


class QwenImageFamily(FlowFamily):
    """Qwen-Image: Qwen2.5-VL captions of their own lengths, true CFG, flow matching on normalised latents."""

    name = "qwen-image"
    preview_rgb = CHEAP_RGB_QWEN_IMAGE
    pads_with_empty = False       # a prompt and a negative of different lengths are masked (LengthsConditioning)
    shared_source_sample = True   # QwenImageImg2ImgPipeline / QwenImageInpaintPipeline encode the one source once,
    source_latent = "sample"      # ... drawing the posterior's sample with the first image's generator
    tiles_vae = False             # the causal 3D VAE has no tiled decode in sdlite yet: decoded whole
    # ComfyUI samples Qwen-Image with ModelSamplingDiscreteFlow at shift 1.15 (supported_models.QwenImage), not the
    # pipelines' shift by image size
    comfy_shift = DiscreteFlowShift(1.15)

    def __init__(self, spec):
        self.spec = spec
        vae = spec.vae
        self.latent = NormalizedLatents(vae.latent_channels, vae.downscale, 1.0, 0.0, preview_rgb=self.preview_rgb,
                                        mean=tuple(vae.latents_mean), std=tuple(vae.latents_std))

    @classmethod
    def takes(cls, spec) -> bool:
        return isinstance(spec.transformer, QwenImageConfig) and spec.family == QWEN_IMAGE_FAMILY

    def guidance(self, x, sigma, uncond, cond, scale):
        """The family's classifier-free guidance (:func:`true_cfg`)."""
        return true_cfg(x, sigma, uncond, cond, scale)

    def schedule_for(self, schedule, width: int, height: int, steps: int | None = None):
        """mu from the image's token count: one per 2 x 2 patch of the latent (16 x 16 pixels)."""
        return schedule.for_image((height // 16) * (width // 16))

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        return FlowDenoiser(Velocity(model), schedule, dtype=dtype, multiplier=1.0)   # the network takes sigma

    def resolve(self, r):
        """Image to image without a size: the source's, fitted to multiples of 16 (:func:`~.flux.fit_to_patches`)."""
        return super().resolve(fit_to_patches(r))

    def check_request(self, r) -> None:
        if r.slg_layers:
            raise RequestError("skip-layer guidance is SD3.5's; Qwen-Image has no such option")
        if r.controls:
            raise RequestError("ControlNets for Qwen-Image are model kinds of their own that sdlite does not run yet; "
                               "the SD 1.x/SDXL ControlNets cannot steer a Qwen-Image transformer")
        if r.hires is not None and self.takes_references:
            raise RequestError("the hires fix is Qwen-Image's text to image; for Qwen-Image-Edit edit the image at the "
                               "size wanted, or upscale the result (sdlite upscale)")
        if r.noise != "comfy":   # ComfyUI's latents: any multiple of 8 pixels, padded to whole patches (module notes)
            check_sides(r, "Qwen-Image")
        check_hires_sides(r, "Qwen-Image", self.latent.downscale)
        self.check_steps(r)

    def check_steps(self, r) -> None:
        """Refuse a step count the schedule cannot run: the pipelines' sigmas ``linspace(1, 1/steps, steps)`` are
        stretched to end at the scheduler's ``shift_terminal`` (0.02 in the published config), which one step, a
        lone sigma 1, cannot be; the hires fix's second pass likewise. ComfyUI's sampling (its own flow table),
        explicit timesteps or sigmas, and a distilled LoRA's scheduler without the stretch (Qwen-Image-Lightning's)
        take one step."""
        if r.noise == "comfy" or r.timesteps is not None or r.sigmas is not None:
            return
        own = self.lora_sampling(lora_names(r.prompt, r.loras))
        terminal = (self.spec.scheduler if own is None else own.scheduler).get("shift_terminal")
        if not terminal:
            return
        for what, steps in (("steps", r.steps), ("the hires fix's steps", r.hires.steps if r.hires else 0)):
            if steps == 1:
                raise RequestError(f"{what}={steps}: Qwen-Image's schedule stretches its sigmas to end at "
                                   f"shift_terminal={terminal:g}, which takes at least {MIN_STEPS} steps; use "
                                   f"{MIN_STEPS} or more")

    def lora_sampling(self, names: list[str]) -> LoraSampling | None:
        """lightx2v's Qwen-Image-Lightning LoRAs, by their files' names (``Qwen-Image-Lightning-8steps-V1.1``,
        ``Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16``): "lightning" and the step count they were distilled for;
        their model card's scheduler (:data:`~sdlite.config.qwenimage.QWEN_IMAGE_LIGHTNING_SCHEDULER`), that many
        steps, true CFG off (``true_cfg_scale`` 1)."""
        for name in names:
            found = LIGHTNING.search(name)
            if found and int(found.group(1)) >= 1:
                return LoraSampling(name, "Qwen-Image-Lightning", dict(QWEN_IMAGE_LIGHTNING_SCHEDULER),
                                    int(found.group(1)), 1.0)
        return None

    @property
    def sampling_defaults(self) -> dict:
        """The model card's: 50 steps at true CFG 4 (the pipeline's defaults), Euler (its scheduler)."""
        return {"steps": DEFAULT_STEPS, "cfg": DEFAULT_CFG, "sampler": "euler", "timestep_spacing": None}

    def info_lines(self) -> list[str]:
        d = self.sampling_defaults
        return [f"defaults:    {d['steps']} steps, cfg {d['cfg']}, {d['sampler']} (flow matching)",
                "cfg:         the pipeline's true_cfg_scale, its norm-preserving rescale included"]

    def text_encoder_note(self, name: str) -> str:
        return (f", system prompt template, last hidden state of the prompt's tokens (the first {DROPPED_TOKENS} "
                f"dropped, up to {MAX_TOKENS})")

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], None]:
        """Each text's (1, L, 3584) caption: Qwen2.5-VL's last hidden state of its templated tokens after the first
        34, at most 512 of them; no pooled embedding."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for Qwen-Image are not supported; remove embeddings_dir "
                               "/ --embeddings for this model")
        if clip_skip != 1:
            raise RequestError("clip skip has no meaning for Qwen-Image: it reads its text encoder's last hidden "
                               "state, always")
        notes: list[str] = []
        plain = [plain_prompt(t, notes, "Qwen-Image") for t in texts]
        tokenizer = model.tokenizers["text_encoder"]
        rows = []
        for t in plain:
            ids = tokenizer.encode(tokenizer.chat_prompt(t, system=SYSTEM_PROMPT))
            kept = min(len(ids), TOKENIZER_MAX + DROPPED_TOKENS) - DROPPED_TOKENS
            if kept > MAX_TOKENS:
                _note(notes, f"Qwen-Image's text encoder reads {MAX_TOKENS} tokens of the templated prompt: the last "
                             f"{len(ids) - DROPPED_TOKENS - MAX_TOKENS} were cut")
            rows.append(ids[:DROPPED_TOKENS + MAX_TOKENS])   # the tokens after these are never read
        if _exact(model):
            # each text alone, as the pipeline encodes a batch of one prompt (no pads: plain causal attention)
            hidden = [self._encode(model, [ids]) for ids in rows]
        else:   # one batch, right-padded: causal attention, so no real token sees a pad
            states = self._encode(model, rows)
            hidden = [states[i:i + 1, :len(ids)] for i, ids in enumerate(rows)]
        contexts = [h[:, DROPPED_TOKENS:] for h in hidden]                               # (1, L_i, 3584) each
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return contexts, None

    @staticmethod
    def _encode(model, rows: list[list[int]]) -> torch.Tensor:
        """The last hidden states (P, N, width) of token rows, right-padded to the longest with a mask."""
        longest = max(len(ids) for ids in rows)
        tokenizer = model.tokenizers["text_encoder"]
        padded = [tokenizer.pad(ids, longest) for ids in rows]
        ids = torch.tensor([p[0] for p in padded], dtype=torch.long)
        mask = torch.tensor([p[1] for p in padded], dtype=torch.long)
        with torch.no_grad(), model.models.use("text_encoder") as encoder:
            return encoder(ids.to(model.device), mask.to(model.device), hidden_states=-1)

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        cond = super().conditioning(model, r, use_cfg, embeddings)
        return LengthsConditioning(cond.prompt, cond.negative, cond.encoded, cond.warnings)
