"""Prompts to UNet conditioning the way the AUTOMATIC1111 web UI builds it (its ``sd_hijack_clip.py``).

* **Emphasis** (:func:`sdlite.prompts.parse_attention`): each parsed piece is tokenized on its own, and every
  token carries its piece's weight.
* **Chunks of 75 tokens**, each framed as start + 75 + end token and encoded separately; the encodings are
  concatenated along the token axis (77 k tokens for k chunks). When a chunk fills up within 20 tokens after a
  comma, the tokens after that comma move to the next chunk. ``BREAK`` ends a chunk. A prompt of at most 75
  tokens is one chunk: the same 77 tokens as before (start, the tokens, the end token, then padding: the end token
  for SD 1.x, the pad token after the first end token for SD 2.x, as A1111 and diffusers both give).
* **Weights**, A1111's "Original" emphasis: each token's hidden state is multiplied by its weight, then the
  chunk's encoding is rescaled so that its mean is what it was before weighting. A1111 takes that mean over all
  prompts of a batch at once; here each prompt's chunk is rescaled on its own, which is the same for the batches
  sdlite makes (copies of one prompt).
* **Textual-inversion embeddings** (:mod:`sdlite.adapters.embeddings`): where an embedding's name occurs, its vectors
  replace those tokens; an embedding that would straddle a chunk boundary starts the next chunk.
* **Prompt and negative prompt of different lengths**: the shorter one is padded with encodings of the empty
  prompt, one 77-token chunk at a time, as A1111 does (diffusers cannot take such prompts at all).

**WordPiece tokenizers (BERT text encoders: Taiyi)** get :func:`single_row` instead of the chunks: A1111's chunking
is made for CLIP's 77 positions, while a BERT encoder reads one row of its full length (512 for Taiyi), as diffusers
feeds it. A plain prompt gives exactly diffusers' ids: ``[CLS]``, the tokens, ``[SEP]``, ``[PAD]`` up to the
length. Emphasis is parsed and applied the same "Original" way (each token's hidden state times its weight, the
row's mean restored); ``BREAK`` has no meaning there and is ignored with a warning; a prompt longer than the row is
cut (the end token kept) with a warning naming what was cut.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .prompts import parse_attention

CHUNK_LENGTH = 75        # tokens between the start and end token of a chunk
COMMA_BACKTRACK = 20     # A1111's comma_padding_backtrack default


@dataclass
class Chunk:
    """One 77-token text-encoder input: ``tokens`` and ``multipliers`` (77 each, start and end included) and
    ``fixes``, (position in ``tokens``, embedding) pairs whose vectors replace those tokens' embeddings, and
    ``length``, how many of the 75 are the prompt's (the rest is padding)."""

    tokens: list[int] = field(default_factory=list)
    multipliers: list[float] = field(default_factory=list)
    fixes: list[tuple[int, object]] = field(default_factory=list)
    length: int = 0


def _finish(chunk: Chunk, tokenizer) -> Chunk:
    """Pad the body to 75 tokens and frame it: start + body + end, then (SD 2.x) the pad id after the first end
    token, as A1111 rewrites it before encoding."""
    body = chunk.tokens + [tokenizer.eos_token_id] * (CHUNK_LENGTH - len(chunk.tokens))
    tokens = [tokenizer.bos_token_id, *body, tokenizer.eos_token_id]
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        end = tokens.index(tokenizer.eos_token_id)
        tokens[end + 1:] = [tokenizer.pad_token_id] * (len(tokens) - end - 1)
    multipliers = [1.0, *chunk.multipliers, *[1.0] * (CHUNK_LENGTH - len(chunk.tokens)), 1.0]
    return Chunk(tokens, multipliers, [(pos + 1, emb) for pos, emb in chunk.fixes], len(chunk.tokens))


def chunk_prompt(tokenizer, text: str, embeddings=None) -> tuple[list[Chunk], int]:
    """``(chunks, token_count)`` of one prompt (network tags already removed), by A1111's ``tokenize_line``
    rules; the count is of prompt tokens, the last chunk's padding excluded."""
    pairs = parse_attention(text)
    comma = tokenizer.encoder.get(",</w>")
    chunks: list[Chunk] = []
    chunk = Chunk()
    token_count = 0
    last_comma = -1

    def next_chunk(is_last: bool = False) -> None:
        nonlocal chunk, token_count, last_comma
        token_count += len(chunk.tokens) if is_last else CHUNK_LENGTH
        chunks.append(_finish(chunk, tokenizer))
        chunk, last_comma = Chunk(), -1

    for piece, weight in pairs:
        if piece == "BREAK" and weight == -1:
            next_chunk()
            continue
        tokens = tokenizer.encode(piece)
        position = 0
        while position < len(tokens):
            token = tokens[position]
            if token == comma:
                last_comma = len(chunk.tokens)
            elif (len(chunk.tokens) == CHUNK_LENGTH and last_comma != -1
                  and len(chunk.tokens) - last_comma <= COMMA_BACKTRACK):
                # the chunk is full and a comma is near its end: what follows the comma starts the next chunk
                cut = last_comma + 1
                moved = Chunk(chunk.tokens[cut:], chunk.multipliers[cut:],
                              [(p - cut, e) for p, e in chunk.fixes if p >= cut])
                chunk = Chunk(chunk.tokens[:cut], chunk.multipliers[:cut], [(p, e) for p, e in chunk.fixes if p < cut])
                next_chunk()
                chunk = moved
            if len(chunk.tokens) == CHUNK_LENGTH:
                next_chunk()
            found = embeddings.find_at(tokens, position) if embeddings is not None else None
            if found is None:
                chunk.tokens.append(token)
                chunk.multipliers.append(weight)
                position += 1
                continue
            embedding, name_length = found
            if len(chunk.tokens) + len(embedding) > CHUNK_LENGTH:
                next_chunk()
            chunk.fixes.append((len(chunk.tokens), embedding))
            chunk.tokens += [tokenizer.eos_token_id] * len(embedding)   # stand-ins; their embeddings are replaced
            chunk.multipliers += [weight] * len(embedding)
            position += name_length
    if chunk.tokens or not chunks:
        next_chunk(is_last=True)
    return chunks, token_count


