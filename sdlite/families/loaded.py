"""A model of some family, loaded on a device: its networks (through a
:class:`~sdlite.engine.memory.ModelManager`), tokenizers, noise schedule and :class:`~sdlite.families.base.Family`,
and what every run asks of them -- prompts to conditioning, latents to images and back, previews.

:class:`sdlite.pipeline.Engine` is one of these with the request loop on top; the x4 upscaler
(:class:`sdlite.upscalers.x4.X4Upscaler`) runs on one directly. Nothing here branches on a family: what differs
is the family object's answer.
"""
from __future__ import annotations

import hashlib

import torch

from ..adapters.lora_files import lora_names
from ..engine.memory import ModelManager, trim_heap
from ..engine.precision import Precision
from ..engine.precision import resolve as resolve_precision
from ..engine.tiling import tiled_decode
from ..errors import RequestError
from ..loader import StableDiffusion
from . import family_for
from .base import ScheduledConditioning, approximate_images, latents_to_images

AUTO_TILE, AUTO_TILE_ABOVE = 64, 96   # latent pixels: tile 512 px when an image side exceeds 768 px
# memory mode 1 ("all resident (fastest)") with a bf16 decoder on a CPU: untiled up to 1024 px. FLUX.1's 16-channel VAE
# at 1024^2 on a 2-core Xeon with AMX: 7.3 s untiled (peak RSS 3.7 GB) against 25.7 s in 512 px tiles (2.4 GB), whose
# layer-by-layer windows lose the bf16 decoder's channels-last and phase-upsampled convolutions
FAST_BF16_TILE_ABOVE = 128
TEXT_CACHE_SIZE = 8                   # requests whose text encodings a warm engine keeps (LoadedModel.encoded_texts)
IMAGE_TEXT_CACHE_SIZE = 4             # ... and whose captions of source images (LoadedModel.remembered): larger each
LOW_MEMORY_TILE = 32                  # memory mode 0: tiles of 256 px above 256 px (a 512^2 decode in 4 tiles)
OWN_TAESD_NAME = "vae (AutoencoderTiny)"   # the PNG parameters' VAE decoder when it is the model folder's own TAESD


def _kept(cache: dict, key, compute, size: int):
    """``cache[key]``, computed by ``compute()`` when missing; the entry made the most recent (a dict keeps insertion
    order) and the least recent ones dropped past ``size``."""
    hit = cache.pop(key, None)
    if hit is None:
        hit = compute()
    cache[key] = hit
    while len(cache) > size:
        cache.pop(next(iter(cache)))
    return hit


