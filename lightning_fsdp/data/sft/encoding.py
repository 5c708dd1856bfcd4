"""One row → ``(input_ids, labels)`` with the model's own tokenizer, labels ``-100`` on every token not trained.

Chat rows are rendered by the tokenizer's chat template, and the trained spans are found from the template itself:
assistant turn ``i`` spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
``render(messages[:i + 1])``. The whole conversation is tokenized once, as ``apply_chat_template`` does, and a
token is trained when its characters overlap a trained span. No ``{% generation %}`` markers are needed. A template
that does not render a conversation's beginning as a prefix of the whole (e.g. one that rewrites earlier turns) is
refused with the reason, since no span can then be found honestly.

The first token of every sample is never a target, so packed samples never learn one another's last token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fsdp.data.sft.formats import needs_chat_template, row_messages
from lightning_fsdp.loss import IGNORE_INDEX

__all__ = ["Encoded", "RowEncoder", "Status"]


class Status:
    """What happened to a sample (stored beside it, counted once)."""

    KEPT, TRUNCATED, DROPPED_LONG, NOTHING_TO_TRAIN = 0, 1, 2, 3
    NAMES = {KEPT: "kept", TRUNCATED: "truncated", DROPPED_LONG: "dropped (too long)", NOTHING_TO_TRAIN: "dropped (nothing to train)"}


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    status: int = Status.KEPT


@dataclass
class RowEncoder:
    """Encodes rows of one format; picklable, so ``datasets.map`` can run it in worker processes."""

    tokenizer: Any
    fmt: str
    train_on: str = "assistant"
    chat_template: Optional[str] = None
    seq_len: Optional[int] = None
    long_samples: str = "truncate"

    def __post_init__(self) -> None:
        if needs_chat_template(self.fmt) and not (self.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError(
                f"format={self.fmt!r} is rendered through a chat template, but the tokenizer"
                f" ({type(self.tokenizer).__name__}) has none. Pass chat_template= (a Jinja string, e.g. the model"
                " family's template) to the data module, or use format='prompt_completion' / 'text'."
            )
        if self.fmt in ("text", "prompt_completion") and self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"format={self.fmt!r} appends the end-of-sequence token, but the tokenizer has no eos_token."
                " Set tokenizer.eos_token (save it with the tokenizer) before fine-tuning."
            )

    # -- one row ---------------------------------------------------------------------------------------------------
    def encode(self, row: Mapping[str, Any]) -> Encoded:
        if needs_chat_template(self.fmt):
            ids, labels = self.encode_messages(row_messages(row, self.fmt))
        elif self.fmt == "prompt_completion":
            prompt = self.tokenizer(str(row["prompt"]))["input_ids"]
            completion = self.tokenizer(str(row["completion"]), add_special_tokens=False)["input_ids"]
            completion = [*completion, self.tokenizer.eos_token_id]
            ids = [*prompt, *completion]
            labels = [IGNORE_INDEX] * len(prompt) + completion
        else:
            ids = [*self.tokenizer(str(row["text"]))["input_ids"], self.tokenizer.eos_token_id]
            labels = list(ids)
        return self._fit(ids, labels)

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.chat_template
        )
        return str(text)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The tokens a model is given to answer the conversation's next turn (generation prompt included)."""
        return list(self.tokenizer(self.render(messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"])

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[int]]:
        full = self.render(messages)
        encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        if self.train_on == "all":
            return ids, list(ids)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "last":
            turns = turns[-1:]
        spans = []
        for i in turns:
            head, upto = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            if not (full.startswith(head) and full.startswith(upto) and len(head) <= len(upto)):
                raise ValueError(
                    "The chat template does not render the beginning of a conversation as the beginning of the"
                    f" whole (assistant turn {i} of {len(messages)} messages), so its tokens cannot be found. Use"
                    " train_on='last' if only earlier turns are rewritten, or pass a chat_template= that renders"
                    " every turn as it is."
                )
            spans.append((len(head), len(upto)))
        labels = [
            token if any(end > begin and start < stop for begin, stop in spans) else IGNORE_INDEX
            for token, (start, end) in zip(ids, encoding["offset_mapping"])
        ]
        return ids, labels

    # -- length ------------------------------------------------------------------------------------------------------
    def _fit(self, ids: list[int], labels: list[int]) -> Encoded:
        status = Status.KEPT
        if self.seq_len is not None and len(ids) > self.seq_len:
            if self.long_samples == "drop":
                return Encoded([], [], Status.DROPPED_LONG)
            if self.long_samples == "error":
                raise ValueError(
                    f"A sample has {len(ids)} tokens, more than seq_len={self.seq_len}. Raise seq_len, or pass"
                    " long_samples='truncate' or 'drop'."
                )
            ids, labels, status = ids[: self.seq_len], labels[: self.seq_len], Status.TRUNCATED
        if labels:
            labels[0] = IGNORE_INDEX  # the first token of a sample is never the target of whatever came before it
        if all(label == IGNORE_INDEX for label in labels):
            return Encoded([], [], Status.NOTHING_TO_TRAIN)
        return Encoded(ids, labels, status)

    def encode_batch(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        """``datasets.map(batched=True)``: columns in, ``input_ids``/``labels``/``length``/``status`` out."""
        n = len(next(iter(batch.values())))
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "length": [], "status": []}
        for i in range(n):
            encoded = self.encode({key: values[i] for key, values in batch.items()})
            out["input_ids"].append(encoded.input_ids)
            out["labels"].append(encoded.labels)
            out["length"].append(len(encoded.input_ids))
            out["status"].append(encoded.status)
        return out