def single_row(tokenizer, text: str) -> tuple[list[Chunk], int, list[str]]:
    """``([chunk], token_count, warnings)``: one prompt as one row of ``tokenizer.max_length`` tokens (start, the
    tokens, end, padding), each token carrying its emphasis weight; for tokenizers of text encoders that are not
    chunked (WordPiece / BERT). The count is of prompt tokens before any cut."""
    warnings: list[str] = []
    tokens: list[int] = []
    multipliers: list[float] = []
    for piece, weight in parse_attention(text):
        if piece == "BREAK" and weight == -1:
            if not any("BREAK" in w for w in warnings):
                warnings.append("BREAK starts a new 75-token chunk for CLIP text encoders; this model's text "
                                f"encoder reads one row of {tokenizer.max_length} tokens, so BREAK was ignored")
            continue
        ids = tokenizer.encode(piece)
        tokens += ids
        multipliers += [weight] * len(ids)
    capacity = tokenizer.max_length - 2
    if len(tokens) > capacity:
        plain = "".join(p for p, w in parse_attention(text) if not (p == "BREAK" and w == -1))
        dropped = tokenizer.tokenize_with_info(plain).dropped_text
        warnings.append(f"the prompt is {len(tokens)} tokens and this model reads {capacity}: the end was cut"
                        + (f" ({dropped[:80]!r}{'...' if len(dropped) > 80 else ''})" if dropped else ""))
    kept = min(len(tokens), capacity)
    row = tokenizer.frame(tokens)
    weights = [1.0, *multipliers[:kept], *[1.0] * (tokenizer.max_length - kept - 1)]
    return [Chunk(row, weights, [], kept)], len(tokens), warnings


def encode_chunks(text_encoder, chunk_lists: list[list[Chunk]], clip_skip: int = 1,
                  device: torch.device | str = "cpu", sdxl: bool = False, pooled: bool = False):
    """Encode several prompts' chunks in one text-encoder pass; returns, per prompt, its (1, 77 k, width)
    conditioning with the weights applied (A1111's "Original" emphasis, per chunk).

    ``sdxl``: SDXL's reading of a CLIP tower, the hidden state one layer before the one ``clip_skip`` names (the
    penultimate for ``clip_skip=1``), without the final LayerNorm. ``pooled``: also return, per prompt, the
    pooled text embedding (1, proj) of its first chunk (as A1111 takes it); the result is then
    ``(conditionings, pooled)``."""
    flat = [c for chunks in chunk_lists for c in chunks]
    ids = torch.tensor([c.tokens for c in flat], dtype=torch.long, device=device)
    replace = [(row, pos, emb.vectors) for row, c in enumerate(flat) for pos, emb in c.fixes]
    if sdxl or pooled:
        z = text_encoder.encode(ids, clip_skip + 1 if sdxl else clip_skip, final_norm=not sdxl, pooled=pooled,
                                replace=replace or None)
    else:
        z = text_encoder(ids, clip_skip=clip_skip, replace=replace or None)
    if pooled:
        z, pools = z
        starts = [sum(len(c) for c in chunk_lists[:i]) for i in range(len(chunk_lists))]
        return _weighted(z, chunk_lists), [pools[i:i + 1] for i in starts]
    return _weighted(z, chunk_lists)


def _weighted(z: torch.Tensor, chunk_lists: list[list[Chunk]]) -> list[torch.Tensor]:
    """Each prompt's rows of ``z`` (its chunks, concatenated along the tokens) with the emphasis applied."""
    out, row = [], 0
    for chunks in chunk_lists:
        parts = []
        for c in chunks:
            h = z[row:row + 1]
            if any(m != 1.0 for m in c.multipliers):
                mean = h.float().mean()
                h = h * torch.tensor(c.multipliers, dtype=h.dtype, device=h.device)[None, :, None]
                h = h * (mean / h.float().mean()).to(h.dtype)
            parts.append(h)
            row += 1
        out.append(torch.cat(parts, dim=1))
    return out


def pad_to_same_length(conds: list[torch.Tensor], empty: torch.Tensor) -> list[torch.Tensor]:
    """Conditionings of different token lengths (multiples of 77) made equal by appending the empty prompt's
    77-token encoding, as A1111 pads the shorter of a prompt and its negative."""
    longest = max(c.shape[1] for c in conds)
    out = []
    for c in conds:
        missing = (longest - c.shape[1]) // empty.shape[1]
        out.append(torch.cat([c, empty.expand(c.shape[0], -1, -1).repeat(1, missing, 1)], dim=1) if missing else c)
    return out
