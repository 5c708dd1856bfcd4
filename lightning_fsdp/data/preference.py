"""``PreferenceDataModule``: (prompt, chosen, rejected) pairs for DPO and SimPO, from the user's own files.

Accepted formats (TRL's preference formats; ``format`` is told from the columns):

=============== ======================================= =================================================
format          columns                                 prompt
=============== ======================================= =================================================
explicit        ``prompt``, ``chosen``, ``rejected``    given: strings, or message lists (``role``/``content``)
implicit        ``chosen``, ``rejected``                their longest shared beginning (messages or text)
=============== ======================================= =================================================

Each pair is tokenized as TRL tokenizes it: conversations through the model's chat template (the prompt with the
generation prompt; each completion as the end of ``prompt + completion``), plain strings with the tokenizer and an
end token appended to each completion. The completion starts where the tokens of the prompt and of
``prompt + completion`` first differ. Labels fall only on completion tokens.

What is kept is counted once, and a pair that cannot be trained is dropped with a notice rather than trained wrongly:
a chosen completion equal to its rejected one (no preference to learn), or a prompt that leaves no room for a
completion within ``seq_len``. A completion that does not fit is cut at ``seq_len`` (the prompt is kept whole).

Prepared sets are cached like :class:`~lightning_fsdp.data.SFTDataModule`'s (keyed by the files' bytes, the
tokenizer and every setting; memory-mapped Arrow), and the training loader is the same global-order, stateful one:
a mid-epoch checkpoint resumes with the next pair at any world size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fsdp.data.order import GlobalOrderSampler, data_parallel_rank
from lightning_fsdp.data.prepared_splits import PreparedSplits, SplitKind, SplitSources
from lightning_fsdp.cache import cache_root
from lightning_fsdp.data.sft.module import check_model_fits, load_tokenizer
from lightning_fsdp.data.sft.source import column_names
from lightning_fsdp.formatting import format_count as count
from lightning_fsdp.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

__all__ = ["PREFERENCE_FORMATS", "PairEncoder", "PairStatus", "PreferenceDataModule", "collate_pairs",
           "detect_preference_format", "split_pair"]

#: format → its columns
PREFERENCE_FORMATS = {"explicit": ("prompt", "chosen", "rejected"), "implicit": ("chosen", "rejected")}
#: bump when the way pairs become tokens changes
PAIR_ENCODING_VERSION = 1


class PairStatus:
    KEPT, TRUNCATED, IDENTICAL, NO_ROOM = 0, 1, 2, 3
    NAMES = {KEPT: "kept", TRUNCATED: "truncated", IDENTICAL: "dropped (chosen equals rejected)",
             NO_ROOM: "dropped (the prompt leaves no room for a completion)"}


def detect_preference_format(columns: Sequence[str]) -> str:
    """``"explicit"`` or ``"implicit"`` from the columns; an error listing what was found and what is accepted."""
    present = set(columns)
    for name, needed in PREFERENCE_FORMATS.items():
        if set(needed) <= present:
            return name
    accepted = "; ".join(f"{name}: {' + '.join(cols)}" for name, cols in PREFERENCE_FORMATS.items())
    raise ValueError(
        f"The preference data's columns {sorted(present)} match no preference format. Accepted (TRL's formats):"
        f" {accepted} (strings, or message lists of role/content). Rename the columns to match."
    )


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m for m in value)


def split_pair(row: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a row; an implicit prompt is the longest shared beginning (whole messages
    for conversations, characters for text)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if row.get("prompt") is not None:
        return row["prompt"], chosen, rejected
    if _is_conversation(chosen) and _is_conversation(rejected):
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        return list(chosen[:shared]), list(chosen[shared:]), list(rejected[shared:])
    chosen, rejected = str(chosen), str(rejected)
    shared = len(os.path.commonprefix([chosen, rejected]))
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class PairRecipe(SplitSources):
    fmt: str
    seq_len: int
    chat_template: Optional[str]


@dataclass
class PairEncoder:
    """One row → ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` and a :class:`PairStatus`; picklable."""

    tokenizer: Any
    seq_len: int
    chat_template: Optional[str] = None

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True,
            chat_template=self.chat_template,
        )
        return list(encoded["input_ids"])

    def encode(self, row: Mapping[str, Any]) -> dict[str, Any]:
        prompt, chosen, rejected = split_pair(row)
        if _is_conversation(prompt) and _is_conversation(chosen) and _is_conversation(rejected):
            prompt_ids = self._chat_ids(prompt, add_generation_prompt=True)
            with_chosen = self._chat_ids([*prompt, *chosen], add_generation_prompt=False)
            with_rejected = self._chat_ids([*prompt, *rejected], add_generation_prompt=False)
        else:
            eos = self.tokenizer.eos_token or ""
            chosen, rejected = (c if c.endswith(eos) else c + eos for c in (str(chosen), str(rejected)))
            prompt_ids = list(self.tokenizer(str(prompt))["input_ids"])
            with_chosen = list(self.tokenizer(str(prompt) + chosen)["input_ids"])
            with_rejected = list(self.tokenizer(str(prompt) + rejected)["input_ids"])
        start = min(_shared_length(prompt_ids, with_chosen), _shared_length(prompt_ids, with_rejected))
        prompt_ids, chosen_ids, rejected_ids = prompt_ids[:start], with_chosen[start:], with_rejected[start:]
        status = PairStatus.KEPT
        if chosen_ids == rejected_ids:
            status = PairStatus.IDENTICAL
        elif len(prompt_ids) >= self.seq_len:
            status = PairStatus.NO_ROOM
        elif len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)) > self.seq_len:
            room = self.seq_len - len(prompt_ids)
            chosen_ids, rejected_ids, status = chosen_ids[:room], rejected_ids[:room], PairStatus.TRUNCATED
        if status in (PairStatus.IDENTICAL, PairStatus.NO_ROOM):
            prompt_ids, chosen_ids, rejected_ids = [], [], []
        return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "status": status}



def _judge_pairs(recipe: PairRecipe, split: str, data: Any, encoded: Any) -> tuple[dict[str, Any], list[int]]:
    statuses = np.asarray(encoded["status"], dtype=np.int64)
    counts = np.bincount(statuses, minlength=len(PairStatus.NAMES))
    stats = {"pairs": len(data), **{name: int(counts[c]) for c, name in PairStatus.NAMES.items()}}
    keep = np.flatnonzero(statuses <= PairStatus.TRUNCATED).tolist()
    if split == "train" and not keep:
        raise ValueError(f"No preference pair is left to train on: {describe_pairs(stats)}."
                         f" Raise seq_len={recipe.seq_len}, or check that chosen and rejected differ.")
    return stats, keep


#: tokenized, filtered pairs per split and their counts
PAIRS = SplitKind("pairs", PAIR_ENCODING_VERSION, {"pairs": 0, **{name: 0 for name in PairStatus.NAMES.values()}},
                  _judge_pairs)


def describe_pairs(split_stats: Mapping[str, int]) -> str:
    return ", ".join(f"{count(split_stats[name])} {name}" for name in PairStatus.NAMES.values() if split_stats.get(name)) or "none"


class PairRows(Dataset):
    """Tokenized pairs; index ``-1`` is an empty pair (the padding of an uneven last evaluation round).
    ``reference``: each pair's precomputed reference log-probabilities ``(pairs, 2)`` (chosen, rejected), once
    attached (:mod:`lightning_fsdp.models.reference`)."""

    def __init__(self, tokenized: Any) -> None:
        self.tokenized = tokenized
        self.reference: Optional[Tensor] = None

    def __len__(self) -> int:
        return len(self.tokenized) if self.tokenized is not None else 0

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            empty: dict[str, Any] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
            return empty if self.reference is None else {**empty, "reference_logps": [0.0, 0.0]}
        item = self.tokenized[int(index)]
        out: dict[str, Any] = {k: list(item[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        if self.reference is not None:
            out["reference_logps"] = self.reference[int(index)].tolist()
        return out


def collate_pairs(pairs: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """``B`` pairs → ``2B`` right-padded rows, the chosen completions first: ``input_ids``, ``attention_mask``,
    ``labels`` (the completion tokens, ``-100`` elsewhere) and ``pair_mask`` (``(B,)``: 0 for padding pairs); and
    ``reference_logps`` (``(2B,)``, in row order) when the pairs carry precomputed ones."""
    sequences = [list(p["prompt_ids"]) + list(p["chosen_ids"]) for p in pairs]
    sequences += [list(p["prompt_ids"]) + list(p["rejected_ids"]) for p in pairs]
    prompts = [len(p["prompt_ids"]) for p in pairs] * 2
    width = max(2, max(len(s) for s in sequences))
    rows = len(sequences)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    for i, (sequence, prompt) in enumerate(zip(sequences, prompts)):
        values = torch.tensor(sequence, dtype=torch.long)
        input_ids[i, : len(sequence)] = values
        labels[i, prompt : len(sequence)] = values[prompt:]
        attention_mask[i, : len(sequence)] = 1
    pair_mask = torch.tensor([1.0 if p["chosen_ids"] else 0.0 for p in pairs])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "pair_mask": pair_mask}
    if pairs and all("reference_logps" in p for p in pairs):
        chosen_rejected = torch.tensor([list(p["reference_logps"]) for p in pairs], dtype=torch.float32)
        batch["reference_logps"] = torch.cat([chosen_rejected[:, 0], chosen_rejected[:, 1]])
    return batch


class PreferenceDataModule(PreparedSplits):
    """Preference pairs from a file, folder or saved data set, tokenized by the model's own tokenizer.

    Args:
        path: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a folder of one kind, or a ``save_to_disk`` set.
        tokenizer: a model or tokenizer directory, or a ``.gguf`` model file.
        val_path: held-out pairs; else ``val_fraction`` of ``path`` (seeded).
        seq_len: the longest prompt + completion in tokens (completions are cut to fit; the prompt is kept whole).
        batch_size: pairs per batch *per rank* (each pair is two rows).
        chat_template: a Jinja chat template for tokenizers without one (or to override theirs).
        seed: shuffling seed (epoch ``e`` uses ``seed + e``) and the validation split's.
        cache_dir: where prepared sets are kept (default ``$LIGHTNING_FSDP_CACHE/preference``).
    """

    kind = PAIRS

    def __init__(
        self,
        path: Union[str, Path],
        tokenizer: Union[str, Path],
        val_path: Optional[Union[str, Path]] = None,
        val_fraction: float = 0.05,
        seq_len: int = 1024,
        batch_size: int = 1,
        chat_template: Optional[str] = None,
        seed: int = 0,
        cache_dir: Optional[Union[str, Path]] = None,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
    ) -> None:
        super().__init__()
        if seq_len < 2 or batch_size < 1 or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"seq_len ≥ 2, batch_size ≥ 1 and 0 ≤ val_fraction < 1 are needed; got {seq_len},"
                             f" {batch_size}, {val_fraction}.")
        from lightning_fsdp.hf.gguf import resolve_model_source

        tokenizer = resolve_model_source(tokenizer)
        self.tokenizer = load_tokenizer(tokenizer)
        fmt = detect_preference_format(column_names(path))
        if val_path is not None:
            detect_preference_format(column_names(val_path))
        check_model_fits(Path(tokenizer), self.tokenizer, int(seq_len))
        self.recipe = PairRecipe(str(Path(path).expanduser().resolve()),
                                 str(Path(val_path).expanduser().resolve()) if val_path else None, float(val_fraction),
                                 int(seed), fmt, int(seq_len), chat_template)
        self.encoder = PairEncoder(self.tokenizer, int(seq_len), chat_template)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.batch_size, self.seed, self.num_workers, self.num_proc = batch_size, int(seed), num_workers, num_proc
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root("preference")

    @override
    def rows(self, tokenized: Any) -> PairRows:
        return PairRows(tokenized)

    @override
    def describe(self, stats: dict[str, Any]) -> str:
        return f"Preference data: train {describe_pairs(stats['train'])}; val {describe_pairs(stats['val'])}"

    def reference_cache(self, model_key: str) -> Path:
        """Where the reference log-probabilities of these prepared pairs under the model ``model_key`` are kept:
        beside the tokenized pairs, so they are cached exactly as long as the pairs are."""
        assert self.prepared_dir is not None, "call setup() first"
        return self.prepared_dir / f"reference-{model_key}.safetensors"

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        from functools import partial

        return partial(collate_pairs, pad_id=self.pad_id)

    def val_dataloader(self) -> DataLoader:
        """Every held-out pair once; an uneven last round is padded with empty pairs (``pair_mask`` 0)."""
        assert self.val_set is not None, "call setup() first"
        replicas, rank = data_parallel_rank(self.trainer)
        sampler = GlobalOrderSampler(len(self.val_set), self.batch_size, replicas, rank, shuffle=False, drop_last=False)  # type: ignore[arg-type]
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate_fn(),
                          num_workers=self.num_workers)
