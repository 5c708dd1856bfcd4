"""The DataLoaders every DataModule here uses, so train/val settings cannot drift apart between them."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset


def train_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    # drop_last: every rank's batch has the same size, so a mean over ranks is the global mean
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      num_workers=num_workers, persistent_workers=num_workers > 0)


def val_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
