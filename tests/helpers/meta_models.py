"""A LightningModule as people write it: torch's own layers, a parametrization and torchmetrics, for meta-init tests.

``nn.TransformerEncoder`` (so ``nn.MultiheadAttention``'s private initialiser), a ``weight_norm`` head, and the same
four metrics three times: made in ``__init__`` (under ``init_module(empty_init=True)`` in the sharded run), made in
``configure_model``, and made in ``configure_model`` inside ``torch.device("meta")`` (``meta_metrics=True``; the
single-process reference builds that set normally). Each validation epoch records every metric's value, then resets.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import DistributedOrderSampler

VOCAB, SEQ, CLASSES, DIM = 13, 6, 5, 16
N_TRAIN, N_VAL, GLOBAL_BATCH = 32, 24, 8


def _metrics() -> nn.ModuleDict:
    from torchmetrics import MeanMetric, MetricCollection, SumMetric
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    return nn.ModuleDict({
        "mean": MeanMetric(),
        "sum": SumMetric(),
        "acc": MulticlassAccuracy(num_classes=CLASSES, average="micro"),
        "collection": MetricCollection({
            "acc_macro": MulticlassAccuracy(num_classes=CLASSES, average="macro"),
            "f1": MulticlassF1Score(num_classes=CLASSES, average="macro"),
        }),
    })


class LayersAndMetrics(L.LightningModule):
    def __init__(self, meta_metrics: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = parametrizations.weight_norm(nn.Linear(DIM, CLASSES))
        self.init_metrics = _metrics()
        self.cm_metrics: Any = None
        self.meta_metrics: Any = None
        self.history: list[dict[str, float]] = []

    def configure_model(self) -> None:
        if self.cm_metrics is not None:
            return
        self.cm_metrics = _metrics()
        if self.hparams.meta_metrics:
            with torch.device("meta"):
                self.meta_metrics = _metrics()
        else:
            self.meta_metrics = _metrics()

    def metric_sets(self) -> dict[str, nn.ModuleDict]:
        return {"init": self.init_metrics, "configure_model": self.cm_metrics, "meta": self.meta_metrics}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, reduction="none")
        preds = logits.argmax(-1)
        for metrics in self.metric_sets().values():
            metrics["mean"].update(loss)
            metrics["sum"].update(loss)
            metrics["acc"].update(preds, y)
            metrics["collection"].update(preds, y)

    def on_validation_epoch_end(self) -> None:
        values: dict[str, float] = {}
        for set_name, metrics in self.metric_sets().items():
            for name, metric in metrics.items():
                result = metric.compute()  # a collective: every rank computes
                results = result if isinstance(result, dict) else {name: result}
                values.update({f"{set_name}/{k}": float(v) for k, v in results.items()})
                metric.reset()
        self.history.append(values)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, (x.sum(1) % CLASSES))


def loaders(world: int) -> tuple[DataLoader, DataLoader]:
    """Per-rank loaders (Lightning injects the samplers); one process replays the distributed training order."""
    train, val = _data(N_TRAIN, 0), _data(N_VAL, 1)
    sampler = DistributedOrderSampler(N_TRAIN, 0) if world == 1 else None
    return (DataLoader(train, batch_size=GLOBAL_BATCH // world, sampler=sampler),
            DataLoader(val, batch_size=GLOBAL_BATCH // world))


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")))


def trainer_kwargs() -> dict[str, Any]:
    return dict(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, num_sanity_val_steps=0)
