"""A Hugging Face tokenizer as GGUF's vocabulary: what :mod:`.gguf_export` writes after the hyperparameters.

llama.cpp knows two BPE models: ``gpt2`` (byte-level) and ``llama`` (SentencePiece-style with byte fallback). A
byte-level tokenizer must also split text the way one of llama.cpp's named pre-tokenizers does
(:data:`PRE_TOKENIZERS`); a tokenizer these cannot express is refused with a
:class:`~lightning_fsdp.hf.gguf.GGUFError` before anything is written.
"""

from __future__ import annotations

import json
import re
import tempfile
from typing import Any, Optional

from gguf import GGUFWriter, TokenType
from gguf.vocab import SpecialVocab

from lightning_fsdp.hf.gguf import GGUFError

__all__ = ["PRE_TOKENIZERS", "write_vocab"]

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}", 1)
#: a byte-level tokenizer's pre-tokenizer (see :func:`_pre_signature`) → llama.cpp's name for the same splitting
PRE_TOKENIZERS: dict[tuple[tuple[Any, ...], ...], str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3_SPLIT, "Isolated", False), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT, "Isolated", False), ("ByteLevel", False)): "qwen2",
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def write_vocab(writer: GGUFWriter, tokenizer: Any, n_vocab: int) -> None:
    """The tokenizer as llama.cpp's ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece-style BPE with byte
    fallback) model: tokens, types, merges, special ids, whether BOS/EOS are added, and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFError(f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; GGUF needs its "
                        "tokenizer.json.")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise GGUFError(f"A {model.get('type')} tokenizer cannot be expressed in GGUF for llama.cpp (BPE only).")
    spm = bool(model.get("byte_fallback"))
    if not spm:
        pre = PRE_TOKENIZERS.get(_pre_signature(spec.get("pre_tokenizer")))
        # NFC (Qwen2's) is let through: llama.cpp does not normalize, and text already in NFC splits the same
        decoder = (spec.get("decoder") or {}).get("type")
        if pre is None or spec.get("normalizer") not in (None, {"type": "NFC"}) or decoder != "ByteLevel":
            raise GGUFError("This byte-level BPE tokenizer splits text in a way llama.cpp has no name for (its "
                            f"pre-tokenizer: {json.dumps(spec.get('pre_tokenizer'))}); known: the splits of "
                            f"{', '.join(PRE_TOKENIZERS.values())}.")
    vocab = tokenizer.get_vocab()
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) > n_vocab:
        raise GGUFError(f"The tokenizer's {len(vocab)} ids are not 0..{len(vocab) - 1} within the model's "
                        f"vocab_size {n_vocab}; GGUF lists tokens by id.")
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = tokenizer.added_tokens_decoder
    types = [_token_type(i, tok, added, tokenizer.unk_token_id, spm) for i, tok in enumerate(tokens)]
    pads = [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]  # embedding rows the tokenizer never produces
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    writer.add_tokenizer_pre("default" if spm else str(pre))
    writer.add_token_list(tokens + pads)
    writer.add_token_types([int(t) for t in types] + [int(TokenType.UNUSED)] * len(pads))
    if spm:
        pairs = [m if isinstance(m, list) else m.split(" ", 1) for m in model.get("merges") or []]
        rank = {a + b: i for i, (a, b) in enumerate(pairs)}  # llama.cpp merges the best-scored pair first
        writer.add_token_scores([-float(rank[t]) if t in rank else 0.0 for t in tokens] + [-1e9] * len(pads))
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    with tempfile.TemporaryDirectory() as saved:  # gguf's own reader of merges, chat templates and special tokens
        tokenizer.save_pretrained(saved)
        special = SpecialVocab(saved, load_merges=True, n_vocab=n_vocab)
    special.special_token_ids = {typ: int(i) for typ in ("bos", "eos", "unk", "pad")
                                 if (i := getattr(tokenizer, f"{typ}_token_id", None)) is not None}
    special.add_special_token = _added_specials(tokenizer)
    if tokenizer.chat_template is not None:
        special.chat_template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else [
            {"name": k, "template": v} for k, v in tokenizer.chat_template.items()]
    special.add_to_gguf(writer, quiet=True)


def _pre_signature(node: Optional[dict[str, Any]]) -> tuple[tuple[Any, ...], ...]:
    """A pre-tokenizer's steps, with what decides how it splits: a key of :data:`PRE_TOKENIZERS`."""
    if not node:
        return ()
    kind = node.get("type")
    if kind == "Sequence":
        return tuple(step for child in node.get("pretokenizers", []) for step in _pre_signature(child))
    if kind == "ByteLevel" and not node.get("add_prefix_space"):
        return (("ByteLevel", node.get("use_regex", True)),)
    if kind == "Split":
        pattern = node.get("pattern", {})
        return (("Split", pattern.get("Regex", re.escape(pattern.get("String", ""))), node.get("behavior"),
                 node.get("invert", False)),)
    if kind == "Digits":
        return (("Digits", node.get("individual_digits", False)),)
    return ((json.dumps(node, sort_keys=True),),)


def _token_type(i: int, token: str, added: dict[int, Any], unk: Optional[int], spm: bool) -> TokenType:
    if spm and i == unk:
        return TokenType.UNKNOWN
    if i in added:
        return TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED
    if spm and _BYTE_TOKEN.fullmatch(token):
        return TokenType.BYTE
    return TokenType.NORMAL


def _adds_space_prefix(spec: dict[str, Any]) -> bool:
    """SentencePiece-style tokenizers mark the start of a text as a word start (``▁``), by normalizer or Metaspace."""
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)


def _added_specials(tokenizer: Any) -> dict[str, bool]:
    """Whether encoding adds BOS / EOS, as measured on the tokenizer itself (its config may not say)."""
    ids = list(tokenizer("a")["input_ids"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {"bos": bos is not None and ids[:1] == [bos], "eos": eos is not None and ids[-1:] == [eos]}