class LoadedModel:
    """A model on a device, ready to be asked for conditioning and images. Holds no per-request state.

    Which networks stay in memory is the :class:`~sdlite.engine.memory.ModelManager`'s business (memory modes
    0/1/2); the model asks it for each network when it needs it.
    """

    def __init__(self, model: StableDiffusion | ModelManager, device: str | torch.device = "cpu",
                 tokenizer=None, spec=None, scheduler_config: dict | None = None, vae_tile: int | None = None,
                 tokenizers: dict | None = None):
        if isinstance(model, StableDiffusion):
            tokenizer, spec, scheduler_config = model.tokenizer, model.spec, model.scheduler_config
            tokenizers = {"text_encoder": model.tokenizer, "text_encoder_2": model.tokenizer_2}
            model = ModelManager(model.checkpoint, mode=1, device=device, preloaded=model)
        self.models = model
        self.device = torch.device(device)
        self.vae_tile = vae_tile  # tiled-decode tile in latent pixels; None: automatic; 0: off
        self.tokenizer, self.spec = tokenizer, spec
        self.family = family_for(spec)
        # each text encoder's tokenizer (SDXL: two; they differ in their padding)
        self.tokenizers = {name: (tokenizers or {}).get(name) or tokenizer for name in spec.text_encoders}
        self.schedule = self.family.noise_schedule(scheduler_config)
        # TAESDs (sdlite.models.taesd): one that decodes the final images instead of the VAE (:meth:`set_vae_decoder`)
        # and one for the "TAESD" live previews (:meth:`set_preview_decoder`); None: the VAE / no such previews
        self.vae_decoder = None
        self.preview_decoder = None
        # the text encoders' outputs of the last requests (encoded_texts)
        self._text_cache: dict = {}
        self._image_text_cache: dict = {}   # a family's conditioning from images (remembered)
        self._moments_memo: tuple | None = None   # (digest of the image, its latent's mean and std): encode_image
        # a batch whose estimated UNet (decoder) activations exceed these bytes runs in pieces (None: the device's
        # default, sdlite.engine.budget); the rule never looks at the memory free, so images never depend on it
        self.unet_piece_bytes: int | None = None
        self.decode_piece_bytes: int | None = None
        # what each network computes in (sdlite.engine.precision; Engine.load sets it); recorded in the PNG
        self.precision: Precision = resolve_precision("exact" if self.device.type == "cpu" else "fp16", self.device)
        # the model's own TAESD (a folder whose vae/ is an AutoencoderTiny, as IDKiro's SDXS ones): the default
        # decoder of the final images, as diffusers' pipeline uses it; where the model has no AutoencoderKL beside
        # it, also what encodes image-to-image sources
        self.tiny_vae = self._own_taesd()
        self.vae_decoder = self.tiny_vae

    def schedule_for(self, r):
        """The noise schedule of request ``r`` (FLUX's shift depends on the image's size; other families': the
        model's schedule as it is; a distilled LoRA's own where ``r`` applies one, :meth:`lora_sampling`), carrying
        the request's explicit timesteps or sigmas where it has them."""
        own = self.lora_sampling(r)
        base = self.schedule if own is None else self.family.noise_schedule(own.scheduler)
        schedule = self.family.schedule_for(base, r.width, r.height, r.steps)
        timesteps, sigmas = getattr(r, "timesteps", None), getattr(r, "sigmas", None)
        if timesteps is None and sigmas is None:
            return schedule
        return schedule.with_custom(timesteps=timesteps, sigmas=sigmas)

    def lora_sampling(self, r):
        """The :class:`~sdlite.families.base.LoraSampling` of a distilled LoRA that request ``r`` applies (a
        Qwen-Image-Lightning file among ``r.loras`` or the prompt's ``<lora:NAME:...>`` tags, by name:
        :meth:`Family.lora_sampling <sdlite.families.base.Family.lora_sampling>`); None where it applies none, and for
        ComfyUI's sampling (``noise="comfy"``), whose graph sets the schedule itself as ComfyUI's does."""
        if getattr(r, "noise", None) == "comfy":
            return None
        names = lora_names(getattr(r, "prompt", ""), getattr(r, "loras", ()))
        return self.family.lora_sampling(names) if names else None

    def sampling_defaults_for(self, r) -> dict | None:
        """The family's sampling defaults for request ``r``: a distilled LoRA's steps and cfg where ``r`` applies one
        (:meth:`lora_sampling`); what the servers and Ray fill a request's unset fields with, as the CLI does."""
        names = lora_names(getattr(r, "prompt", ""), getattr(r, "loras", ())) if r is not None else []
        return self.family.sampling_defaults_for(names)

    # -- decoders ----------------------------------------------------------------------------------------------------

    @property
    def has_vae(self) -> bool:
        """Whether the model has an AutoencoderKL (a folder with only an AutoencoderTiny in vae/ has none)."""
        ckpt = self.models.ckpt
        return ckpt is None or ckpt.has_vae

    def set_vae_decoder(self, taesd) -> None:
        """Decode the final images with ``taesd`` (a :class:`~sdlite.models.taesd.TinyAutoencoder` with a decoder)
        instead of the VAE: a fraction of the VAE's time, some detail lost; the PNG parameters say ``VAE decoder``.
        None: the VAE (the AutoencoderKL), also where the model's folder makes its own TAESD the default (SDXS)."""
        if taesd is None and not self.has_vae:
            raise RequestError(f"this model has no full VAE to decode with: its vae/ is an AutoencoderTiny and its "
                               f"folder has no vae_large/ ({self.models.ckpt.path})")
        self.vae_decoder = self._checked_taesd(taesd)

    def _own_taesd(self):
        """The TAESD of the model's folder (``Checkpoint.tiny_vae``), loaded for this model; None when it has none.
        Its encoder is loaded only where the model has no AutoencoderKL to encode with."""
        path = getattr(self.models.ckpt, "tiny_vae", None)
        if path is None:
            return None
        from ..weights.taesd import load_taesd, model_variant

        parts = ("decoder",) if self.has_vae else ("decoder", "encoder")
        taesd = load_taesd(path, model_variant(self.spec), parts=parts)
        taesd.name = OWN_TAESD_NAME
        return self._checked_taesd(taesd)

    def set_preview_decoder(self, taesd) -> None:
        """The TAESD for :meth:`preview` with ``tiny`` (A1111's "TAESD" live previews); None: none."""
        self.preview_decoder = self._checked_taesd(taesd)

    def _checked_taesd(self, taesd):
        if taesd is None:
            return None
        from ..weights.taesd import model_variant

        cfg, vae, name = taesd.config, self.spec.vae, taesd.name
        if taesd.decoder is None:
            raise RequestError(f"{name} holds no TAESD decoder")
        if cfg.latent_channels != vae.latent_channels or cfg.downscale != vae.downscale:
            raise RequestError(f"{name} decodes {cfg.latent_channels}-channel latents {cfg.downscale}x; this model's "
                               f"are {vae.latent_channels}-channel, {vae.downscale}x")
        wanted = model_variant(self.spec)
        if cfg.variant is not None and cfg.variant != wanted:
            raise RequestError(f"{name} is a TAESD for {cfg.variant} latents; this model ({self.spec.family}) needs "
                               f"one for {wanted}")
        return self.models.adapt_like_vae(taesd)

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompts: list[str], clip_skip: int = 1, labels: list[str] | None = None,
                      embeddings=None) -> tuple[torch.Tensor, list[str]]:
        """(P, 77 k, width) contexts of P prompts in one text-encoder pass, by A1111's rules
        (:mod:`sdlite.conditioning`: emphasis, 75-token chunks, ``BREAK``, ``embeddings``), as the family encodes
        them (:meth:`sdlite.families.base.Family.encode_prompt`). Returns the warnings too (for CLIP none: long
        prompts are chunked, not cut; for BERT a cut prompt or an ignored BREAK)."""
        return self.family.encode_prompt(self, prompts, clip_skip, embeddings)

    def encoded_texts(self, texts: list[str], clip_skip: int, embeddings, warnings: list[str]):
        """The family's :meth:`~sdlite.families.base.Family.encode_texts` of ``texts``, remembered for the next
        requests (a warm engine re-encodes nothing it encoded for one of the last ``TEXT_CACHE_SIZE`` requests:
        a server's re-queued prompt with a new seed, a batch of seeds). Keyed by everything the encoders' output
        depends on besides their weights: the texts, the clip skip and the embeddings' files; while a LoRA changes a
        text encoder's weights (:meth:`~sdlite.engine.memory.ModelManager.adapted`: one that touches only the
        denoiser keeps the cache) nothing is remembered or reused; the weights are restored after it, so what was
        remembered before holds again."""
        if any(self.models.adapted(name) for name in self.spec.text_encoders):
            return self.family.encode_texts(self, texts, clip_skip, embeddings, warnings)
        found = getattr(embeddings, "embeddings", None) or {}
        key = (tuple(texts), clip_skip, tuple(sorted((e.name, e.path, e.hash) for e in found.values())))

        def encode():
            notes: list[str] = []
            return self.family.encode_texts(self, texts, clip_skip, embeddings, notes), notes

        hit = _kept(self._text_cache, key, encode, TEXT_CACHE_SIZE)
        warnings += [n for n in hit[1] if n not in warnings]
        return hit[0]

    def remembered(self, key, compute, network: str = "text_encoder"):
        """``compute()``, remembered under ``key`` for the next requests: a family's conditioning that reads images
        (Qwen-Image-Edit's captions with their source images, the vision tower's and the encoder's work) which a
        re-rolled seed asks for again. ``key`` holds everything the value depends on besides ``network``'s weights
        (texts, the images' digests, the template, the precision); the last ``IMAGE_TEXT_CACHE_SIZE`` keys are kept.
        While a LoRA changes ``network`` (:meth:`~sdlite.engine.memory.ModelManager.adapted`) nothing is remembered
        or reused; the model's weights are restored after it, so what was remembered before holds again."""
        if self.models.adapted(network):
            return compute()
        return _kept(self._image_text_cache, key, compute, IMAGE_TEXT_CACHE_SIZE)

    def conditioning(self, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        """The request's prompt and negative prompt (network tags already removed) as per-step conditioning
        (:meth:`sdlite.families.base.Family.conditioning`)."""
        return self.family.conditioning(self, r, use_cfg, embeddings)

    # -- latents and images ------------------------------------------------------------------------------------------

    def decode_tile(self, height: int, width: int) -> int:
        """The tile (latent pixels; 0: untiled) a latent of ``height`` x ``width`` is decoded in."""
        if not self.family.tiles_vae:
            return 0
        tile = self.vae_tile
        if tile is None:  # automatic: large images are decoded in tiles, which bounds the decoder's temporaries
            side = max(height, width)
            if self.models.mode == 0:  # low memory: an untiled 512^2 decode alone needs about 1 GB of temporaries
                tile = LOW_MEMORY_TILE if side > LOW_MEMORY_TILE else 0
            else:
                fast = self.models.mode == 1 and self.models.dtype_of("vae") == torch.bfloat16 \
                    and torch.device(self.device).type == "cpu"
                tile = AUTO_TILE if side > (FAST_BF16_TILE_ABOVE if fast else AUTO_TILE_ABOVE) else 0
        return tile

    def decode_latents(self, latents: torch.Tensor, piece: int | None = None) -> torch.Tensor:
        """Unscaled latents (B, C, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]; ``piece`` images per decoder
        call (None: all at once)."""
        if not self.has_vae:   # only a tiny VAE: it decodes what the VAE would
            return self._taesd_decode(self.tiny_vae, self.family.latent.scale(latents), piece)
        if piece is not None and piece < latents.shape[0]:
            return torch.cat([self.decode_latents(latents[i:i + piece]) for i in range(0, latents.shape[0], piece)])
        tile = self.decode_tile(*latents.shape[-2:])
        if not tile:
            with torch.no_grad(), self.models.use("vae") as vae:
                return vae.decode(latents.to(self.device, vae.dtype))
        with torch.no_grad(), self.models.use_whole("vae") as vae:  # tiling calls the layers one by one
            return tiled_decode(vae, latents.to(self.device, vae.dtype), tile)

    def release_before_decode(self) -> None:
        """Hand the sampling loop's freed activations (which glibc keeps in its heap, to reuse step after step) back
        to the system before the VAE allocates its own, larger ones, or both count in the peak (about 250 MB less peak
        at 512^2 for SD 1.5). Not before a TAESD, outside memory mode 0: its buffers fit in what the loop freed, and
        fresh pages cost it more than its convolutions (a warm 512^2 decode 0.19 -> 0.10 s, peak RSS +100 MB)."""
        if self.vae_decoder is None or self.models.mode == 0:
            trim_heap()

    def decode_scaled(self, latents: torch.Tensor, piece: int | None = None) -> torch.Tensor:
        """Latents as the sampler gives them (B, C, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]: by the TAESD of
        :meth:`set_vae_decoder` when there is one (it takes them as they are), else by the VAE."""
        if self.vae_decoder is None:
            return self.decode_latents(self.family.latent.unscale(latents), piece=piece)
        return self._taesd_decode(self.vae_decoder, latents, piece)

    @staticmethod
    def _taesd_decode(taesd, latents: torch.Tensor, piece: int | None) -> torch.Tensor:
        piece = piece or latents.shape[0]
        with torch.no_grad():
            return torch.cat([taesd.decode(latents[i:i + piece].to(taesd.device, taesd.dtype))
                              for i in range(0, latents.shape[0], piece)])

    def preview(self, latents: torch.Tensor, full: bool = False, tiny: bool = False) -> list:
        """Images of an estimate of the final latents (what ``on_latents`` of :meth:`sdlite.pipeline.Engine.generate`
        receives): decoded by the VAE (``full``: exact, a decoder pass), by the TAESD of :meth:`set_preview_decoder`
        (``tiny``: close, a small fraction of the VAE's time) or by
        :func:`~sdlite.families.base.approximate_images` (instant, approximate)."""
        if tiny and self.preview_decoder is not None:
            taesd = self.preview_decoder
            with torch.no_grad():
                return latents_to_images(taesd.decode(latents.to(taesd.device, taesd.dtype)))
        latent = self.family.latent
        if not full:
            return approximate_images(latents, latent.downscale, coefs=latent.preview_rgb)
        return latents_to_images(self.decode_latents(latent.unscale(latents)))

    def encode_image(self, image: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """Images (1, 3, H, W) in [-1, 1] -> scaled latents (B, C, H/8, W/8): one encoder pass, then one sample
        of the latent distribution per generator, each drawn as the reference draws it (``randn`` of the
        latent's shape from generator i; diffusers encodes the image once per batch item to the same moments).
        Without generators, the distribution's mean (B = 1). The moments of the pixels last encoded are remembered
        for their next call, which then only draws: an editing family's inpainting source is encoded once as its
        reference in the sequence and once more by the engine as its start (klein's and Kontext's the mean twice;
        Qwen-Image-Edit's the same posterior sample twice, by two generators of the same seed, as the pipeline's one
        ``image_latents`` serves both), and a re-rolled seed encodes the same source again. A model with only a tiny
        VAE encodes by its TAESD encoder, which gives the latents themselves (as diffusers takes an AutoencoderTiny's),
        nothing drawn."""
        if not self.has_vae:
            taesd = self.tiny_vae
            with torch.no_grad():
                latents = taesd.encode(image.to(taesd.device, taesd.dtype)).float().to(self.device)
            return latents.expand(len(generators) if generators else 1, -1, -1, -1).clone()
        key = (tuple(image.shape), hashlib.blake2b(image.detach().cpu().float().numpy().tobytes(),
                                                  digest_size=16).digest())
        if self._moments_memo is not None and self._moments_memo[0] == key:
            mean, std = self._moments_memo[1:]
        else:
            with torch.no_grad(), self.models.use("vae") as vae:
                mean, logvar = vae.encode_moments(image.to(self.device, vae.dtype))
            mean, std = mean.float(), torch.exp(0.5 * logvar.float())
            self._moments_memo = (key, mean, std)
        latent = self.family.latent
        if not generators:
            return latent.scale(mean)
        draws = torch.cat([torch.randn(mean.shape, generator=g) for g in generators]).to(mean.device)
        return latent.scale(mean + std * draws)
