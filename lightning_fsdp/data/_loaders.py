"""The train/val split every DataModule here shares, so their loader settings cannot drift apart."""

from __future__ import annotations

from typing import Optional

import lightning as L
from torch.utils.data import DataLoader, Dataset


class SplitDataModule(L.LightningDataModule):
    """A DataModule whose ``setup`` fills ``train_set`` and ``val_set``; subclasses set ``batch_size`` and
    ``num_workers`` too."""

    batch_size: int
    num_workers: int

    def __init__(self) -> None:
        super().__init__()
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        # drop_last: every rank's batch has the same size, so a mean over ranks is the global mean
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
