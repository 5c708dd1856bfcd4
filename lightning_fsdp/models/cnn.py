"""A small CNN with BatchNorm: a non-transformer LightningModule trained with the same strategy flag.

Nothing here knows about sharding. The network is built in ``__init__`` as any LightningModule would be;
``auto_wrap_policy="auto"`` finds the repeated :class:`ConvBlock` s in the ``nn.Sequential`` and makes each one an
FSDP unit (a model without repeated blocks falls back to one unit with a warning).

BatchNorm under FSDP2: the affine weight/bias are parameters and get sharded; ``running_mean``/``running_var`` are
buffers, replicated on every rank and updated from each rank's local batch only, so the ranks drift apart. A sharded
checkpoint keeps one rank's copy of replicated entries, and evaluation would differ per rank. The module therefore
averages the running statistics over all data-parallel ranks before each validation and at the end of each training
epoch (the moments a checkpoint is written), which is what SyncBatchNorm would give for the statistics without its
per-step collectives (and SyncBatchNorm does not run on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fsdp.models.metrics import ValidationMetrics

__all__ = ["ConvBlock", "ShapesCNN", "average_batchnorm_stats"]


class ConvBlock(nn.Module):
    """3×3 conv → BatchNorm → ReLU (stride 2 halves the resolution). The repeated unit of the CNN."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class ShapesCNN(L.LightningModule):
    """Classifies images (e.g. the synthetic shapes in :mod:`lightning_fsdp.data.shapes`).

    Args:
        num_classes: output classes.
        in_channels: image channels.
        widths: channels of each :class:`ConvBlock`; every block after the first halves the resolution.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        sync_batchnorm_stats: average BatchNorm running statistics across ranks before validation and at epoch end.
    """

    def __init__(
        self,
        num_classes: int = 4,
        in_channels: int = 1,
        widths: Sequence[int] = (16, 32, 32, 64),
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        sync_batchnorm_stats: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not widths:
            raise ValueError("ShapesCNN needs at least one width in `widths`.")
        channels = [in_channels, *widths]
        self.features = nn.Sequential(
            *(ConvBlock(channels[i], channels[i + 1], stride=1 if i == 0 else 2) for i in range(len(widths)))
        )
        self.classifier = nn.Linear(widths[-1], num_classes)
        self._val_metrics = ValidationMetrics(num_classes)  # outside the module tree: see metrics.py

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.detach().argmax(-1) == y).float().mean()
        stats = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        self.log("train_loss", stats[0], prog_bar=True)
        self.log("train_acc", stats[1])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        metrics = self._val_metrics.on(logits.device)
        metrics["loss"].update(F.cross_entropy(logits, y), weight=y.numel())
        metrics["acc"].update(logits.argmax(-1), y)

    def on_validation_epoch_start(self) -> None:
        self._sync_batchnorm()

    def on_train_epoch_end(self) -> None:
        self._sync_batchnorm()

    def on_validation_epoch_end(self) -> None:
        values = self._val_metrics.compute_and_reset()
        self.log("val_loss", values["loss"], prog_bar=True, sync_dist=True)
        self.log("val_acc", values["acc"], prog_bar=True, sync_dist=True)

    def _sync_batchnorm(self) -> None:
        if self.hparams["sync_batchnorm_stats"] and self.trainer.world_size > 1:
            average_batchnorm_stats(self, lambda t: self.trainer.strategy.reduce(t, reduce_op="mean"))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def average_batchnorm_stats(module: nn.Module, mean_over_ranks: Callable[[Tensor], Tensor]) -> int:
    """Replace every BatchNorm's running mean/var by ``mean_over_ranks(tensor)``; returns how many layers.

    ``mean_over_ranks`` is a collective (e.g. ``strategy.reduce(t, reduce_op="mean")``): call on every rank.
    """
    count = 0
    with torch.no_grad():
        for m in module.modules():
            if not isinstance(m, _BATCH_NORMS) or not m.track_running_stats:
                continue
            mean, var = m.running_mean, m.running_var
            if mean is not None and var is not None:
                mean.copy_(mean_over_ranks(mean.clone()))
                var.copy_(mean_over_ranks(var.clone()))
                count += 1
    return count
