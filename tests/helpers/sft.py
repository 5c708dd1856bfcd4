"""Small real tokenizers (byte-level BPE trained here) with Llama-3-style and ChatML chat templates, chat data of
varied lengths, and a tiny Llama that takes a tokenizer's vocabulary: fine-tuning inputs made without a download."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_SPECIALS = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "extra": ["<|start_header_id|>", "<|end_header_id|>"]}
CHATML_SPECIALS = {"bos": None, "eos": "<|im_end|>", "extra": ["<|im_start|>", "<|endoftext|>"]}

WORDS = ("alpha beta gamma delta river stone cloud paper orange seven eleven north south quiet loud bright dark"
         " small large window garden table music").split()


def sentence(rng: random.Random, low: int = 2, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def chat_rows(n: int, seed: int = 0, turns: tuple[int, int] = (1, 3), low: int = 2, high: int = 12) -> list[dict[str, Any]]:
    """Conversations of varied lengths: an optional system turn, then 1-3 user/assistant pairs."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng, 2, 5)}] if rng.random() < 0.4 else []
        for _t in range(rng.randint(*turns)):
            messages += [{"role": "user", "content": sentence(rng, low, high)},
                         {"role": "assistant", "content": sentence(rng, low, high)}]
        rows.append({"messages": messages})
    return rows


def make_tokenizer(style: str = "chatml", vocab_size: int = 300, pad: bool = True) -> Any:
    """A byte-level BPE tokenizer trained on the test vocabulary, with the ``style``'s specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lightning_fsdp.data.sft.demo import CHATML_TEMPLATE

    specials = LLAMA3_SPECIALS if style == "llama3" else CHATML_SPECIALS
    names = [t for t in (specials["bos"], specials["eos"], *specials["extra"]) if t] + (["<|pad|>"] if pad else [])
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    texts = [sentence(rng) for _ in range(300)] + ["system user assistant\n"] * 50
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=names, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=specials["bos"], eos_token=specials["eos"],
                                        pad_token="<|pad|>" if pad else None)
    tokenizer.chat_template = LLAMA3_TEMPLATE if style == "llama3" else CHATML_TEMPLATE
    return tokenizer


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_chat_llama(path: Path, tokenizer: Any, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Llama whose vocabulary is the tokenizer's, saved with it (a model directory as downloaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import TINY_LLAMA

    settings = {**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 128, **overrides}
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(path, max_shard_size="64KB")
    tokenizer.save_pretrained(path)
    return path
