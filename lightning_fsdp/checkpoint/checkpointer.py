"""``Checkpointer``: the orchestration of saves and loads for a sharded model (every rank calls every method).

The formats live in :mod:`~lightning_fsdp.checkpoint.sharded` (a directory, every rank writes its shards, atomic
commit) and :mod:`~lightning_fsdp.checkpoint.full` (one ordinary ``.ckpt``). This module decides which one, runs
async saves (committed at the next save, load or :meth:`Checkpointer.finalize`), and defers pruning of older
checkpoints until the checkpoint that replaces them is committed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint import full, sharded, sharded_load
from lightning_fsdp.checkpoint.base_weights import BaseResolver
from lightning_fsdp.checkpoint.checksums import kind_of
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.load_options import LoadOptions
from lightning_fsdp.checkpoint.sharded import SAVE_HINT, StagedSave, agreed
from lightning_fsdp.fixes import current_wording
from lightning_fsdp.parallel.collectives import broadcast_object, is_distributed, on_rank_zero, rank, world_size
from lightning_fsdp.parallel.mesh import MeshShape

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

log = logging.getLogger(__name__)


@dataclass
class _PendingSave:
    """An async save whose shards are being written; committed at the next save, load or ``finalize``."""

    future: Union[Future, AsyncSaveResponse]  # torch's response carries the future as `upload_completion`
    save: StagedSave
    started: float
    removals: list[Path] = field(default_factory=list)


STATE_DICT_TYPES = ("sharded", "full")


def check_state_dict_type(state_dict_type: str, quantize_base: Optional[str] = None) -> None:
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {state_dict_type!r}.")
    if quantize_base is not None and state_dict_type == "full":
        raise ValueError(
            f"`quantize_base={quantize_base!r}` keeps the quantized base out of checkpoints, which needs"
            " state_dict_type='sharded' (a full .ckpt stands alone). Use 'sharded', and export with"
            " `lightning-fsdp consolidate`."
        )


def _options(full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def mesh_tuple(mesh_shape: Union[MeshShape, Sequence[int], None]) -> tuple[int, ...]:
    """``MeshShape`` → ``(replicate, ranks per shard group)``; ``None`` → ``(world size,)``."""
    if mesh_shape is None:
        return (world_size(),)
    if hasattr(mesh_shape, "replicate") and hasattr(mesh_shape, "shard"):
        return (int(mesh_shape.replicate), int(getattr(mesh_shape, "shard_group", mesh_shape.shard)))
    return tuple(int(x) for x in mesh_shape)


class Checkpointer:
    """Saves and loads checkpoints of a sharded model; every rank calls every method.

    Args:
        async_save: write shards in a background thread while training continues; the commit (manifest,
            rename) happens at the next save, load or :meth:`finalize`, where a failed write is raised on every rank.
        verify_checksums: check the checksum of every byte a load reads (sizes are always checked).
        verify_before_load: check every file's checksums in a pass before any state changes (two reads of every
            byte), instead of each entry as it is read.
    """

    def __init__(self, async_save: bool = False, verify_checksums: bool = True, verify_before_load: bool = False) -> None:
        self.async_save = bool(async_save)
        self.verify_checksums = bool(verify_checksums)
        self.verify_before_load = bool(verify_before_load)
        self._pending: Optional[_PendingSave] = None
        self._async_group: Optional[dist.ProcessGroup] = None

    # -- what goes into a checkpoint ----------------------------------------------------------------------------------
    @staticmethod
    def model_state_dict(model: nn.Module, full: bool) -> dict[str, Any]:
        """The model's state: its shards (DTensors) for a sharded save, gathered on rank 0's CPU for a full one."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_options(full))

    @staticmethod
    def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_options(full))

    # -- save ---------------------------------------------------------------------------------------------------------
    def save(self, checkpoint: Mapping[str, Any], path: Path, mesh_shape: Optional[MeshShape], full: bool) -> None:
        """A checkpoint directory (every rank writes its shards) or, with ``full``, one ``.ckpt`` from rank 0."""
        (self.save_full if full else self.save_sharded)(checkpoint, path, mesh_shape=mesh_shape)

    def save_sharded(self, checkpoint: Mapping[str, Any], path: Path, mesh_shape: Optional[MeshShape] = None) -> None:
        """Write ``checkpoint`` (with DTensor model/optimizer state) as a checkpoint directory at ``path``."""
        path = Path(path)
        self._commit_pending()
        save = sharded.stage(checkpoint, path, mesh_tuple(mesh_shape))
        if self.async_save and is_distributed():
            future = sharded.write_shards(save, async_group=self._group_for_async())
            assert future is not None
            self._pending = _PendingSave(future, save, time.time())
            return
        sharded.write_shards(save)
        sharded.commit(save)

    def save_full(self, checkpoint: Mapping[str, Any], path: Path, mesh_shape: Optional[MeshShape] = None) -> None:
        """Rank 0 writes one ordinary Lightning ``.ckpt`` (full tensors, integer-keyed optimizer state)."""
        self._commit_pending()
        full.save(checkpoint, Path(path))

    def _group_for_async(self) -> dist.ProcessGroup:
        """Background writes need their own (gloo) group: collectives must not interleave with training's."""
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return

        def wait() -> None:
            response = pending.future
            future = response if isinstance(response, Future) else response.upload_completion
            future.result()

        try:
            agreed(
                wait,
                f"Writing the shards of checkpoint {pending.save.target} (async)",
                on_error=pending.save.cleanup,
                hint=SAVE_HINT,
            )
            sharded.commit(pending.save)
        except CheckpointError:
            if pending.removals:
                log.warning(
                    "Not removing %s: the checkpoint that replaces them failed.", [str(p) for p in pending.removals]
                )
            raise
        log.debug("checkpoint %s committed %.1fs after the save started", pending.save.target, time.time() - pending.started)
        for path in pending.removals:
            self._remove_now(path)

    def finalize(self) -> None:
        """Commit a pending async save (every rank, at teardown). Skipped while an exception is propagating:
        the other ranks may not reach this point, and a collective would hang."""
        if self._pending is None:
            return
        if sys.exc_info()[0] is not None:
            log.warning(
                "An exception is propagating: the async checkpoint %s was not committed (it is not a checkpoint;"
                " the next save in that directory deletes it).",
                self._pending.save.target,
            )
            self._pending = None
            return
        self._commit_pending()

    # -- remove -------------------------------------------------------------------------------------------------------
    def remove(self, path: Path) -> None:
        """Delete a checkpoint (file operations on rank 0). While an async save is pending, deferred until it commits."""
        path = Path(path)
        if self._pending is not None:
            self._pending.removals.append(path)
            return
        self._remove_now(path)

    @staticmethod
    def _remove_now(path: Path) -> None:
        if rank() != 0:
            return
        try:
            commit_ops.remove(path)
        except OSError as err:
            warnings.warn(f"Could not remove the old checkpoint {path}: {err}. Delete it by hand.", stacklevel=3)

    # -- load ---------------------------------------------------------------------------------------------------------
    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        strict: bool = True,
        resolve_base: Optional[BaseResolver] = None,
        model_entries: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Restore ``model`` (and ``optimizers``) in place from a sharded directory or a full ``.ckpt`` file.

        Returns the rest of the Lightning checkpoint (epoch, loops, callbacks, schedulers, hyper-parameters, ...).
        ``resolve_base`` restores the frozen base weights a sharded checkpoint refers to (see ``base_weights``);
        ``model_entries`` names entries keyed like the model (an EMA's) to return, resharded like the model.
        """
        path = Path(path)
        self._commit_pending()

        def detect() -> str:
            if not path.exists():
                commit_ops.recover(path.parent, {path.name}, delete_leftovers=False)
            if path.is_dir():
                return "dir"
            if path.is_file():
                return "file"
            if path.exists():
                raise CheckpointError(f"{path} is {kind_of(os.stat(path).st_mode)}, not a checkpoint; refusing to read it.")
            raise CheckpointError(
                f"Checkpoint {path} does not exist. Check the path (or {current_wording().start_fresh} to start fresh)."
            )

        kind = broadcast_object(agreed(on_rank_zero(detect), f"Loading checkpoint {path}"))
        options = LoadOptions(strict, self.verify_checksums, tuple(model_entries), resolve_base, self.verify_before_load)
        return (sharded_load if kind == "dir" else full).load(path, model, list(optimizers), options)
