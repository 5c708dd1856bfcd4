"""The global sample order: the same for every world size and batch split, and resumable mid-epoch.

Each epoch's order is one permutation of the data set, seeded by ``seed + epoch``. It is cut into *rounds* of
``num_replicas × batch_size`` consecutive samples; in round ``j`` rank ``r`` takes the ``r``-th block of
``batch_size``. So an optimizer step of ``k`` accumulated rounds always covers the same consecutive
``k × num_replicas × batch_size`` samples of the order, however that global batch is split into ranks, batches and
accumulation steps. The loader's state is "global samples consumed this epoch": a checkpoint taken mid-epoch
resumes at the next unseen sample, at this world size or another whose round divides the samples consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["GlobalOrderLoader", "GlobalOrderSampler", "data_parallel_rank"]

#: the index a sampler yields to pad an uneven last round (evaluation): datasets here return an empty row for it
PAD_INDEX = -1


def data_parallel_rank(trainer: Any) -> tuple[int, int]:
    """``(num_replicas, rank)`` of a Trainer's data-parallel split (the strategy's sampler arguments)."""
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    if not getattr(trainer.strategy, "is_distributed", False) and not kwargs:
        return 1, 0
    return int(kwargs.get("num_replicas", trainer.world_size)), int(kwargs.get("rank", trainer.global_rank))


class GlobalOrderSampler(DistributedSampler):
    """This rank's samples of the global order (a ``DistributedSampler``, so Lightning does not replace it).

    ``drop_last=True`` drops the last incomplete round (training: every rank takes the same number of batches);
    ``False`` pads it with :data:`PAD_INDEX` (evaluation: every sample seen once, padding is empty).
    """

    def __init__(
        self, dataset_len: int, batch_size: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
        seed: int = 0, drop_last: bool = True,
    ) -> None:
        if batch_size < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"batch_size={batch_size}, num_replicas={num_replicas}, rank={rank} do not make a split.")
        self.dataset_len, self.batch_size, self.num_replicas, self.rank = dataset_len, batch_size, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.start_round = 0

    @property
    def round_size(self) -> int:
        return self.num_replicas * self.batch_size

    @property
    def rounds(self) -> int:
        full, rest = divmod(self.dataset_len, self.round_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        for j in range(self.start_round, self.rounds):
            start = j * self.round_size + self.rank * self.batch_size
            for position in range(start, start + self.batch_size):
                yield order[position] if position < self.dataset_len else PAD_INDEX

    def __len__(self) -> int:
        return self.rounds * self.batch_size


class GlobalOrderLoader(DataLoader):
    """A ``DataLoader`` over :class:`GlobalOrderSampler` whose ``state_dict`` is the position in global samples
    (Lightning saves it with the loops and restores it on resume; Fabric users call it themselves)."""

    def __init__(
        self, dataset: Dataset, batch_size: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
        seed: int = 0, **kwargs: Any,
    ) -> None:
        sampler = GlobalOrderSampler(len(dataset), batch_size, num_replicas, rank, shuffle, seed)  # type: ignore[arg-type]
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=False, **kwargs)
        self.global_sampler = sampler
        self._consumed_rounds = 0
        self._resume: Optional[tuple[int, int]] = None  # (epoch, samples consumed) from a checkpoint

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.global_sampler
        start = 0
        if self._resume is not None and self._resume[0] == sampler.epoch:
            samples = self._resume[1]
            if samples % sampler.round_size:
                raise ValueError(
                    f"The checkpoint's data position is {samples} samples into epoch {sampler.epoch}, which is not a"
                    f" whole number of this run's rounds (ranks × batch_size = {sampler.round_size}). Resume with a"
                    " global batch that divides it (the world size or batch_size it was saved with)."
                )
            start = samples // sampler.round_size
        self._resume = None
        sampler.start_round = self._consumed_rounds = start
        for batch in super().__iter__():
            self._consumed_rounds += 1  # counted as the batch leaves: workers' prefetching does not count
            yield batch
        sampler.start_round = 0

    def state_dict(self) -> dict[str, Any]:
        sampler = self.global_sampler
        return {"epoch": sampler.epoch, "samples_consumed": self._consumed_rounds * sampler.round_size,
                "num_samples": sampler.dataset_len, "seed": sampler.seed, "shuffle": sampler.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.global_sampler
        if int(state["num_samples"]) != sampler.dataset_len:
            raise ValueError(
                f"The checkpoint's training data had {state['num_samples']} rows, this run's has {sampler.dataset_len}:"
                " the data, seq_len or packing changed since it was saved. Resume with the same data settings, or"
                " start a new run (ckpt_path=None) from the checkpoint's weights."
            )
        self._resume = (int(state["epoch"]), int(state["samples_consumed"]))
        sampler.seed = int(state.get("seed", sampler.seed))
        sampler.set_epoch(int(state["epoch"]))
