"""Stable Diffusion 3 and 3.5 (Medium, Large, Large Turbo): a transformer (MMDiT) denoises 16-channel latents by flow
matching, conditioned on three text encoders.

Conditioning, as diffusers' ``StableDiffusion3Pipeline`` builds it:

* CLIP ViT-L and OpenCLIP bigG, each read at its penultimate layer (no final LayerNorm), their 77 hidden states
  concatenated along the channels (768 + 1280 = 2048) and zero-padded to T5's width (4096);
* T5-XXL's last hidden state over 256 tokens (the prompt, its end token, padding; no attention mask), appended along
  the tokens: a (1, 77 + 256, 4096) context. A model loaded without T5 has zeros there, 256 tokens of them, as
  diffusers gives when ``text_encoder_3`` is None; a warning says so;
* the pooled, projected embeddings of both CLIP towers, concatenated (768 + 1280 = 2048), as the added input
  ``pooled_projections``;
* an empty negative prompt is encoded like any other (SD3 does not zero it).

A1111's prompt syntax where it has a meaning: emphasis weights each token's hidden state in both CLIP towers (A1111's
"Original" emphasis, the mean restored) and in T5 (the same rule over its tokens); prompt editing and alternation
schedule the texts as for every family. CLIP reads one 75-token chunk, as diffusers does: a longer prompt is cut there
for CLIP (T5 reads up to 256 tokens) and a warning says so; ``BREAK`` has no meaning for these encoders and is ignored
with a warning.

The latents: the VAE's 16 channels less 0.0609, times 1.5305 (its config's shift_factor and scaling_factor); the
parameterisation: flow matching (:mod:`sdlite.sampling.flow`), with the shifted schedule of the model's
FlowMatchEulerDiscreteScheduler config.
"""
from __future__ import annotations

import re

import torch

from ..conditioning import CHUNK_LENGTH, chunk_prompt, encode_chunks
from ..config import SD3_FAMILIES
from ..errors import RequestError
from ..prompts import parse_attention
from ..sampling.denoisers import FlowDenoiser
from ..sampling.flow import FlowSchedule
from .base import Family, ScheduledConditioning

# latent -> RGB of SD3's VAE for the cheap preview: one row per latent channel (the coefficients ComfyUI's SD3
# latent format uses)
CHEAP_RGB_SD3 = (
    (-0.0645, 0.0177, 0.1052), (0.0028, 0.0312, 0.0650), (0.1848, 0.0762, 0.0360), (0.0944, 0.0360, 0.0889),
    (0.0897, 0.0506, -0.0364), (-0.0020, 0.1203, 0.0284), (0.0855, 0.0118, 0.0283), (-0.0539, 0.0658, 0.1047),
    (-0.0057, 0.0116, 0.0700), (-0.0412, 0.0281, -0.0039), (0.1106, 0.1171, 0.1220), (-0.0248, 0.0682, -0.0481),
    (0.0815, 0.0846, 0.1207), (-0.0120, -0.0055, -0.0867), (-0.0749, -0.0634, -0.0456), (-0.1418, -0.1457, -0.1259),
)
T5_TOKENS = 256           # the T5 row of SD3 (diffusers' max_sequence_length default)
NO_T5_WARNING = ("this model runs without T5 (no text_encoder_3): its part of the conditioning is zeros, as "
                 "diffusers gives; prompts follow less closely than with T5")
_BREAK = re.compile(r"\bBREAK\b")


