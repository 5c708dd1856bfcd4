"""``HeldOutPreferences``: what preference tuning changed on the held-out pairs, at step 0 and at the end."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from typing_extensions import override

from lightning_fsdp.callbacks.held_out import BeforeAndAfter, Row, held_out_sums
from lightning_fsdp.models.preference import HFPreferenceLM

__all__ = ["HeldOutPreferences", "held_out_preferences"]

_FIGURES = ("loss", "reward_accuracy", "reward_margin", "chosen_preferred")


def held_out_preferences(trainer: Any, pl_module: HFPreferenceLM) -> Optional[dict[str, float]]:
    """Pair-weighted means over every held-out pair of every rank: the loss, reward accuracy and margin, and how
    often the policy gives the chosen answer more probability than the rejected one (``chosen_preferred``)."""
    datamodule: Any = getattr(trainer, "datamodule", None)
    if datamodule is None or getattr(datamodule, "val_set", None) is None or not len(datamodule.val_set):
        return None

    def sums(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        scores = pl_module.pair_scores(batch)
        mask = batch["pair_mask"].to(scores.losses)
        values = (scores.losses, scores.accuracies, scores.margins,
                  (scores.chosen_logps > scores.rejected_logps).float(), torch.ones_like(mask))
        return torch.stack([(v * mask).sum() for v in values])

    total = held_out_sums(trainer, pl_module, sums, len(_FIGURES) + 1)
    pairs = float(total[-1].clamp(min=1))
    return {name: float(total[i]) / pairs for i, name in enumerate(_FIGURES)}


class HeldOutPreferences(BeforeAndAfter):
    """The held-out pairs at the start and the end of fit (:func:`held_out_preferences`): printed, and put into
    ``trainer.callback_metrics`` as ``held_out_<name>_at_start`` and ``held_out_<name>`` (so into ``summary.json``)."""

    subject = "Held-out pairs"

    def __init__(self) -> None:
        super().__init__(show=0)

    @override
    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> Optional[tuple[dict[str, float], list[Row]]]:
        if not isinstance(pl_module, HFPreferenceLM):
            return None
        metrics = held_out_preferences(trainer, pl_module)
        return None if metrics is None else (metrics, [])
