"""Stable Diffusion XL, base and refiner (and SDXL Turbo, and SSD-1B-style distillations of the same UNet).

Conditioning, as diffusers' ``StableDiffusionXLPipeline`` builds it:

* the context is the penultimate hidden states of two CLIP towers (ViT-L and OpenCLIP bigG; the refiner has only
  the second) without their final LayerNorm, concatenated along the channels; ``clip_skip`` 2 and up reach further
  back, as diffusers' ``clip_skip`` 1 and up do;
* the added conditioning is the second tower's pooled, projected embedding and six size ids: original size, crop
  top-left, target size (the refiner: original size, crop, aesthetic score);
* with no negative prompt, the negative context and pooled embedding are zeros where the model's config says so
  (``force_zeros_for_empty_prompt``; A1111: an empty negative prompt).

Its VAE overflows in fp16 and decodes in fp32 there (``force_upcast``); on a CPU computing fp32, half-precision
weights stay in the file's dtype, computed block by block (6.9 GB resident instead of 13.5 GB).
"""
from __future__ import annotations

import torch

from ..conditioning import chunk_prompt, encode_chunks
from ..errors import RequestError
from .base import CHEAP_RGB_SDXL, Family, ScheduledConditioning


class SDXLFamily(Family):
    """SDXL base and refiner: two (or one) CLIP towers, pooled text embedding and size ids as added conditioning."""

    name = "sdxl"
    preview_rgb = CHEAP_RGB_SDXL

    @classmethod
    def takes(cls, spec) -> bool:
        return spec.unet is not None and spec.unet.addition_embed == "text_time"

    def info_lines(self) -> list[str]:
        zeros = "zeros when no negative prompt is given" if self.spec.force_zeros_for_empty_prompt else \
            "encoded, also when empty"
        return [f"negative:    {zeros} (force_zeros_for_empty_prompt)"]

    def text_encoder_note(self, name: str) -> str:
        pooled = f", pooled output projected to {self.spec.text2.projection_dim}" if name == "text_encoder_2" else ""
        return ", penultimate layer" + pooled

    def load_dtypes(self, ckpt, plan, device: torch.device, memory_mode: int, prepack, weight_dtype):
        if (weight_dtype is None and device.type == "cpu" and plan.dtype == torch.float32 and memory_mode != 0
                and plan.quantize == "none" and not prepack
                and ckpt.storage_dtype in (torch.float16, torch.bfloat16)):
            # on the CPU the weights stay in the file's half precision (zero-copy), computed in fp32 block by block
            weight_dtype = ckpt.storage_dtype
        # the VAE overflows in fp16: it decodes in fp32 then (bf16 has fp32's range)
        vae_dtype = torch.float32 if self.spec.vae.force_upcast and plan.vae_dtype == torch.float16 \
            else plan.vae_dtype
        return weight_dtype, vae_dtype

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each text's (1, 77 k, width) context and its (1, proj) pooled embedding from the second encoder, whose
        tokenizer pads with its own pad token. Chunked by A1111's rules, each encoder's chunks weighted on their
        own, the pooled embedding of the first chunk (as A1111 does)."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for SDXL (with clip_l and clip_g vectors) are not "
                               "supported yet; remove embeddings_dir / --embeddings for this model")
        spec = self.spec
        parts, pooled = [], None
        for name in spec.text_encoders:
            cfg = spec.text if name == "text_encoder" else spec.text2
            if clip_skip + 1 > cfg.layers:
                raise RequestError(f"clip skip {clip_skip} is not valid for this model: SDXL reads the layer before "
                                   f"the one clip skip names, and its {name} has {cfg.layers} layers, so "
                                   f"1..{cfg.layers - 1} are valid")
            chunk_lists = [chunk_prompt(model.tokenizers[name], t, None)[0] for t in texts]
            with torch.no_grad(), model.models.use(name) as text_encoder:
                if name == "text_encoder_2":
                    hidden, pooled = encode_chunks(text_encoder, chunk_lists, clip_skip, model.device, sdxl=True,
                                                   pooled=True)
                else:
                    hidden = encode_chunks(text_encoder, chunk_lists, clip_skip, model.device, sdxl=True)
            parts.append(hidden)
        return [torch.cat(hs, dim=-1) for hs in zip(*parts)], pooled

    def time_ids(self, r, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (1, 6) size/crop ids of the prompt and of the negative prompt, as diffusers builds them: original
        size, crop top-left, target size (the refiner: original size, crop, aesthetic score, (1, 5))."""
        size = (r.height, r.width)
        head = (*(r.original_size or size), *r.crops_coords_top_left)
        if self.spec.requires_aesthetics_score:
            pos, neg = (*head, r.aesthetic_score), (*head, r.negative_aesthetic_score)
        else:
            pos = neg = (*head, *(r.target_size or size))
        return (torch.tensor([pos], dtype=torch.float32, device=device),
                torch.tensor([neg], dtype=torch.float32, device=device))

    def scheduled(self, model, r, use_cfg, schedules, texts, contexts, pooled, warnings) -> ScheduledConditioning:
        # no negative prompt: zeros for its context and pooled embedding, where the model's config says so
        # (diffusers: negative_prompt None; A1111: an empty negative prompt)
        zero = use_cfg and self.spec.force_zeros_for_empty_prompt and r.negative_prompt == ""
        return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                     warnings, pooled=dict(zip(texts, pooled)), zero_negative=zero,
                                     time_ids=self.time_ids(r, model.device))