class SD3Family(Family):
    """SD3/SD3.5: CLIP-L + bigG + T5 as joint context and pooled projections; flow matching on 16 channels."""

    name = "sd3"
    preview_rgb = CHEAP_RGB_SD3
    t5_tokens = T5_TOKENS    # the T5 row's length (padding included)

    @classmethod
    def takes(cls, spec) -> bool:
        return spec.transformer is not None and spec.family in SD3_FAMILIES

    @property
    def prediction_type(self) -> str:
        return "flow"

    @property
    def inpainting(self) -> bool:
        return False

    def noise_schedule(self, scheduler_config: dict):
        return FlowSchedule.from_config(scheduler_config)

    def denoiser(self, model, schedule, dtype: torch.dtype | None):
        return FlowDenoiser(model, schedule, dtype=dtype)

    def check_request(self, r) -> None:
        blocks = self.spec.transformer.num_layers
        if r.slg_layers and r.cfg_scale <= 1.0:
            raise RequestError("skip-layer guidance works beside classifier-free guidance: give a cfg scale above 1")
        outside = [i for i in r.slg_layers if i >= blocks]
        if outside:
            raise RequestError(f"skip-layer guidance layers {outside} are not blocks of this transformer (0.."
                               f"{blocks - 1})")
        if r.controls:
            raise RequestError("ControlNet for SD3 is a model kind of its own (SD3ControlNetModel) that sdlite does "
                               "not run yet; the SD 1.x/SDXL ControlNets cannot steer an SD3 transformer")

    def info_lines(self) -> list[str]:
        lines = [f"defaults:    {self.sampling_defaults['steps']} steps, cfg {self.sampling_defaults['cfg']}, "
                 f"{self.sampling_defaults['sampler']} (flow matching)"]
        if self.spec.text3 is None:
            lines.append("T5:          not loaded (its conditioning is zeros)")
        return lines

    @property
    def sampling_defaults(self) -> dict:
        """The settings a command line leaves unset get for this model: the published ones (diffusers'
        StableDiffusion3Pipeline: 28 steps, cfg 7; the SD3.5 model cards: Large 28 steps at 3.5, Medium 40 at
        4.5; Large Turbo 4 steps without guidance), with FlowMatch Euler."""
        if self.spec.turbo:   # SD3.5 Large Turbo's model card: 4 steps, guidance 0 (diffusers' off: cfg 1 here)
            return {"steps": 4, "cfg": 1.0, "sampler": "euler", "timestep_spacing": None}
        steps, cfg = {"sd3.5-large": (28, 3.5), "sd3.5-medium": (40, 4.5)}.get(self.spec.family, (28, 7.0))
        return {"steps": steps, "cfg": cfg, "sampler": "euler", "timestep_spacing": None}

    def text_encoder_note(self, name: str) -> str:
        if name == "text_encoder_3":
            return ", last hidden state over 256 tokens"
        return ", penultimate layer, pooled output projected"

    # -- conditioning ------------------------------------------------------------------------------------------------

    def encode_texts(self, model, texts: list[str], clip_skip: int, embeddings,
                     warnings: list[str] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each text's (1, 77 + 256, 4096) joint context and (1, 2048) pooled embedding."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for SD3 are not supported; remove embeddings_dir / "
                               "--embeddings for this model")
        notes: list[str] = []
        texts_in = []
        for t in texts:
            if _BREAK.search(t):
                _note(notes, "BREAK has no meaning for SD3's text encoders (CLIP reads one chunk, T5 one row): "
                             "ignored")
                t = _BREAK.sub(",", t)
            texts_in.append(t)
        spec = self.spec
        width = spec.transformer.joint_attention_dim
        clip_parts, pooled_parts = [], []
        for name in ("text_encoder", "text_encoder_2"):
            cfg = spec.text if name == "text_encoder" else spec.text2
            if clip_skip + 1 > cfg.layers:
                raise RequestError(f"clip skip {clip_skip} is not valid for this model: SD3 reads the layer before "
                                   f"the one clip skip names, and its {name} has {cfg.layers} layers, so "
                                   f"1..{cfg.layers - 1} are valid")
            chunk_lists = []
            for t in texts_in:
                chunks, count = chunk_prompt(model.tokenizers[name], t, None)
                if len(chunks) > 1:
                    _note(notes, f"CLIP reads the first {CHUNK_LENGTH} tokens of a prompt for SD3, as diffusers "
                                 f"does; the rest ({count - CHUNK_LENGTH} tokens) reaches the model through T5 only")
                chunk_lists.append(chunks[:1])
            with torch.no_grad(), model.models.use(name) as encoder:
                hidden, pooled = encode_chunks(encoder, chunk_lists, clip_skip, model.device, sdxl=True, pooled=True)
            clip_parts.append(hidden)
            pooled_parts.append(pooled)
        t5 = self._t5(model, texts_in, notes)
        contexts, pooled = [], []
        for i in range(len(texts_in)):
            clip = torch.cat([part[i] for part in clip_parts], dim=-1)                      # (1, 77, 2048)
            clip = torch.nn.functional.pad(clip, (0, width - clip.shape[-1]))                # (1, 77, 4096)
            contexts.append(torch.cat([clip, t5[i].to(clip)], dim=1))                        # (1, 77 + 256, 4096)
            pooled.append(torch.cat([part[i] for part in pooled_parts], dim=-1))             # (1, 2048)
        if warnings is not None:
            warnings += [n for n in notes if n not in warnings]
        return contexts, pooled

    def _t5(self, model, texts: list[str], notes: list[str]) -> list[torch.Tensor]:
        """Each text's (1, t5_tokens, 4096) T5 encoding, its tokens weighted by the prompt's emphasis; zeros without
        T5."""
        width = self.spec.transformer.joint_attention_dim
        length = self.t5_tokens
        if self.spec.text3 is None:
            _note(notes, NO_T5_WARNING)
            return [torch.zeros(1, length, width, device=model.device) for _ in texts]
        tokenizer = model.tokenizers["text_encoder_3"]
        rows, weights = [], []
        for t in texts:
            ids, w, cut = tokenizer.encode_weighted(parse_attention(t), max_length=length)
            if cut:
                _note(notes, f"T5 reads {length} tokens for {self.spec.family}: the prompt's last {cut} tokens were "
                             "cut")
            rows.append(ids)
            weights.append(w)
        with torch.no_grad(), model.models.use("text_encoder_3") as encoder:
            ids = torch.tensor(rows, dtype=torch.long, device=model.device)
            hidden = encoder(ids).float()                                                     # (P, 256, 4096)
        out = []
        for i, w in enumerate(weights):
            h = hidden[i:i + 1]
            if any(x != 1.0 for x in w):   # A1111's "Original" emphasis: weight each token, restore the mean
                before = h.mean()
                h = h * torch.tensor(w, dtype=h.dtype, device=h.device)[None, :, None]
                h = h * (before / h.mean())
            out.append(h)
        return out

    def scheduled(self, model, r, use_cfg, schedules, texts, contexts, pooled, warnings) -> ScheduledConditioning:
        return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                     warnings, pooled=dict(zip(texts, pooled)), pooled_key="pooled_projections")


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


