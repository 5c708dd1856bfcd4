"""The progress bar of a run that counts optimizer steps (``max_steps``), not epochs.

Lightning titles its rich bar ``Epoch {current}/{max_epochs - 1}``, which on every ``max_steps`` run (where
``max_epochs`` is -1) reads "Epoch 0/-2". This bar says ``Epoch N`` there, and ``Epoch N/M`` only when the number
of epochs is the limit. Lightning's plain tqdm bar, used when ``rich`` is not installed, has no such title.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from lightning_fsdp._lightning_compat import RICH_TRAIN_DESCRIPTION

__all__ = ["StepRichProgressBar", "epoch_title", "progress_bar"]


def epoch_title(current_epoch: int, max_epochs: Optional[int]) -> str:
    """``Epoch N/M`` (M the last epoch) when epochs bound the run, else ``Epoch N``."""
    if max_epochs is None or max_epochs < 1:
        return f"Epoch {current_epoch}"
    return f"Epoch {current_epoch}/{max_epochs - 1}"


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar, titled by :func:`epoch_title`."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        title = epoch_title(current_epoch, self.trainer.max_epochs)
        width = len(self.validation_description)  # as Lightning pads it, so the bars do not flicker
        return f"{title:{width}}" if width > len(title) else title


assert hasattr(RichProgressBar, RICH_TRAIN_DESCRIPTION), f"RichProgressBar has no {RICH_TRAIN_DESCRIPTION}() any more"


def progress_bar(enabled: bool = True) -> Optional[ProgressBar]:
    """The bar for a run's callbacks: rich when installed (as Lightning would pick), tqdm otherwise; ``None``
    when the Trainer runs without one (``enable_progress_bar=False``)."""
    if not enabled:
        return None
    try:
        import rich  # noqa: F401
    except ImportError:
        return TQDMProgressBar()
    return StepRichProgressBar()
