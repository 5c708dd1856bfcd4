"""The Trainer's adapter over :class:`~lightning_fsdp.resilience.Resilience`: the step- and epoch-boundary callback
the strategy adds, its launcher, its dataloader and closure wiring, and the on-exception save that never hangs."""

from __future__ import annotations

import atexit
import signal
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_fsdp._lightning_compat import SubprocessScriptLauncher, batches_processed, trainer_callbacks
from lightning_fsdp.resilience import RelayedLaunch, Resilience
from lightning_fsdp.resilience.batches import check_equal_batches
from lightning_fsdp.resilience.errors import PREEMPTED_EXIT_CODE, PartialFailureError, Preempted
from lightning_fsdp.resilience.preemption import requeue_at_exit
from lightning_fsdp.resilience.report import say

if TYPE_CHECKING:
    import lightning.pytorch as pl

_STAGE_NAMES = {"train": "training", "val": "validation", "test": "test", "predict": "predict"}


class ResilientLauncher(RelayedLaunch, SubprocessScriptLauncher):
    """Lightning's script launcher for the Trainer, telling the relay first (see :class:`RelayedLaunch`)."""


def attach(resilience: Resilience, trainer: pl.Trainer) -> None:
    """Add the callback that runs the step-boundary agreements (once per Trainer)."""
    callbacks = trainer_callbacks(trainer)
    if not any(isinstance(cb, ResilienceCallback) for cb in callbacks):
        callbacks.append(ResilienceCallback(resilience))


def agreed_dataloader(resilience: Resilience, dataloader: Any, trainer: Optional[pl.Trainer], device: torch.device) -> Any:
    """The loader whose ranks agree on its length, resumable mid-epoch from the fit loop's progress."""
    if trainer is None:
        return dataloader

    def progress() -> tuple[int, Any]:
        return batches_processed(trainer), trainer.num_training_batches

    prefix = getattr(trainer.state.stage, "dataloader_prefix", None) or ""
    return resilience.process_dataloader(dataloader, progress, device, stage=_STAGE_NAMES.get(prefix, "training"))


def guarded_closure(
    resilience: Resilience, closure: Callable[[], Any], optimizer: torch.optim.Optimizer,
    trainer: Optional[pl.Trainer], device: torch.device, has_scaler: bool,
) -> Callable[[], Any]:
    """The optimizer closure with the agreed non-finite check (messages name the Trainer's global step). With a loss
    scaler (16-mixed) inf gradients are expected and the scaler skips those steps itself: only the loss is checked."""
    if resilience.nonfinite is None:
        return closure

    def step() -> int:
        return trainer.global_step if trainer is not None else -1

    return resilience.nonfinite.wrap(closure, optimizer, step, device, check_grads=not has_scaler)


def last_checkpoint_path(trainer: pl.Trainer) -> Optional[str]:
    """The path ``ckpt_path="last"`` will find: the ``last`` file of the first ``ModelCheckpoint`` with a directory.

    A ``ModelCheckpoint`` with ``save_last`` is preferred; the name follows its ``CHECKPOINT_NAME_LAST`` pattern.
    """
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not callbacks:
        return None
    callbacks.sort(key=lambda cb: not cb.save_last)
    cb = callbacks[0]
    metrics = dict(trainer.callback_metrics)
    metrics.update(epoch=torch.tensor(trainer.current_epoch), step=torch.tensor(trainer.global_step))
    return cb.format_checkpoint_name(metrics, cb.CHECKPOINT_NAME_LAST)


class ResilienceCallback(Callback):
    """Step- and epoch-boundary agreements, added by the strategy. Every rank runs each hook at the same point."""

    def __init__(self, resilience: Resilience) -> None:
        self.resilience = resilience
        self._last_step = -1

    @property
    @override
    def state_key(self) -> str:
        return "lightning_fsdp.resilience"

    def _signals(self, trainer: pl.Trainer) -> list[int]:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        signals: list[int] = [signal.SIGTERM, signal.SIGUSR1]
        env = getattr(trainer.strategy, "cluster_environment", None)  # a parallel strategy's
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            signals.append(int(env.requeue_signal))
        return sorted(set(int(s) for s in signals))

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resilience.preemption.install(self._signals(trainer))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resilience.preemption.install(self._signals(trainer))
        self._last_step = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("training", trainer.num_training_batches, trainer.strategy.root_device)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        check_equal_batches("validation", counts, trainer.strategy.root_device)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("test", trainer.num_test_batches, trainer.strategy.root_device)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("predict", trainer.num_predict_batches, trainer.strategy.root_device)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self.resilience.nonfinite
        if guard is not None:
            pl_module.log("nonfinite_steps_skipped", float(guard.skipped), on_step=True, on_epoch=False, prog_bar=False)
        if trainer.global_step == self._last_step:
            return  # mid-accumulation: stop only at an optimizer-step boundary
        self._last_step = trainer.global_step
        signum = self.resilience.preemption.agree(trainer.strategy.root_device)
        if signum:
            self._save_and_exit(trainer, signum)

    def _save_and_exit(self, trainer: pl.Trainer, signum: int) -> None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        name = signal.Signals(signum).name
        path = last_checkpoint_path(trainer)
        if path is None:
            rank_zero_warn(
                f"Preempted by {name}, but no ModelCheckpoint with a directory is configured: nothing was saved."
                " Add `ModelCheckpoint(dirpath=..., save_last=True)` to resume with `ckpt_path='last'`."
            )
        else:
            for cb in trainer.checkpoint_callbacks:  # before saving: the saved callback state then owns `last`
                if isinstance(cb, ModelCheckpoint) and cb.dirpath and path.startswith(str(cb.dirpath)):
                    cb.last_model_path = path
            trainer.save_checkpoint(path, weights_only=False)
        self.resilience.preemption.requested = 0
        env = getattr(trainer.strategy, "cluster_environment", None)
        if trainer.is_global_zero and isinstance(env, SLURMEnvironment) and env.auto_requeue:
            atexit.register(requeue_at_exit)
        message = (
            f"preempted by {name} at global step {trainer.global_step}: checkpoint saved to {path}; exiting with"
            f" {PREEMPTED_EXIT_CODE} so the job is requeued; resume with ckpt_path='last'."
        )
        say(message)
        raise Preempted(message)


class SafeOnExceptionCheckpoint(OnExceptionCheckpoint):
    """``OnExceptionCheckpoint`` that never hangs: it saves only when every rank failed together (e.g. the same
    error everywhere, Ctrl+C); when one rank failed alone the others are mid-collective and the save is skipped
    with a message. Preemption already saved to ``last``, so it is not saved again here."""

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        exception = args[1] if len(args) > 1 else kwargs.get("exception")
        if isinstance(exception, Preempted):
            return
        try:
            super().on_exception(trainer, *args, **kwargs)
        except PartialFailureError as err:
            say(f"on-exception checkpoint not saved: {err}")
