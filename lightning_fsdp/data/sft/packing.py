"""Samples into rows: packed (first-fit decreasing) or one per row, and the batches a causal LM takes.

A packed row concatenates whole samples; ``position_ids`` restart at 0 for each, and the batch carries **no**
``attention_mask``. transformers' eager, SDPA and flex attention then build a causal mask per sample from the
restarting positions (with ``use_cache=False``), and FlashAttention-2 runs varlen from them, so no sample attends
to another: an all-ones mask would silently switch that off. Unpacked rows are padded to the longest in the batch
with an ``attention_mask``. Padding is never trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_fsdp.loss import IGNORE_INDEX

__all__ = ["PackedRows", "SampleRows", "collate_rows", "first_fit_decreasing"]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sample indices grouped into bins of at most ``capacity`` tokens: longest first, each into the first bin with
    room (ties by index, so the plan is the same everywhere). ``O(n log n)`` with a max-tree over bin room."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    if any(int(lengths[i]) > capacity for i in order[:1]):
        raise ValueError(f"A sample of {lengths[order[0]]} tokens does not fit a row of {capacity}.")
    size = 1
    while size < max(1, len(order)):
        size *= 2
    room = [capacity] * size + [capacity] * size  # room[size + b]: bin b's free tokens; inner nodes: the max below
    bins: list[list[int]] = []
    for i in order:
        need, node = int(lengths[i]), 1
        while node < size:  # descend to the leftmost bin with room
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class SampleRows(Dataset):
    """One tokenized sample per row; index ``-1`` is an empty row (the padding of an uneven last round)."""

    def __init__(self, tokenized: Any) -> None:
        self.tokenized = tokenized

    def __len__(self) -> int:
        return len(self.tokenized)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if index < 0:
            return _row([], [], [])
        item = self.tokenized[int(index)]
        return _row(item["input_ids"], item["labels"], [len(item["input_ids"])])


class PackedRows(Dataset):
    """Rows of whole samples packed by :func:`first_fit_decreasing` (``bins``: sample indices per row)."""

    def __init__(self, tokenized: Any, bins: Sequence[Sequence[int]]) -> None:
        self.tokenized, self.bins = tokenized, [list(b) for b in bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if index < 0:
            return _row([], [], [])
        items = self.tokenized[self.bins[int(index)]]  # one columnar read for the whole row
        ids = [t for sample in items["input_ids"] for t in sample]
        labels = [t for sample in items["labels"] for t in sample]
        return _row(ids, labels, [len(sample) for sample in items["input_ids"]])


def _row(ids: Sequence[int], labels: Sequence[int], lengths: Sequence[int]) -> dict[str, Tensor]:
    positions = np.concatenate([np.arange(n) for n in lengths]) if lengths else np.zeros(0, dtype=np.int64)
    return {
        "input_ids": torch.as_tensor(np.asarray(ids, dtype=np.int64)),
        "labels": torch.as_tensor(np.asarray(labels, dtype=np.int64)),
        "position_ids": torch.as_tensor(positions.astype(np.int64)),
    }


def collate_rows(rows: Sequence[dict[str, Tensor]], pad_id: int, packed: bool) -> dict[str, Tensor]:
    """Rows padded to the longest of the batch (at least 2 tokens). Packed: ``position_ids``, the padding its own
    sample, no ``attention_mask``. Unpacked: ``attention_mask`` 0 on padding, no ``position_ids``."""
    width = max(2, max(int(r["input_ids"].numel()) for r in rows))
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        positions = torch.arange(width).repeat(n, 1)  # padding: a sample of its own, positions from 0
        batch["position_ids"] = positions
    else:
        mask = torch.zeros((n, width), dtype=torch.long)
        batch["attention_mask"] = mask
    for i, row in enumerate(rows):
        length = int(row["input_ids"].numel())
        input_ids[i, :length] = row["input_ids"]
        labels[i, :length] = row["labels"]
        if packed:
            positions[i, :length] = row["position_ids"]
            positions[i, length:] = torch.arange(width - length)
        else:
            mask[i, :length] = 1
    return batch
