"""Context parallelism's sequence layout: which tokens of a row each rank of a context-parallel group holds.

A row of ``S`` tokens is cut into ``2 × cp`` equal chunks; rank ``r`` holds chunk ``r`` and chunk ``2·cp − 1 − r``
(a head chunk and a tail chunk). Under a causal mask a late chunk attends to more keys than an early one, so the
pairing gives every rank the same attention work. Plain functions of their arguments, tested without processes.

The batch is split here, before the model sees it: the labels are shifted to next-token targets first (the
target of a chunk's last token is the next chunk's first), and every ``(B, S)`` tensor is cut the same way. A
packed row's document boundaries (``position_ids`` restarting at 0) become document ids before the cut, so the
attention keeps documents apart across chunks and ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    import torch.distributed as dist

#: the label of a position that is not trained (transformers' and PyTorch's convention)
IGNORE_INDEX = -100
#: the batch key of next-token targets already shifted (transformers' name for them under context parallelism)
SHIFTED_LABELS = "shift_labels"


@dataclass(frozen=True)
class SequenceLayout:
    """Rank ``rank`` of a context-parallel group of ``size`` ranks: its two chunks of every row."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"A context-parallel rank {self.rank} of {self.size} ranks does not exist.")

    @property
    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's head and tail chunk among the row's ``2 × size`` chunks."""
        return self.rank, 2 * self.size - 1 - self.rank

    def of_rank(self, rank: int) -> SequenceLayout:
        return SequenceLayout(self.size, rank)

    def check_length(self, seq_len: int) -> None:
        """A row splits into ``2 × size`` equal chunks only if its length is a multiple of that."""
        parts = 2 * self.size
        if seq_len % parts:
            raise ValueError(
                f"A sequence of {seq_len} tokens does not split into {parts} equal chunks (context_parallel="
                f"{self.size} gives each rank two chunks). Give the rows a length that is a multiple of {parts}, or"
                " pass the batch as a dict with 'input_ids' (and 'labels'): such rows are padded at the end for you."
            )

    def split(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's two chunks of ``tensor`` along ``dim`` (the sequence), concatenated."""
        self.check_length(tensor.shape[dim])
        parts = tensor.chunk(2 * self.size, dim=dim)
        head, tail = self.chunks
        return torch.cat([parts[head], parts[tail]], dim=dim)

    def positions(self, seq_len: int, device: Optional[torch.device] = None) -> Tensor:
        """The indices within the whole row of this rank's tokens (for rotary tables and the causal mask)."""
        return self.split(torch.arange(seq_len, device=device)[None])[0]

    def local_positions(self, local_len: int, device: Optional[torch.device] = None) -> Tensor:
        """:meth:`positions` of a row whose part on this rank holds ``local_len`` tokens."""
        return self.positions(local_len * self.size, device)

    def restore(self, pieces: list[Tensor], dim: int = 1) -> Tensor:
        """Whole rows from every rank's :meth:`split` (``pieces[r]`` from rank ``r``): the inverse, for tests and
        for gathering per-token outputs."""
        chunks: list[Optional[Tensor]] = [None] * (2 * self.size)
        for rank, piece in enumerate(pieces):
            head, tail = self.of_rank(rank).chunks
            chunks[head], chunks[tail] = piece.chunk(2, dim=dim)
        return torch.cat([c for c in chunks if c is not None], dim=dim)


def shifted_labels(labels: Tensor) -> Tensor:
    """Next-token targets of ``labels`` (B, S): position ``t`` gets ``labels[t + 1]``, the last gets ``-100``."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def document_ids(position_ids: Tensor) -> Tensor:
    """Packed rows' document numbers: a new document starts wherever ``position_ids`` restarts at 0."""
    return (position_ids == 0).long().cumsum(dim=1)


