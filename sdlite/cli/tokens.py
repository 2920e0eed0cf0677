"""``sdlite tokens PROMPT``: how a prompt is read, as JSON: parsed (text, weight) pieces, 75-token chunks with their
token ids, prompt edits per step, LoRA tags."""
from __future__ import annotations

from .options import resolve_model


def cmd_tokens(args) -> int:
    """``sdlite tokens PROMPT``: how sdlite reads a prompt, as JSON (parsed pieces, chunks, edit schedule)."""
    import json

    from ..conditioning import chunk_prompt, single_row
    from ..adapters.embeddings import EmbeddingDB, rewrite_tags_without_db
    from ..loader import open_model
    from ..prompts import describe, extract_networks, parse_attention

    model = resolve_model(args.model, args.prompt)
    ckpt = open_model(model)
    tokenizer = ckpt.tokenizer()
    db = EmbeddingDB.from_dir(args.embeddings, tokenizer, ckpt.spec.context_text.width) if args.embeddings else None
    text = db.rewrite_tags(args.prompt) if db is not None else rewrite_tags_without_db(args.prompt)
    info = describe(text, args.steps)
    stripped, _ = extract_networks(text)
    schedule = []
    for entry in info["schedule"]:
        if tokenizer.kind == "wordpiece":   # one row of the model's length (see sdlite.conditioning)
            chunks, count, _ = single_row(tokenizer, entry["text"])
        else:
            chunks, count = chunk_prompt(tokenizer, entry["text"], db)
        schedule.append({**entry, "parsed": [[t, w] for t, w in parse_attention(entry["text"])],
                         "token_count": count,
                         "chunks": [{"tokens": c.tokens, "text": tokenizer.decode(c.tokens),
                                     "prompt_tokens": c.length,
                                     "weights": c.multipliers,
                                     "embeddings": [{"position": p, "name": e.name, "vectors": len(e)}
                                                    for p, e in c.fixes]}
                                    for c in chunks]})
    out = {"prompt": args.prompt, "text": stripped, "networks": info["networks"], "parsed": info["parsed"],
           "schedule": schedule}
    print(json.dumps(out, indent=1 if args.pretty else None, ensure_ascii=False))
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("tokens", help="how a prompt is read, as JSON: parsed (text, weight) pieces, 75-token "
                                      "chunks with their token ids, prompt edits per step, LoRA tags")
    t.add_argument("prompt")
    t.add_argument("--model", "-m", default=None, help="whose tokenizer (default: the shipped demo model, demo-zh for "
                   "a prompt with Chinese characters)")
    t.add_argument("--steps", type=int, default=20, help="for the schedule of prompt edits")
    t.add_argument("--embeddings", metavar="DIR", default=None)
    t.add_argument("--pretty", action="store_true", help="indent the JSON")
    t.set_defaults(func=cmd_tokens)
