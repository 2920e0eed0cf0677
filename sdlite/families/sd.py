"""Stable Diffusion 1.x and 2.x (and their inpainting variants, and Taiyi's Chinese model): one text encoder, a
UNet that reads its hidden states as cross-attention context, 4-channel VAE latents scaled by 0.18215.

The text encoder is CLIP's (OpenAI ViT-L/14 for 1.x, OpenCLIP ViT-H for 2.x, read ``clip_skip`` layers from the
end) with A1111's 75-token chunks, or BERT's (Taiyi) with WordPiece tokens in one row of the tokenizer's length,
whose last hidden state the UNet was trained on. The parameterisation is the checkpoint's (eps for 1.x and 2.x
base, v for 2.x 768): :class:`~sdlite.sampling.denoisers.Denoiser` turns either into the denoised estimate.
"""
from __future__ import annotations

import torch

from ..conditioning import chunk_prompt, encode_chunks, single_row
from ..config import is_bert
from ..errors import RequestError
from .base import Family


class SDFamily(Family):
    """SD 1.x/2.x: a single CLIP or BERT text encoder as context, no added conditioning."""

    name = "sd"

    @classmethod
    def takes(cls, spec) -> bool:
        return spec.text is not None and spec.unet is not None and spec.unet.addition_embed is None

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], None]:
        """Each text's (1, 77 k, width) conditioning (with a WordPiece tokenizer: (1, max_length, width), one row),
        in one text-encoder pass; warnings about the texts (a cut prompt, an ignored BREAK) go to ``warnings``."""
        spec, tokenizer = self.spec, model.tokenizer
        layers = spec.text.layers
        if is_bert(spec.text) and clip_skip != 1:
            raise RequestError(f"clip skip {clip_skip} is not valid for this model: clip skip picks a layer of a "
                               "CLIP text encoder, and this model's text encoder is BERT (Taiyi), whose last "
                               "hidden state the UNet was trained on; use 1")
        if clip_skip > layers:
            raise RequestError(f"clip skip {clip_skip} is not valid for this model: its text encoder has "
                               f"{layers} layers, so 1..{layers} are valid")
        if getattr(tokenizer, "kind", "clip_bpe") == "wordpiece":
            if embeddings is not None and embeddings.embeddings:
                raise RequestError("textual-inversion embeddings are made for CLIP tokenizers and text encoders; "
                                   "this model reads WordPiece tokens (a BERT-style prompt row), so they cannot "
                                   "be used with it")
            chunk_lists = []
            for t in texts:
                chunks, _, notes = single_row(tokenizer, t)
                chunk_lists.append(chunks)
                if warnings is not None:
                    warnings += [n for n in notes if n not in warnings]
        else:
            chunk_lists = [chunk_prompt(tokenizer, t, embeddings)[0] for t in texts]
        with torch.no_grad(), model.models.use("text_encoder") as text_encoder:
            return encode_chunks(text_encoder, chunk_lists, clip_skip, model.device), None
