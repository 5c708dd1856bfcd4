"""The train/val split every DataModule here shares, so their loader settings cannot drift apart.

Training batches come in the global order of :mod:`~lightning_fsdp.data.order`: the same samples in every
optimizer step at any world size or batch split, and a mid-epoch checkpoint resumes at the next unseen sample.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lightning_fsdp.data.order import GlobalOrderLoader, data_parallel_rank


class SplitDataModule(L.LightningDataModule):
    """A DataModule whose ``setup`` fills ``train_set`` and ``val_set``; subclasses set ``batch_size`` and
    ``num_workers`` too (and ``seed``, the shuffling seed of epoch 0; the order of epoch ``e`` is seeded by
    ``seed + e``)."""

    batch_size: int
    num_workers: int
    seed: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def collate_fn(self) -> Optional[Callable[[list[Any]], Any]]:
        """How a batch is made from rows (``None``: PyTorch's default collation)."""
        return None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        replicas, rank = data_parallel_rank(self.trainer)
        return GlobalOrderLoader(
            self.train_set, self.batch_size, num_replicas=replicas, rank=rank, shuffle=True, seed=self.seed,
            collate_fn=self.collate_fn(), num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=self.collate_fn())
