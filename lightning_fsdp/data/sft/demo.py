"""A chat data set and a subword tokenizer made on the spot, so the fine-tuning demo runs with nothing downloaded.

Three small tasks a tiny model can visibly learn in minutes on a CPU: reversing a list of words, naming its last
word, and counting its words, asked in varied phrasings, some after a system prompt and some in two turns. The
tokenizer is a real byte-level BPE trained on the data (``tokenizers``) with a ChatML chat template, saved as a
Hugging Face tokenizer directory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Union

from lightning_fsdp.cache import build_once

__all__ = ["CHATML_TEMPLATE", "chat_demo_rows", "train_tokenizer", "write_chat_demo", "write_directory_once"]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_WORDS = ["red", "blue", "green", "cat", "dog", "fish", "apple", "pear", "plum", "sun", "moon", "star", "tree",
          "rock", "bird", "lamp", "door", "book", "milk", "salt"]
_REVERSE = ["Reverse the list: {}", "Write this list backwards: {}", "Give me these words in reverse order: {}"]
_LAST = ["What is the last word of: {}?", "Name the final item in: {}"]
_COUNT = ["How many words are in: {}?", "Count the items: {}"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven"]
_SYSTEM = "You are a careful assistant. Answer with the result only."


def _task(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_WORDS, rng.randint(3, 5))
    listed = ", ".join(words)
    kind = rng.randrange(3)
    if kind == 0:
        return rng.choice(_REVERSE).format(listed), ", ".join(reversed(words))
    if kind == 1:
        return rng.choice(_LAST).format(listed), words[-1]
    return rng.choice(_COUNT).format(listed), _NUMBERS[len(words)]


def chat_demo_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations (``messages``), deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.3 else []
        for _turn in range(1 if rng.random() < 0.8 else 2):
            question, answer = _task(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def train_tokenizer(texts: list[str], vocab_size: int = 512, chat_template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``: EOS ``<|im_end|>``, pad ``<|pad|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                                        bos_token=None, unk_token=None)
    tokenizer.chat_template = chat_template
    return tokenizer


def write_directory_once(root: Path, done: str, fill: Callable[[Path], None]) -> Path:
    """``root`` as ``fill(staging)`` writes it, unless ``root/done`` exists already (:func:`~lightning_fsdp.cache.build_once`:
    written to a hidden sibling and renamed into place, so a half-written set never looks complete)."""
    return build_once(root, fill, complete=done)


def write_chat_demo(root: Union[str, Path], train: int = 4000, val: int = 200, seed: int = 0) -> Path:
    """``root/train.jsonl``, ``root/val.jsonl`` and ``root/tokenizer/``, written once. Returns ``root``."""

    def fill(tmp: Path) -> None:
        splits = {"train": chat_demo_rows(train, seed), "val": chat_demo_rows(val, seed + 1)}
        for name, rows in splits.items():
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        texts = [m["content"] for r in splits["train"] for m in r["messages"]] + ["user\n", "assistant\n", "system\n"] * 100
        train_tokenizer(texts).save_pretrained(str(tmp / "tokenizer"))

    return write_directory_once(Path(root), "tokenizer/tokenizer.json", fill)
