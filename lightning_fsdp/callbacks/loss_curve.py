"""``LossCurve``: the run's train and validation loss as a PNG next to the CSV log it is drawn from.

A callback, so any job can add it. After fit, rank 0 reads the CSV logger's ``metrics.csv`` (what was logged,
nothing recomputed) and draws each named metric against the optimizer step. Needs matplotlib (in the ``dev`` and
``bench`` extras); without it the callback says so once and draws nothing.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["LossCurve", "read_curves"]


def read_curves(metrics_csv: Path, names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of every row of a Lightning ``metrics.csv`` that logged ``name``."""
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            for name in names:
                if row.get(name) not in (None, "") and row.get("step") not in (None, ""):
                    curves[name].append((int(row["step"]), float(row[name])))
    return curves


class LossCurve(Callback):
    """Draw ``metrics`` (default train and validation loss) from the CSV log into ``<log dir>/loss_curve.png``.

    Args:
        metrics: logged names to draw, one line each.
        filename: the PNG's name inside the CSV logger's folder.
        ylabel: what the curves measure (the y axis).
    """

    def __init__(self, metrics: tuple[str, ...] = ("train_loss", "val_loss"), filename: str = "loss_curve.png",
                 ylabel: str = "loss per token") -> None:
        self.metrics, self.filename, self.ylabel = tuple(metrics), filename, ylabel
        self.path: Optional[Path] = None

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        csv_logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if csv_logger is None:
            log.warning("LossCurve draws from the CSV log; add a CSVLogger (logger=csv) to get %s.", self.filename)
            return
        csv_logger.save()
        metrics_csv = Path(csv_logger.experiment.metrics_file_path)
        if not metrics_csv.exists():
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("LossCurve needs matplotlib (pip install matplotlib); no %s drawn.", self.filename)
            return
        curves = read_curves(metrics_csv, self.metrics)
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, points in curves.items():
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(self.ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        self.path = metrics_csv.with_name(self.filename)
        fig.savefig(self.path, dpi=110)
        plt.close(fig)
        print(f"Curve of {', '.join(self.metrics)}: {self.path}", flush=True)
