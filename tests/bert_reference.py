"""Test helpers for the Chinese (Taiyi) path: a generated WordPiece vocabulary, generated prompts, and the
reference models (transformers' BertTokenizer / BertModel, diffusers' StableDiffusionPipeline with a BERT text
encoder) built from configs with random weights. Nothing here downloads anything."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from sdlite.config import BertTextConfig

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# characters frequent in Chinese prompts (colours, shapes, scenes, styles, grammar words)
COMMON_ZH = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产"
             "种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业"
             "本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利"
             "比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文"
             "总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干"
             "做必战先回则任取据处队南给色光门即保治北造百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共"
             "权收证改清己美再采转更单风切打白教速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张"
             "红橙黄绿蓝紫黑圆形正方三角星背景上画图片猫狗马宇航员油画水彩插画古代城市未来森林鸟语香江河湖梦长城清晨")
FULLWIDTH_PUNCT = "，。！？、；：“”‘’（）《》【】…—～·「」『』〔〕"
ENGLISH_WORDS = ("a an the of on in with and red blue green yellow orange purple white black circle square "
                 "triangle star background picture painting oil watercolor cat dog horse astronaut riding city "
                 "future forest bird flower river lake dream great wall morning style van gogh portrait photo "
                 "high quality detailed beautiful landscape mountain sky sun moon night light dark small big "
                 "ancient town chinese art illustration anime girl boy man woman tree house street car "
                 "play run jump walk sing read write open close hello world test token piece").split()
SUFFIXES = ["##s", "##es", "##ed", "##ing", "##er", "##est", "##ly", "##y", "##tion", "##ful", "##ness", "##al"]
EMOJI_IN_VOCAB = ["🐱", "🌸"]
EMOJI = ["🐱", "🌸", "👍", "👍🏽", "❤️", "👨‍👩‍👧", "🎨", "😀", "🇨🇳"]


def build_vocab(seed: int = 0) -> list[str]:
    """A BERT-style vocabulary: special tokens, digits and ASCII, full-width punctuation, common Chinese
    characters plus a random sample of the CJK block, English words, their ## suffixes and random ## pieces."""
    rng = random.Random(seed)
    vocab = list(SPECIALS)
    ascii_chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab += ascii_chars + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab += list(FULLWIDTH_PUNCT)
    vocab += list(dict.fromkeys(COMMON_ZH))
    sample = rng.sample(range(0x4E00, 0x9FA6), 1500)
    vocab += [chr(c) for c in sample]
    vocab += ["##" + chr(c) for c in sample[:100]]                 # continuation pieces of CJK (never reached)
    vocab += ENGLISH_WORDS + SUFFIXES + EMOJI_IN_VOCAB
    vocab += ["2024", "100", "##00", "##24", "3d", "4k", "hd"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    for _ in range(400):
        piece = "".join(rng.choice(letters) for _ in range(rng.randint(2, 5)))
        vocab.append(piece if rng.random() < 0.5 else "##" + piece)
    return list(dict.fromkeys(vocab))


def write_vocab(folder: Path, vocab: list[str], max_length: int = 512) -> Path:
    """``vocab.txt`` and a Taiyi-like ``tokenizer_config.json`` in ``folder``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "do_lower_case": True, "model_max_length": max_length, "tokenize_chinese_chars": True,
        "strip_accents": None, "tokenizer_class": "BertTokenizer", "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}), encoding="utf-8")
    return folder


def hf_tokenizer(folder: Path, max_length: int = 512):
    from transformers import BertTokenizer

    return BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True, model_max_length=max_length)


def _zh(rng, n, vocab_chars):
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.85:
            out.append(rng.choice(vocab_chars))
        elif r < 0.95:
            out.append(chr(rng.randint(0x4E00, 0x9FA5)))         # often not in the vocabulary: [UNK]
        else:
            out.append(chr(rng.choice([rng.randint(0x3400, 0x4DBF), rng.randint(0x20000, 0x2A6DF),
                                       rng.randint(0xF900, 0xFAFF), rng.randint(0x3040, 0x30FF),
                                       rng.randint(0xAC00, 0xD7A3)])))  # ext. A/B, compatibility, kana, hangul
    return "".join(out)


def _en(rng, n):
    words = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            w = rng.choice(ENGLISH_WORDS) + (rng.choice(["", "", "s", "ing", "ed", "ly", "ness"]))
        elif r < 0.8:
            w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 12)))
        elif r < 0.9:
            w = rng.choice(["Café", "naïve", "Ünïcödé", "ÀÉÎÕÜ", "ΣΟΦΟΣ", "straße", "İstanbul", "Ｈｅｌｌｏ"])
        else:
            w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(101, 110)))   # too long: [UNK]
        if rng.random() < 0.3:
            w = w.capitalize() if rng.random() < 0.5 else w.upper()
        words.append(w)
    return " ".join(words)


def _seps(rng):
    return rng.choice([" ", "", ", ", "，", "。", "、", " - ", "\t", "\n", "\u3000", "\xa0", "! ", "?", "；", "……",
                       "（", "）", "《", "》", "【", "】", "“", "”", "(", ")", "[", "]", "/", ":", "~", "\u200b"])


def generate_prompts(n: int, vocab: list[str], seed: int = 0) -> list[str]:
    """``n`` prompts in eight kinds: Chinese, English, mixed, full-width punctuation, digits, emoji, white space
    and control characters, over-long (more than 512 tokens); a few hold special tokens as written."""
    rng = random.Random(seed)
    zh_chars = [t for t in vocab if len(t) == 1 and 0x4E00 <= ord(t) <= 0x9FFF]
    prompts = []
    kinds = ["zh", "en", "mixed", "punct", "digits", "emoji", "space", "long"]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        parts = []
        if kind == "zh":
            for _ in range(rng.randint(1, 5)):
                parts += [_zh(rng, rng.randint(1, 12), zh_chars), _seps(rng)]
        elif kind == "en":
            for _ in range(rng.randint(1, 4)):
                parts += [_en(rng, rng.randint(1, 8)), _seps(rng)]
        elif kind == "mixed":
            for _ in range(rng.randint(2, 6)):
                parts += [_zh(rng, rng.randint(1, 6), zh_chars) if rng.random() < 0.5 else _en(rng, rng.randint(1, 3)),
                          _seps(rng)]
        elif kind == "punct":
            for _ in range(rng.randint(2, 8)):
                parts += [_zh(rng, rng.randint(0, 4), zh_chars), rng.choice(FULLWIDTH_PUNCT + "!?.,;:'\"-()&%$#@*+=<>|\\^`{}")
                          * rng.randint(1, 3)]
        elif kind == "digits":
            for _ in range(rng.randint(1, 5)):
                parts += [rng.choice([str(rng.randint(0, 10**rng.randint(1, 8))), "２０２４", "3.14", "1,000", "4K",
                                      "100%", "½", "①", "Ⅻ", "٣"]), _zh(rng, rng.randint(0, 3), zh_chars),
                          rng.choice(["年", "月", "日", "个", " ", "px", "号"])]
        elif kind == "emoji":
            for _ in range(rng.randint(1, 5)):
                parts += [rng.choice(EMOJI), _zh(rng, rng.randint(0, 4), zh_chars), _en(rng, rng.randint(0, 2))]
        elif kind == "space":
            for _ in range(rng.randint(1, 5)):
                parts += [_zh(rng, rng.randint(0, 4), zh_chars), rng.choice(["\x07", "\x00", "\ufffd", "\u200d", "\r\n",
                                                                             "\x0b", "\x0c", "\x85", "\u2028", "  ",
                                                                             "\u00ad", "\ufeff", "\u3000"])]
            if rng.random() < 0.3:
                parts.append(rng.choice(["[MASK]", "[SEP]", "[UNK] x", "[cls]", "[PAD]"]))
        else:  # over-long: more than 510 tokens
            parts += [_zh(rng, rng.randint(300, 500), zh_chars), "，", _en(rng, rng.randint(150, 300))]
        prompts.append("".join(parts))
    return prompts


# --- reference models ------------------------------------------------------------------------------------------


def transformers_bert(cfg: BertTextConfig):
    from transformers import BertConfig, BertModel

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    return BertModel(BertConfig(**d, attn_implementation="eager")).eval()


def bert_state(ref) -> dict[str, torch.Tensor]:
    """A transformers BertModel's state without what our module does not hold (pooler, index buffers)."""
    return {k: v for k, v in ref.state_dict().items()
            if not k.startswith("pooler.") and k not in ("embeddings.position_ids", "embeddings.token_type_ids")}
