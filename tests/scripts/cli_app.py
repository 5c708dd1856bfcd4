"""A LightningCLI application, as a user writes one: ``python cli_app.py fit --trainer.strategy ... [--config F]``.

Rank 0 writes ``$CLI_APP_OUT`` (JSON): the strategy's class and settings as the CLI built them, the wrapped units
and the number of steps trained.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  (registers the strategy names)
from tests.helpers.models import TinyLM, loader  # noqa: E402


class TokenData(L.LightningDataModule):
    def __init__(self, n: int = 16, batch_size: int = 2) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self):
        return loader(self.n, self.batch_size)


class Report(Callback):
    def on_fit_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if trainer.is_global_zero and os.environ.get("CLI_APP_OUT"):
            Path(os.environ["CLI_APP_OUT"]).write_text(json.dumps({
                "strategy": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "wrapped_units": getattr(strategy, "wrapped_units", None),
                "auto_wrap_policy": repr(getattr(strategy, "auto_wrap_policy", None)),
                "activation_checkpointing_policy": repr(getattr(strategy, "activation_checkpointing_policy", None)),
                "state_dict_type": getattr(strategy, "state_dict_type", None),
            }))


if __name__ == "__main__":
    LightningCLI(TinyLM, TokenData, save_config_callback=None,
                 trainer_defaults={"callbacks": [Report()], "logger": False, "enable_progress_bar": False,
                                   "enable_model_summary": False, "enable_checkpointing": False})
