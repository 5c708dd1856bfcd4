"""``MemoryReport``: the Trainer callback that reports what :mod:`lightning_fsdp.memory` measures — each rank's
sharded bytes and peak memory, logged every epoch and printed as one per-rank table at the end of fit."""

from __future__ import annotations

from dataclasses import astuple
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fsdp._lightning_compat import unwrap_optimizer
from lightning_fsdp.memory import (
    RANK_FIELDS,
    PeakMemory,
    RankMemory,
    StateBytes,
    format_memory_table,
    global_state_bytes,
    local_state_bytes,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl


def shard_group_size(strategy: Any) -> int:
    """Ranks the state is (ideally) divided over: the FSDP shard dimension, else the whole world."""
    mesh_shape = getattr(strategy, "_mesh_shape", None) or getattr(strategy, "mesh_shape", None)
    if mesh_shape is not None and hasattr(mesh_shape, "shard"):
        return int(mesh_shape.shard_group)
    return max(1, int(getattr(strategy, "world_size", 1)))


class MemoryReport(Callback):
    """Each rank's sharded bytes and peak memory: logged every epoch, printed as one per-rank table at the end of fit.

    Local bytes come from ``strategy.state_bytes()`` where the strategy has it, else from :func:`local_state_bytes`.
    Peak memory is the CUDA allocator's peak on GPU, and on CPU the peak RSS above the RSS at ``setup`` (before the
    model is sharded, so it counts what training adds). After fit, :attr:`rows` and :attr:`unsharded` hold the
    numbers of every rank (on every rank).

    On CPU, glibc keeps freed heap memory resident, so RSS can exceed the live tensors by tens of percent; run with
    ``MALLOC_MMAP_THRESHOLD_=65536`` for an RSS that follows live tensors like the CUDA allocator's counter does.

    Args:
        log: log ``memory/rank{r}/{params,grads,optimizer,peak}`` (bytes) at each training epoch end.
        print_table: print the table on rank 0 at the end of fit.
    """

    def __init__(self, log: bool = True, print_table: bool = True) -> None:
        super().__init__()
        self.log_metrics = log
        self.print_table = print_table
        self.rows: list[RankMemory] = []
        self.unsharded: Optional[StateBytes] = None
        self.shard_size = 1
        self.table = ""
        self._tracker: Optional[PeakMemory] = None
        self._state = StateBytes(0, 0, 0)
        self._unsharded = StateBytes(0, 0, 0)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._tracker = PeakMemory(trainer.strategy.root_device)
        self._tracker.reset()
        self._state = StateBytes(0, 0, 0)
        self._unsharded = StateBytes(0, 0, 0)

    def _sample(self, trainer: pl.Trainer) -> None:
        """Keep the largest state seen: gradients and optimizer state exist only after the first step."""
        strategy = trainer.strategy
        optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
        state_bytes = getattr(strategy, "state_bytes", None)  # ours knows its shards; any other strategy: counted
        local = state_bytes() if callable(state_bytes) else None
        module = trainer.lightning_module
        if local is None:
            local = local_state_bytes(module, optimizers)
        full = global_state_bytes(module, optimizers)
        self._state = StateBytes(*(max(a, b) for a, b in zip(astuple(self._state), astuple(local))))
        self._unsharded = StateBytes(*(max(a, b) for a, b in zip(astuple(self._unsharded), astuple(full))))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._tracker is not None and trainer.global_step <= 1:
            self._sample(trainer)

    def _gather(self, trainer: pl.Trainer) -> None:
        """Collective: every rank contributes its row (all ranks must call this)."""
        assert self._tracker is not None
        local = [self._state.params, self._state.grads, self._state.optimizer, self._tracker.peak()]
        mine = torch.tensor(local, dtype=torch.int64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(mine).reshape(-1, len(RANK_FIELDS)).cpu().tolist()
        self.rows = [RankMemory(int(p), int(g), int(o), rank=rank, peak=int(peak))
                     for rank, (p, g, o, peak) in enumerate(gathered)]
        self.unsharded = self._unsharded
        self.shard_size = shard_group_size(trainer.strategy)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None or not self.log_metrics:
            return
        self._sample(trainer)
        self._gather(trainer)
        metrics = {
            f"memory/rank{row.rank}/{name}": float(getattr(row, name)) for row in self.rows for name in RANK_FIELDS
        }
        # every rank holds the same gathered numbers: write them once, straight to the loggers (no reduction needed)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        self._sample(trainer)
        self._gather(trainer)
        assert self.unsharded is not None
        self.table = format_memory_table(self.rows, self.unsharded, self.shard_size, self._tracker.kind)
        if self.print_table and trainer.is_global_zero:
            name = getattr(trainer.strategy, "strategy_name", type(trainer.strategy).__name__)
            print(f"\nMemory per rank ({name}, {len(self.rows)} rank(s), state sharded over {self.shard_size}):")
            print(self.table, flush=True)
