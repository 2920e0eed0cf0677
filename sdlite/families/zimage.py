"""Z-Image (Tongyi-MAI's Z-Image-Turbo): a single-stream transformer (:mod:`sdlite.models.zimage`) on FLUX.1's kind of
16-channel latents, conditioned on an LLM's hidden states (Qwen3-4B, :mod:`sdlite.models.qwen`).

Conditioning, as diffusers' ``ZImagePipeline`` builds it:

* each prompt in Qwen3's chat template as the one user message, the assistant's turn opened
  (``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``), tokenized to at most 512 tokens;
* the encoder's second-to-last hidden state (``hidden_states[-2]``) of the prompt's real tokens alone: a caption of
  its own length (L, 2560) for each prompt, no padding. A batch of captions of different lengths runs with the
  shorter ones masked (:class:`LengthsConditioning`), so each image sees only its own caption;
* A1111's prompt syntax where it has a meaning: prompt editing and alternation schedule the texts as for every
  family. Emphasis has none for an LLM's hidden states here: ``(word:1.2)`` reads as ``word``, with a warning, and
  ``BREAK`` is ignored with a warning.

Guidance: A1111's and ComfyUI's cfg scale, ``uncond + cfg * (cond - uncond)``. diffusers' Z-Image pipelines write
``guidance_scale`` g for ``cond + g * (cond - uncond)``: the same guidance is cfg ``g + 1`` here (diffusers' 0, the
Turbo's setting, is cfg 1: off). The Turbo's defaults: 8 steps, cfg 1, Euler.

The latents: the VAE's 16 channels less 0.1159, times 0.3611 (FLUX.1's autoencoder). The schedule:
FlowMatchEulerDiscreteScheduler's with the model's shift (3 for Z-Image-Turbo, no dynamic shifting) over the
pipeline's sigmas ``linspace(1, 1/steps, steps)``. The network takes ``1 - sigma`` as its timestep and returns the
negated velocity (:class:`Velocity` turns it into the flow network the samplers' denoiser expects).
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..config.zimage import ZImageConfig
from ..errors import RequestError
from ..prompts import parse_attention, text_at_step
from ..sampling.denoisers import FlowDenoiser
from .base import FlowFamily, ScheduledConditioning
from .flux import CHEAP_RGB_FLUX, check_hires_sides, check_sides, fit_to_patches

MAX_TOKENS = 512          # ZImagePipeline's max_sequence_length: the chat-templated prompt's tokens
HIDDEN_STATE = -2         # the encoder's second-to-last hidden state (hidden_states[-2])
_BREAK = re.compile(r"\bBREAK\b")


class Velocity:
    """Z-Image's transformer as a flow network ``(x, t, context, context_lengths) -> v``: it is called with
    ``(1000 - t) / 1000`` (the pipeline's ``1 - sigma``, computed as the pipeline does from the training timestep
    ``t = sigma * 1000``), and its output is negated (the pipeline negates it before the scheduler's step)."""

    def __init__(self, network):
        self.network = network

    def __call__(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                 context_lengths: torch.Tensor | None = None, **extra) -> torch.Tensor:
        if extra:
            raise RequestError(f"Z-Image's transformer takes no {', '.join(sorted(extra))}")
        return -self.network(x, (1000 - t) / 1000, context, context_lengths)


@dataclasses.dataclass
class LengthsConditioning(ScheduledConditioning):
    """Per-step conditioning of captions of their own lengths: each text's encoding is (1, L, width) with L its real
    tokens. A step's prompt and negative prompt are zero-padded to the longer of the two, and the network is told
    each row's real length (``context_lengths``), so padding never reaches an image's attention."""

    def at(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cond = self.encoded[text_at_step(self.prompt, step)]
        if self.negative is None:
            return cond.expand(batch, -1, -1), None
        uncond = self.encoded[text_at_step(self.negative, step)]
        longest = max(cond.shape[1], uncond.shape[1])
        cond, uncond = (torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in (cond, uncond))
        return cond.expand(batch, -1, -1), uncond.expand(batch, -1, -1)

    def extra_at(self, step: int, batch: int) -> dict:
        context, uncond = self.at(step, batch)
        length = self.encoded[text_at_step(self.prompt, step)].shape[1]
        extra = {"context": context, "uncond": uncond,
                 "added": {"context_lengths": torch.full((batch,), length, dtype=torch.long)}}
        if self.negative is not None:
            length = self.encoded[text_at_step(self.negative, step)].shape[1]
            extra["uncond_added"] = {"context_lengths": torch.full((batch,), length, dtype=torch.long)}
        return extra


class ZImageFamily(FlowFamily):
    """Z-Image: Qwen3 captions of their own lengths, flow matching on FLUX.1's 16-channel latents."""

    name = "z-image"
    preview_rgb = CHEAP_RGB_FLUX
    shared_source_sample = True   # ZImageImg2ImgPipeline / ZImageInpaintPipeline encode the one source image once
    pads_with_empty = False       # a prompt and a negative of different lengths are zero-padded (LengthsConditioning)

    @classmethod
    def takes(cls, spec) -> bool:
        return isinstance(spec.transformer, ZImageConfig)

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        return FlowDenoiser(Velocity(model), schedule, dtype=dtype)   # timestep sigma * 1000, as the pipeline's

    def check_request(self, r) -> None:
        if r.slg_layers:
            raise RequestError("skip-layer guidance is SD3.5's; Z-Image has no such option")
        if r.controls:
            raise RequestError("ControlNet for Z-Image is a model kind of its own (ZImageControlNetModel) that sdlite "
                               "does not run yet; the SD 1.x/SDXL ControlNets cannot steer a Z-Image transformer")
        if r.noise != "comfy":   # ComfyUI's latents: any multiple of 8 pixels, padded to whole patches (the network's)
            check_sides(r, "Z-Image")
        check_hires_sides(r, "Z-Image", self.latent.downscale)

    def resolve(self, r):
        """Image to image without a size: the source's, fitted to 2x2 latent patches as ZImageImg2ImgPipeline
        fits it (:func:`~.flux.fit_to_patches`)."""
        return super().resolve(fit_to_patches(r))

    @property
    def sampling_defaults(self) -> dict:
        """Z-Image-Turbo's model card: 8 steps without guidance (diffusers' guidance_scale 0: cfg 1 here), Euler."""
        return {"steps": 8, "cfg": 1.0, "sampler": "euler", "timestep_spacing": None}

    def info_lines(self) -> list[str]:
        d = self.sampling_defaults
        return [f"defaults:    {d['steps']} steps, cfg {d['cfg']} (off), {d['sampler']} (flow matching)",
                "cfg:         A1111's scale: diffusers' guidance_scale g is cfg g + 1"]

    def text_encoder_note(self, name: str) -> str:
        return f", chat template, hidden state {HIDDEN_STATE} of the prompt's tokens (up to {MAX_TOKENS})"

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], None]:
        """Each text's (1, L, 2560) caption: Qwen3's hidden state of its real tokens (L of them, the chat template's
        included); no pooled embedding."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for Z-Image are not supported; remove embeddings_dir / "
                               "--embeddings for this model")
        if clip_skip != 1:
            raise RequestError("clip skip has no meaning for Z-Image: it reads its text encoder's second-to-last "
                               "hidden state, always")
        notes: list[str] = []
        plain = [plain_prompt(t, notes, "Z-Image") for t in texts]
        tokenizer = model.tokenizers["text_encoder"]
        ids, mask = tokenizer.chat_rows(plain, max_length=MAX_TOKENS)                    # (P, 512) each
        for t, text in zip(plain, texts):
            count = len(tokenizer.encode(tokenizer.chat_prompt(t)))
            if count > MAX_TOKENS:
                _note(notes, f"Z-Image's text encoder reads {MAX_TOKENS} tokens of the chat-templated prompt: the "
                             f"last {count - MAX_TOKENS} were cut")
        if not _exact(model):
            # the pads after the longest prompt change nothing the family reads: attention is causal, so a real
            # token never sees a later position, and only the real tokens' states are kept. Cut, the encoder runs
            # on the prompt's ~20-100 tokens rather than 512 (the same values; other sums of rounding, so exact
            # keeps the pipeline's 512 and its bits)
            longest = int(mask.sum(dim=1).max())
            ids, mask = ids[:, :longest], mask[:, :longest]
        with torch.no_grad(), model.models.use("text_encoder") as encoder:
            hidden = encoder(ids.to(model.device), mask.to(model.device), hidden_states=HIDDEN_STATE)
        lengths = mask.sum(dim=1).tolist()
        contexts = [hidden[i:i + 1, :n] for i, n in enumerate(lengths)]                  # (1, L_i, 2560) each
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return contexts, None

    def conditioning(self, model, r, use_cfg: bool, embeddings=None) -> ScheduledConditioning:
        cond = super().conditioning(model, r, use_cfg, embeddings)
        return LengthsConditioning(cond.prompt, cond.negative, cond.encoded, cond.warnings)


def plain_prompt(text: str, notes: list[str], family: str) -> str:
    """``text`` without A1111's emphasis syntax and BREAK, each dropped with a note naming ``family`` (an LLM's hidden
    states have no per-token weights here, and its one chat-templated prompt no chunks)."""
    pieces = parse_attention(text)
    if any(w < 0 for _, w in pieces) or _BREAK.search(text):
        _note(notes, f"BREAK has no meaning for {family}'s text encoder (one chat-templated prompt): ignored")
    if any(w >= 0 and abs(w - 1.0) > 1e-6 for _, w in pieces):
        _note(notes, f"emphasis weights ((word:1.2), [word]) have no effect on {family}'s text encoder: the words "
                     "are read at weight 1")
    return " ".join(" ".join(p for p, w in pieces if w >= 0).split()) if len(pieces) != 1 or \
        pieces[0][1] != 1.0 else pieces[0][0]


def _exact(model) -> bool:
    """Whether ``model`` runs at the ``exact`` precision (bit for bit with the reference pipeline's shapes)."""
    precision = getattr(model, "precision", None)
    return precision is None or precision.name == "exact"


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
