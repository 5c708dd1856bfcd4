"""Synthetic image classification: noisy circles, squares, triangles and crosses, generated on the fly.

Each example is a pure function of ``(seed, index)``, so the data set needs no storage, is identical on every rank
and machine, and a ``DistributedSampler`` can split it like any other map-style data set.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_fsdp.data._loaders import SplitDataModule

__all__ = ["SHAPES", "ShapesDataModule", "SyntheticShapes", "render_shape"]

SHAPES = ("circle", "square", "triangle", "cross")


def render_shape(kind: str, image_size: int, cx: float, cy: float, r: float) -> Tensor:
    """A binary (H, W) mask of one shape centred at ``(cx, cy)`` with half-size ``r`` (pixels)."""
    coords = torch.arange(image_size, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    dx, dy = xx - cx, yy - cy
    if kind == "circle":
        mask = dx**2 + dy**2 <= r**2
    elif kind == "square":
        mask = (dx.abs() <= r) & (dy.abs() <= r)
    elif kind == "triangle":  # apex up: width grows linearly from the top edge to the base
        mask = (dy >= -r) & (dy <= r) & (dx.abs() <= (dy + r) / 2)
    elif kind == "cross":
        arm = max(r / 3, 1.0)
        mask = ((dx.abs() <= arm) & (dy.abs() <= r)) | ((dy.abs() <= arm) & (dx.abs() <= r))
    else:
        raise ValueError(f"Unknown shape {kind!r}; choose from {SHAPES}.")
    return mask.float()


class SyntheticShapes(Dataset):
    """``n`` images (1, size, size) with labels ``index % 4`` (balanced), random position/size/brightness + noise."""

    def __init__(self, n: int, image_size: int = 32, noise: float = 0.2, seed: int = 0) -> None:
        if n < 1 or image_size < 8:
            raise ValueError(f"SyntheticShapes needs n >= 1 and image_size >= 8, got n={n}, image_size={image_size}.")
        self.n, self.image_size, self.noise, self.seed = n, image_size, noise, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % len(SHAPES)
        size = self.image_size
        u = torch.rand(5, generator=g).tolist()
        r = size * (0.15 + 0.15 * u[0])
        cx = r + u[1] * (size - 1 - 2 * r)
        cy = r + u[2] * (size - 1 - 2 * r)
        brightness = 0.6 + 0.4 * u[3]
        image = render_shape(SHAPES[label], size, cx, cy, r) * brightness
        image = image + self.noise * torch.randn(size, size, generator=g)
        return image[None], torch.tensor(label)


class ShapesDataModule(SplitDataModule):
    """Train/validation sets of :class:`SyntheticShapes` with different seeds (no example is shared).

    Args:
        num_train: training images.
        num_val: validation images.
        image_size: height and width.
        noise: standard deviation of the Gaussian pixel noise.
        batch_size: images per batch *per rank*.
        num_workers: DataLoader workers.
        seed: base seed; validation uses ``seed + 1``.
    """

    num_classes = len(SHAPES)

    def __init__(
        self,
        num_train: int = 4096,
        num_val: int = 512,
        image_size: int = 32,
        noise: float = 0.2,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_train, self.num_val, self.image_size, self.noise = num_train, num_val, image_size, noise
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed

    def setup(self, stage: Optional[str] = None) -> None:
        self.train_set = SyntheticShapes(self.num_train, self.image_size, self.noise, self.seed)
        self.val_set = SyntheticShapes(self.num_val, self.image_size, self.noise, self.seed + 1)

