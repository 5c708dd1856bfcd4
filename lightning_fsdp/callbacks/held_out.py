"""What the held-out callbacks share: one reducer over every rank's held-out batches, and the start/end protocol.

Each callback measures at the start and at the end of fit, puts its figures into ``trainer.callback_metrics`` as
``held_out_<name>_at_start`` and ``held_out_<name>`` (hence into the job's ``summary.json``), prints one line each
time on rank 0, and, at the end, a few held-out prompts with their answers before and after, side by side.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

__all__ = ["BeforeAndAfter", "held_out_sums"]

#: one held-out example as shown: (the prompt or question, the expected answer, the model's answer)
Row = tuple[str, str, str]


def held_out_sums(trainer: Any, pl_module: Any, batch_sums: Callable[[dict[str, Tensor]], Tensor], size: int) -> Tensor:
    """``batch_sums(batch)`` (a vector of ``size`` sums) added up over every held-out batch of every rank, in
    float64: each rank runs its share of the validation loader inside the root's forward (one gather per unit per
    batch), then one all-reduce. Means are then exact whatever the split: divide a sum by a count."""
    from lightning_fsdp.generation import in_root_forward

    total = torch.zeros(size, dtype=torch.float64)
    device = trainer.strategy.root_device

    def add_up() -> None:
        for batch in trainer.datamodule.val_dataloader():
            total.add_(batch_sums(trainer.strategy.batch_to_device(batch, device)).double().cpu())

    in_root_forward(pl_module, add_up)
    return trainer.strategy.reduce(total.to(device), reduce_op="sum").cpu()


class BeforeAndAfter(Callback):
    """Measure at the start and the end of fit (:meth:`evaluate`), report, and show answers side by side.

    Subclasses set :attr:`subject` (what is measured, as printed: ``"Held-out set"``) and implement
    :meth:`evaluate`; :meth:`describe` words the figures.
    """

    subject = "Held-out set"
    expected_label = "reference"

    def __init__(self, show: int = 4) -> None:
        self.show = show
        self.results: dict[str, dict[str, float]] = {}
        self.completions: dict[str, list[str]] = {}  # "start"/"end" → each shown example's answer

    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> Optional[tuple[dict[str, float], list[Row]]]:
        """``(metrics, rows)``, or ``None`` when this module or datamodule has nothing to measure."""
        raise NotImplementedError

    def describe(self, metrics: dict[str, float], rows: list[Row]) -> str:
        return ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in metrics.items())

    def logged(self, metrics: dict[str, float]) -> dict[str, float]:
        """The figures that go into ``callback_metrics`` (all of them unless a subclass says otherwise)."""
        return metrics

    def measured(self, trainer: L.Trainer, when: str, metrics: dict[str, float]) -> None:
        """Called on every rank after each measurement (``when``: ``"start"`` or ``"end"``)."""

    def _measure(self, trainer: L.Trainer, pl_module: Any, when: str) -> list[Row]:
        evaluated = self.evaluate(trainer, pl_module)
        if evaluated is None:
            return []
        metrics, rows = evaluated
        self.results[when] = metrics
        self.completions[when] = [answer for _, _, answer in rows]
        suffix = "_at_start" if when == "start" else ""
        for name, value in self.logged(metrics).items():
            trainer.callback_metrics[f"held_out_{name}{suffix}"] = torch.tensor(value)
        if trainer.is_global_zero:
            label = "at step 0" if when == "start" else f"after {trainer.global_step} steps"
            print(f"{self.subject} {label}: {self.describe(metrics, rows)}", flush=True)
        self.measured(trainer, when, metrics)
        return rows

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._measure(trainer, pl_module, "start")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self._measure(trainer, pl_module, "end")
        if rows and trainer.is_global_zero and self.show:
            print(self.side_by_side(rows), flush=True)

    def side_by_side(self, rows: list[Row]) -> str:
        """The first ``show`` examples: the expected answer, the answer at step 0 and the answer now."""
        wrap = textwrap.TextWrapper(width=100, initial_indent="    ", subsequent_indent="    ")
        before = self.completions.get("start", [])
        lines = [f"{self.subject.replace(' set', ' questions')}, before and after training:"]
        for i, (prompt, expected, after) in enumerate(rows[: self.show]):
            lines.append(f"  Q: {prompt}")
            answers = ((self.expected_label, str(expected)), ("before", before[i] if i < len(before) else ""),
                       ("after", after))
            for label, text in answers:
                lines.append(f"  {label}:")
                lines += wrap.wrap(text.strip() or "(empty)")
        return "\n".join(lines)