@dataclass(frozen=True)
class SequenceSplit:
    """What the attention of one step needs to see across ranks: the group, this rank's layout, and the document
    ids of its tokens (``None``: one document per row)."""

    group: Optional[dist.ProcessGroup]
    layout: SequenceLayout
    documents: Optional[Tensor] = None


class _Active:
    """The split in force, and how many attention calls attended across its ranks."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split, self.calls = split, 0


_ACTIVE: contextvars.ContextVar[Optional[_Active]] = contextvars.ContextVar("lightning_fsdp_split", default=None)


def active_split() -> Optional[SequenceSplit]:
    """The split of the step that is running, or ``None`` outside a context-parallel step."""
    active = _ACTIVE.get()
    return active.split if active is not None else None


def attended_across_ranks() -> None:
    """Called by every attention that honours the active split (ring attention does)."""
    active = _ACTIVE.get()
    if active is not None:
        active.calls += 1


@contextlib.contextmanager
def splitting(split: Optional[SequenceSplit], *, expect_attention: bool = True) -> Iterator[None]:
    """Attention inside this block attends across the ranks of ``split`` (nothing changes for ``None``).

    With ``expect_attention``, a block that ran no such attention is an error: the model's attention saw only this
    rank's chunks, so its results would be silently wrong."""
    if split is None:
        yield
        return
    active = _Active(split)
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
    if expect_attention and split.layout.size > 1 and active.calls == 0:
        raise RuntimeError(
            "context_parallel is on, but the model's attention did not attend across the context-parallel ranks: each"
            " rank saw only its own chunks of the sequence. Use a Hugging Face model (its attention is switched to"
            " ring attention), the package's GPT, or call lightning_fsdp.parallel.ring_attention(q, k, v,"
            " active_split()) in your attention; or set context_parallel=1."
        )


def split_batch(batch: Any, layout: SequenceLayout, group: Optional[dist.ProcessGroup] = None) -> tuple[Any, SequenceSplit]:
    """This rank's part of a causal-LM batch, and the split its attention needs.

    A dict with ``input_ids`` (and optionally ``labels``, ``position_ids``, a right-padded ``attention_mask``):
    the labels (or the inputs) are shifted to :data:`SHIFTED_LABELS` first, ``position_ids`` are the row's own (a
    packed row's, or ``0..S-1``), rows are padded at the end to a multiple of ``2 × size`` (untrained positions),
    and every ``(B, S)`` tensor is cut. The mask is dropped: right padding comes after
    every real token, so a causal mask already keeps it out. A tuple ``(inputs, targets)`` holds next-token targets
    already (the package's GPT): both are cut, and the positions are the row's.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        inputs, targets = batch
        parts = (layout.split(inputs), layout.split(targets))
        return (list(parts) if isinstance(batch, list) else parts), SequenceSplit(group, layout)
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TypeError(
            "Context parallelism splits causal-LM batches: a dict with 'input_ids' (and 'labels', 'position_ids' or a"
            f" right-padded 'attention_mask'), or a tuple (inputs, next-token targets); got {type(batch).__name__}."
        )
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "Context parallelism needs right-padded rows (padding after the tokens); this batch has padding before"
            " real tokens. Pad on the right (tokenizer.padding_side='right'), or pack the rows."
        )
    labels: Tensor = batch["labels"] if batch.get("labels") is not None else input_ids
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    targets = shifted_labels(labels)
    pad = -input_ids.shape[1] % (2 * layout.size)
    if pad:  # padded at the end to split evenly: never a target, and after every real token, so never attended to
        steps = torch.arange(1, pad + 1, device=positions.device)
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        targets = torch.nn.functional.pad(targets, (0, pad), value=IGNORE_INDEX)
        positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    documents = layout.split(document_ids(positions)) if "position_ids" in batch else None
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids", "attention_mask")}
    out.update(input_ids=layout.split(input_ids), position_ids=layout.split(positions),
               **{SHIFTED_LABELS: layout.split(targets)})
    return out, SequenceSplit(group, layout, documents)
