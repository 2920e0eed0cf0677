"""A request's add-ons: the LoRAs its prompt's ``<lora:name:weight>`` tags (and ``Request.loras``) name, merged into
the networks for the run and undone after, and the textual-inversion embeddings of ``Request.embeddings_dir``;
A1111's ``Lora hashes`` and ``TI hashes`` parameters for what was used."""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..adapters import lora
from ..adapters.embeddings import EmbeddingDB, EmbeddingError, rewrite_tags_without_db
from ..errors import RequestError
from ..prompts import extract_networks
from .request import Request


@dataclass
class PromptNetworks:
    """A request's add-ons, resolved: the prompts without network tags, the LoRAs to apply ((path, weight); a weight
    may be a mapping of networks to weights),
    the embeddings, and warnings about tags that were ignored."""

    prompt: str
    negative: str
    loras: list[tuple[str, float | dict[str, float]]]
    embeddings: EmbeddingDB | None
    warnings: list[str]
    lora_names: list[str] = field(default_factory=list)   # as the "Lora hashes" parameter names them

    def applied(self, engine):
        """A context in which the LoRAs are merged into the engine's networks (restored on exit)."""
        if not self.loras:
            return contextlib.nullcontext()
        return lora.engine_with_loras(engine, self.loras)

    def infotext(self) -> dict:
        """A1111's "Lora hashes" and "TI hashes" parameters for what this request used."""
        out = {}
        if self.loras:
            out["Lora hashes"] = lora.lora_hashes_infotext(zip(self.lora_names, (p for p, _ in self.loras)))
        if self.embeddings is not None:
            used = [e for e in self.embeddings.embeddings.values()
                    if any(_mentions(text, e.name) for text in (self.prompt, self.negative))]
            if used:
                out["TI hashes"] = ", ".join(f"{e.name}: {e.hash}" for e in used)
        return out


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text) is not None


def prompt_networks(engine, r: Request) -> "PromptNetworks":
    """The request's add-ons: ``<lora:name:w>`` tags (removed from the text, as A1111 does) and
    ``r.loras``, and the embeddings of ``r.embeddings_dir`` (``<embedding:name>`` rewritten to the name)."""
    warnings = []
    try:
        db = embedding_db(engine, r.embeddings_dir)
        rewrite = db.rewrite_tags if db is not None else rewrite_tags_without_db
        prompt, tags = extract_networks(rewrite(r.prompt))
        negative, negative_tags = extract_networks(rewrite(r.negative_prompt))
        # a tag at either end leaves a space there: nothing to CLIP's tokenizer, but a token of its own to T5's
        # (SD3, FLUX), so a prompt with a tag at its end would not give the image of the prompt without it
        prompt = prompt.strip() if tags else prompt
        negative = negative.strip() if negative_tags else negative
    except EmbeddingError as e:
        raise RequestError(str(e)) from None
    loras = [(path, _weight(path, weight)) for path, weight in r.loras]
    names = [Path(path).stem for path, _ in r.loras]
    for tag in tags:
        if tag.kind == "lora":
            loras.append((lora.find_lora(tag.name, r.lora_dir), tag.weight))
            names.append(tag.name)   # A1111 records a tag's LoRA by the name the prompt gives
        else:
            warnings.append(f"<{tag.kind}:{tag.name}> in the prompt is not supported and was ignored "
                            "(supported: <lora:NAME:WEIGHT>, <embedding:NAME>)")
    if negative_tags:
        warnings.append("network tags in the negative prompt are ignored (as A1111 does): "
                        + ", ".join(f"<{t.kind}:{t.name}>" for t in negative_tags))
    if loras:
        engine.family.check_loras([path for path, _ in loras])
    return PromptNetworks(prompt, negative, loras, db, warnings, names)


WEIGHT_PARTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


def _weight(path, weight) -> float | dict[str, float]:
    """A ``Request.loras`` weight: one number for every network, or a mapping of networks to numbers, e.g.
    ``{"unet": 1.0, "text_encoder": 0.5}`` (ComfyUI's strength_model / strength_clip; ``unet`` stands for a
    transformer too, ``text_encoder`` for the second and third text encoders unless they are named; a network not
    named gets 1.0)."""
    if not isinstance(weight, Mapping):
        return float(weight)
    unknown = [k for k in weight if k not in WEIGHT_PARTS]
    if unknown:
        raise RequestError(f"LoRA {Path(path).name}: weight for {unknown[0]!r}: expected networks among "
                           f"{', '.join(WEIGHT_PARTS)}")
    return {k: float(v) for k, v in weight.items()}


def embedding_db(engine, folder) -> EmbeddingDB | None:
    if folder is None:
        return None
    key = os.path.realpath(folder)
    cache = engine.__dict__.setdefault("_embedding_dbs", {})
    if key not in cache:
        cache[key] = EmbeddingDB.from_dir(folder, engine.tokenizer, engine.spec.context_text.width)
    return cache[key]
