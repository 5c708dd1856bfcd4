"""Validation metrics for the example models: torchmetrics objects kept outside the module tree.

Materialising a meta-device model leaves real metric states alone, but the example models keep their metrics off
the module tree all the same: they are no part of the sharded model, its summaries or its checkpoints. Each metric moves to the device of the
first batch it sees, and ``compute`` synchronises the ranks (a collective: every rank calls it).
"""

from __future__ import annotations

from typing import Any

import torch


class ValidationMetrics:
    """Named torchmetrics: ``on(device)`` for the batch's device, ``compute_and_reset()`` at the epoch's end."""

    def __init__(self, num_classes: int, perplexity: bool = False) -> None:
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.metrics: dict[str, Any] = {"loss": MeanMetric()}
        if perplexity:
            from torchmetrics.text import Perplexity

            self.metrics["ppl"] = Perplexity()
        self.metrics["acc"] = MulticlassAccuracy(num_classes=num_classes, average="micro")

    @classmethod
    def named(cls, **metrics: Any) -> ValidationMetrics:
        """A set of the given metrics (``named(loss=MeanMetric(), accuracy=MeanMetric())``)."""
        held = cls.__new__(cls)
        held.metrics = dict(metrics)
        return held

    def on(self, device: torch.device) -> dict[str, Any]:
        for metric in self.metrics.values():
            if metric.device != device:
                metric.to(device)
        return self.metrics

    def compute_and_reset(self) -> dict[str, torch.Tensor]:
        values = {name: metric.compute() for name, metric in self.metrics.items()}
        for metric in self.metrics.values():
            metric.reset()
        return values
