"""FLUX.2 [klein] (Black Forest Labs, 2026): a rectified-flow transformer (:mod:`sdlite.models.flux2`) on the
patchified, normalised latents of FLUX.2's 32-channel VAE (:mod:`sdlite.models.flux2_vae`), conditioned on an LLM's
hidden states (Qwen3-4B for klein-4B, Qwen3-8B for klein-9B: :mod:`sdlite.models.qwen`), and on reference images
for editing.

Conditioning, as diffusers' ``Flux2KleinPipeline`` builds it:

* each prompt in Qwen3's chat template as the one user message with thinking off (the assistant's turn opened with an
  empty ``<think>`` block), padded to 512 tokens; the encoder's hidden states 9, 18 and 27 (the outputs of those
  layers) stacked per token: a (1, 512, 3 x width) context for each text, the pads' states included (the transformer
  attends to all 512 tokens). The encoder stops after layer 27: the layers after it change nothing read;
* the negative prompt encoded the same way (the pipeline's is the empty prompt);
* reference images (``Request.reference_images``): each resized to at most 1024^2 pixels (Lanczos, keeping its
  aspect), centre-cropped to multiples of 16, encoded to the mean latent, patchified and normalised, and placed in
  the sequence after the image's tokens with position ids (10 (i + 1), row, column, 0); the transformer's output
  for them is dropped. Both guidance halves see them. Without an explicit size, the first reference's size is the
  output's;
* A1111's prompt syntax where it has a meaning, as for Z-Image: prompt editing and alternation schedule the texts;
  emphasis and BREAK are read as plain text, with a warning.

Guidance: the distilled models (klein-4B, klein-9B) draw in 4 steps without guidance (cfg 1); diffusers ignores a
guidance scale on them, sdlite runs classifier-free guidance whenever cfg is above 1, as ComfyUI does. The base
models (klein-base) take CFG, ``uncond + cfg * (cond - uncond)``, 4.0 and 50 steps by default (the pipeline's).

The latents: the VAE's (B, 32, H/8, W/8) latent cut into 2 x 2 patches, (B, 128, H/16, W/16), normalised by the
VAE's stored batch-norm statistics (:class:`NormalizedPatches`). The schedule: FlowMatchEulerDiscreteScheduler's over
the sigmas ``linspace(1, 1/steps, steps)``, shifted by ``mu`` from the image's token count and the step count
(:func:`empirical_mu`, the pipeline's ``compute_empirical_mu``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..config.flux2 import FLUX2_FAMILIES, Flux2Config
from ..errors import RequestError
from ..models.flux2_vae import denormalize_latents, normalize_latents, patchify_latents, unpatchify_latents
from ..sampling.denoisers import FlowDenoiser
from ..sources import image_to_tensor, load_image
from ..sources import prepare as prepare_source
from .base import FlowFamily, LatentFormat, ReferenceConditioning, ScheduledConditioning
from .flux import check_sides, fit_to_patches
from .zimage import _note, plain_prompt

MAX_TOKENS = 512                  # Flux2KleinPipeline's max_sequence_length: every text is padded to it
HIDDEN_STATES = (9, 18, 27)       # the pipeline's text_encoder_out_layers
REFERENCE_AREA = 1024 * 1024      # a reference image above this many pixels is scaled down to it
REFERENCE_MULTIPLE = 16           # a reference's sides are cropped to multiples of this
REFERENCE_MIN_SIDE = 64           # Flux2ImageProcessor.check_image_input's limits
REFERENCE_MAX_ASPECT = 8
DEFAULT_CFG = 4.0                 # Flux2KleinPipeline's guidance_scale default (the base models')

# ComfyUI's FLUX.2 latent preview factors: RGB of each of the 32 VAE channels of the normalised latent. The 128
# patchified channels take their VAE channel's factors over the 4 positions of a patch (each a quarter: the preview
# shows each patch's mean colour)
_CHEAP_RGB_32 = (
    (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614),
)
CHEAP_RGB_FLUX2 = tuple(tuple(v / 4 for v in rgb) for rgb in _CHEAP_RGB_32 for _ in range(4))


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's shift ``mu`` for an image of ``image_seq_len`` tokens sampled in ``num_steps`` steps (the pipelines'
    ``compute_empirical_mu``: a line in the step count between the fits at 10 and 200 steps, or above 4300 tokens
    the 200-step fit alone)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


@dataclass(frozen=True)
class NormalizedPatches(LatentFormat):
    """FLUX.2's latents: the VAE latent (B, 32, h, w) cut into 2 x 2 patches (B, 128, h/2, w/2) and normalised per
    channel by the VAE's batch-norm statistics, ``(x - mean) / sqrt(var + eps)``, in the pipelines' order of
    operations (:mod:`sdlite.models.flux2_vae`)."""

    mean: tuple = ()
    var: tuple = ()
    eps: float = 1e-4

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.mean or not self.var:
            raise RequestError("this FLUX.2 model's VAE statistics (bn.running_mean, bn.running_var) were not read "
                               "from its weights: the latents cannot be normalised")
        return torch.tensor(self.mean, dtype=torch.float32), torch.tensor(self.var, dtype=torch.float32)

    def scale(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, 32, h, w) -> the sampler's (B, 128, h/2, w/2)."""
        mean, var = self._stats()
        return normalize_latents(patchify_latents(latents), mean, var, self.eps)

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's latents (B, 128, h, w) -> the VAE's (B, 32, 2h, 2w)."""
        mean, var = self._stats()
        return unpatchify_latents(denormalize_latents(latents, mean, var, self.eps))


def _scaled_size(width: int, height: int) -> tuple[int, int]:
    """The size a ``width`` x ``height`` reference is resized to: above :data:`REFERENCE_AREA` pixels scaled down to
    it, its aspect kept (the sides truncated, as the pipeline's ``int``); within it, its own."""
    if width * height <= REFERENCE_AREA:
        return width, height
    scale = math.sqrt(REFERENCE_AREA / (width * height))
    return int(width * scale), int(height * scale)


def _prepared_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of a ``width`` x ``height`` reference as :func:`reference_pixels` prepares it: its
    :func:`_scaled_size`, both sides then cropped down to multiples of 16."""
    width, height = _scaled_size(width, height)
    return width // REFERENCE_MULTIPLE * REFERENCE_MULTIPLE, height // REFERENCE_MULTIPLE * REFERENCE_MULTIPLE


def _reference_image(source, index: int) -> Image.Image:
    """Reference image ``index`` (a path or a PIL image) loaded, its sides and aspect ratio checked."""
    what = f"reference image {index + 1}"
    image = load_image(source, what)
    width, height = image.size
    if width < REFERENCE_MIN_SIDE or height < REFERENCE_MIN_SIDE:
        raise RequestError(f"{what} is {width}x{height}: both sides must be at least {REFERENCE_MIN_SIDE} pixels")
    if max(width / height, height / width) > REFERENCE_MAX_ASPECT:
        raise RequestError(f"{what} is {width}x{height}: its aspect ratio is above {REFERENCE_MAX_ASPECT}:1")
    return image


def reference_pixels(source, index: int) -> torch.Tensor:
    """Reference image ``index`` (a path or a PIL image) as the pipeline prepares it: (1, 3, H, W) in [-1, 1], float32,
    with H and W multiples of 16 (scaled down to at most 1024^2 pixels, then centre-cropped: :func:`_prepared_size`)."""
    image = _reference_image(source, index).convert("RGB")
    size = image.size
    width, height = _scaled_size(*size)
    if (width, height) != size:
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    cw, ch = _prepared_size(*size)
    left, top = (width - cw) // 2, (height - ch) // 2
    image = image.crop((left, top, left + cw, top + ch))
    pixels = np.array(image).astype(np.float32) / 255.0                                 # (H, W, 3)
    tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None]
    return 2.0 * tensor - 1.0


def reference_size(source, index: int) -> tuple[int, int]:
    """(width, height) of reference image ``index`` as :func:`reference_pixels` prepares it, from its own size
    (:func:`_prepared_size`)."""
    if isinstance(source, torch.Tensor):   # encoded latents (1, 128, h, w): one per 16 x 16 pixels
        return source.shape[3] * REFERENCE_MULTIPLE, source.shape[2] * REFERENCE_MULTIPLE
    return _prepared_size(*_reference_image(source, index).size)


class Velocity:
    """FLUX.2's transformer as the flow network the denoiser calls: ``(x, t, context, references=(), cache=None)``."""

    def __init__(self, network):
        self.network = network

    def __call__(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, references=(), cache=None,
                 **extra) -> torch.Tensor:
        if extra:
            raise RequestError(f"FLUX.2's transformer takes no {', '.join(sorted(extra))}")
        if cache is not None:
            extra["cache"] = cache
        return self.network(x, t, context, references=references, **extra)


class Flux2Family(FlowFamily):
    """FLUX.2 [klein]: stacked Qwen3 states, reference images, flow matching on normalised 2 x 2 patches."""

    name = "flux2"
    preview_rgb = CHEAP_RGB_FLUX2
    shared_source_sample = True   # the klein pipelines encode the one source image once
    source_latent = "mean"        # ... with its latent distribution's mean (sample_mode="argmax")
    takes_references = True
    edits_from_images = True
    comfy_shift = 2.02            # ComfyUI's FLUX.2 model sampling (supported_models.Flux2: ModelSamplingFlux, mu 2.02)
    pads_with_empty = False       # every text is 512 tokens

    def __init__(self, spec):
        super().__init__(spec)
        vae = spec.vae
        self.latent = NormalizedPatches(vae.patched_channels, vae.patched_downscale, 1.0, 0.0,
                                        preview_rgb=self.preview_rgb, mean=vae.latents_mean or (),
                                        var=vae.latents_var or (), eps=vae.batch_norm_eps)

    @classmethod
    def takes(cls, spec) -> bool:
        return isinstance(spec.transformer, Flux2Config) and spec.family in FLUX2_FAMILIES

    @property
    def distilled(self) -> bool:
        return self.spec.family == FLUX2_FAMILIES[0]

    def schedule_for(self, schedule, width: int, height: int, steps: int | None = None):
        """mu from the image's token count (one per 2 x 2 patch of the VAE latent, 16 x 16 pixels) and the steps."""
        if not schedule.use_dynamic_shifting:
            return schedule
        tokens = (height // 16) * (width // 16)
        return schedule.with_mu(empirical_mu(tokens, steps if steps is not None else self.sampling_defaults["steps"]))

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        return FlowDenoiser(Velocity(model), schedule, dtype=dtype, multiplier=1.0)   # the network takes sigma

    def latent_mask(self, mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Flux2KleinInpaintPipeline's: the mask binarised at 0.5, then bilinear to the patch grid."""
        return torch.nn.functional.interpolate((mask >= 0.5).to(mask.dtype), size=size, mode="bilinear")

    def resolve(self, r):
        """Image to image without a size: the source's, fitted to multiples of 16 (:func:`~.flux.fit_to_patches`);
        text to image with reference images and no size: the first reference's."""
        r = super().resolve(fit_to_patches(r))
        if r.reference_images and (r.width is None or r.height is None) and not r.is_img2img:
            width, height = reference_size(r.reference_images[0], 0)
            r = r.replace(width=r.width or width, height=r.height or height)
        return r

    def check_request(self, r) -> None:
        layers = self.spec.text.num_hidden_layers
        if layers < max(HIDDEN_STATES):
            raise RequestError(f"FLUX.2 [klein] reads its text encoder's hidden states {HIDDEN_STATES}; this Qwen3 has "
                               f"{layers} layers (Qwen3-4B and Qwen3-8B have 36)")
        if r.slg_layers:
            raise RequestError("skip-layer guidance is SD3.5's; FLUX.2 has no such option")
        if r.controls:
            raise RequestError("ControlNets do not steer FLUX.2 [klein]: give the control image as a reference "
                               "image (--ref-image) instead")
        check_sides(r, "FLUX.2")

    @property
    def sampling_defaults(self) -> dict:
        """The distilled models: 4 steps without guidance; the base models: 50 steps at cfg 4 (the pipeline's
        defaults). Euler, the pipeline's scheduler."""
        if self.distilled:
            return {"steps": 4, "cfg": 1.0, "sampler": "euler", "timestep_spacing": None}
        return {"steps": 50, "cfg": DEFAULT_CFG, "sampler": "euler", "timestep_spacing": None}

    def info_lines(self) -> list[str]:
        d = self.sampling_defaults
        kind = "distilled" if self.distilled else "base model"
        return [f"defaults:    {d['steps']} steps, cfg {d['cfg']}{' (off)' if d['cfg'] == 1 else ''}, "
                f"{d['sampler']} (flow matching; {kind})",
                "editing:     reference images (--ref-image, repeatable)"]

    def text_encoder_note(self, name: str) -> str:
        layers = ", ".join(map(str, HIDDEN_STATES))
        return f", chat template, hidden states {layers} stacked over {MAX_TOKENS} tokens"

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], None]:
        """Each text's (1, 512, 3 x width) context: Qwen3's hidden states 9, 18 and 27 stacked per token."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for FLUX.2 are not supported; remove embeddings_dir / "
                               "--embeddings for this model")
        if clip_skip != 1:
            raise RequestError("clip skip has no meaning for FLUX.2: it reads fixed hidden states of its text encoder")
        notes: list[str] = []
        plain = [plain_prompt(t, notes, "FLUX.2") for t in texts]
        tokenizer = model.tokenizers["text_encoder"]
        ids, mask = tokenizer.chat_rows(plain, enable_thinking=False, max_length=MAX_TOKENS)   # (P, 512) each
        for t in plain:
            count = len(tokenizer.encode(tokenizer.chat_prompt(t, enable_thinking=False)))
            if count > MAX_TOKENS:
                _note(notes, f"FLUX.2's text encoder reads {MAX_TOKENS} tokens of the chat-templated prompt: the "
                             f"last {count - MAX_TOKENS} were cut")
        with torch.no_grad(), model.models.use("text_encoder") as encoder:
            states = encoder(ids.to(model.device), mask.to(model.device), hidden_states=HIDDEN_STATES)
        stacked = torch.stack(states, dim=1)                                             # (P, 3, 512, width)
        p, k, n, width = stacked.shape
        contexts = stacked.permute(0, 2, 1, 3).reshape(p, n, k * width)                  # (P, 512, 3 width)
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return [contexts[i:i + 1] for i in range(p)], None

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        """The texts' conditioning and the reference images' latents. Inpainting puts the source image (as prepared
        for the run) first among them, as Flux2KleinInpaintPipeline does."""
        cond = super().conditioning(model, r, use_cfg, embeddings)
        references = tuple(self.encode_reference(model, image, i) for i, image in enumerate(r.reference_images))
        if r.is_inpaint:
            source = prepare_source(r)   # its mean latent, remembered for the engine's start (encode_image)
            references = (model.encode_image(image_to_tensor(source.image), None), *references)
        return ReferenceConditioning(cond.prompt, cond.negative, cond.encoded, cond.warnings, references=references)

    def encode_reference(self, model, source, index: int) -> torch.Tensor:
        """Reference image ``index`` -> its normalised patch latents (1, 128, H/16, W/16): the VAE's mean latent (the
        pipeline's ``sample_mode="argmax"``); already encoded latents (ComfyUI's ReferenceLatent: a VAEEncode's, the
        same mean latent) as they are."""
        if isinstance(source, torch.Tensor):
            if source.shape[1] != self.latent.channels:
                raise RequestError(f"reference image {index + 1}: a {source.shape[1]}-channel latent; this model's "
                                   f"references are {self.latent.channels}-channel latents (encode the image with "
                                   "its own VAE)")
            return source.float().to(model.device)
        pixels = reference_pixels(source, index)
        with torch.no_grad(), model.models.use("vae") as vae:
            mean, _ = vae.encode_moments(pixels.to(model.device, vae.dtype))
        return self.latent.scale(mean.float())


__all__ = ["Flux2Family", "NormalizedPatches", "ReferenceConditioning", "empirical_mu", "reference_pixels",
           "CHEAP_RGB_FLUX2", "HIDDEN_STATES", "MAX_TOKENS"]
