"""``ShardedEMA``: Lightning's ``EMAWeightAveraging`` for sharded models, a thin callback over
:class:`~lightning_fsdp.averaging.ShardedAverage`.

It takes the same constructor arguments and has the same semantics — updates after optimizer steps as
``should_update`` says, the first update copies, the model holds the average during validation and after fit — but
the average is kept on each rank's shards only.

Checkpoints: the average is saved under ``ema_state_dict`` next to the model's ``state_dict`` (which stays the
model being trained, so a resumed run continues exactly). Sharded checkpoints store it in shards and reshard it on
resume at another world size like everything else; ``lightning-fsdp consolidate --weights ema`` exports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_fsdp.averaging import EMA_ENTRY, ShardedAverage

if TYPE_CHECKING:
    import lightning.pytorch as pl


def refuse_unsharded_averaging(callbacks: Iterable[Any]) -> None:
    """Lightning's ``WeightAveraging`` deep-copies the whole model and then fails on its sharded parameters: refuse
    it before any process group exists, naming the drop-in replacement."""
    for callback in callbacks:
        if isinstance(callback, WeightAveraging) and not isinstance(callback, ShardedEMA):
            kind = type(callback).__name__
            raise MisconfigurationException(
                f"`{kind}` keeps a full, unsharded copy of the model on every rank (its `AveragedModel` deep-copies"
                " the module) and cannot update it from sharded parameters. With `fsdp_custom`, use"
                f" `lightning_fsdp.ShardedEMA` instead: the same arguments as `EMAWeightAveraging`"
                " (decay, update_every_n_steps, update_starting_at_step, update_starting_at_epoch, device, use_buffers),"
                " the average kept on each rank's shards only."
            )


class ShardedEMA(EMAWeightAveraging):
    """Exponential moving average of the weights, on this rank's shards only (see the module docstring).

    Args: those of ``lightning.pytorch.callbacks.EMAWeightAveraging`` (``device``: where the average lives, e.g.
    ``"cpu"``; default the parameters' device; ``use_buffers``: average floating-point buffers too; ``decay``,
    ``update_every_n_steps``, ``update_starting_at_step``, ``update_starting_at_epoch``).
    """

    #: the checkpoint entry this callback saves and loads (the strategy reads it resharded for it)
    checkpoint_entry = EMA_ENTRY

    def __init__(
        self,
        device: Optional[Union[torch.device, str, int]] = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: Optional[int] = None,
        update_starting_at_epoch: Optional[int] = None,
    ) -> None:
        self.average = ShardedAverage(decay, device, use_buffers)  # validates the decay first
        super().__init__(
            device=device,
            use_buffers=use_buffers,
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
        )
        self.decay = self.average.decay

    @property
    def n_averaged(self) -> int:
        return self.average.n_averaged

    def average_tensors(self) -> list[Tensor]:
        """This rank's part of the average (its local shards), in tracking order."""
        return self.average.average_tensors()

    def average_bytes(self) -> int:
        """Bytes this rank holds for the average (its local shards)."""
        return self.average.average_bytes()

    # -- Lightning's hooks ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Nothing to copy yet: the average is taken from the sharded parameters at the first update."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1  # zero-based index of the optimizer step just taken, as Lightning's
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self.average.update(pl_module)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self.average.update(pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After fit the model holds the average (as with Lightning's callback)."""
        self.average.copy_to(pl_module)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluation sees the average: swapped in when an evaluation epoch starts, back out when it ends."""
        if self.average.started:
            self.average.swap(pl_module)

    on_validation_epoch_end = on_validation_epoch_start
    on_test_epoch_start = on_test_epoch_end = on_validation_epoch_start
    on_predict_epoch_start = on_predict_epoch_end = on_validation_epoch_start

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch,
                "n_averaged": self.average.n_averaged, "decay": self.decay}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = int(state_dict.get("latest_update_step", 0))
        self._latest_update_epoch = int(state_dict.get("latest_update_epoch", -1))
        self.average.n_averaged = int(state_dict.get("n_averaged", 0))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The average next to ``state_dict``: sharded for a sharded save; for a full one gathered tensor by tensor
        and kept on rank 0 only (a collective: every rank saves)."""
        if not self.average.started:
            return
        full = getattr(trainer.strategy, "state_dict_type", "sharded") == "full"
        checkpoint[EMA_ENTRY] = self.average.entry(pl_module, full=full, keep=trainer.global_rank == 0 or not full)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(EMA_ENTRY)
        if saved is None:
            rank_zero_warn(f"{type(self).__name__}: the checkpoint holds no average; it starts from the weights.")
            return
        self.average.ensure(pl_module)
        missing = self.average.missing_from(saved)
        if missing:
            raise MisconfigurationException(
                f"{type(self).__name__}: the checkpoint's average has no {missing[:5]} (saved with use_buffers ="
                f" {not self.average.use_buffers}?). Use the settings it was saved with."
            )
        self.average.load_entry(pl_module, saved)
