"""Crash-safe checkpoints for sharded models: parallel sharded saves with an atomic commit, verified and safe
loads at any world size, consolidation into one file, and pretrained weights into a sharded model.

Modules: :mod:`.checkpointer` (orchestration, async saves), :mod:`.sharded` and :mod:`.full` (the two formats),
:mod:`.compatibility` (keys, dtypes, shapes: one check for checkpoints and pretrained weights), :mod:`.manifest`
(sizes, checksums, provenance), :mod:`.commit` (atomic rename, crash recovery), :mod:`.safe_load` (no pickled code
runs), :mod:`.state` (pure transforms of the checkpoint dict), :mod:`.reader` (one way to open a checkpoint) and :mod:`.consolidate`
(one-process export), :mod:`.pretrained`.

==========================  =====================================================================================
:class:`Checkpointer`       save (sharded directory or full file), load (either, resharded), remove, finalize
:func:`verify_checkpoint`   manifest, sizes and checksums of a checkpoint directory (or CRCs of a ``.ckpt`` file)
:func:`consolidate_checkpoint`  sharded directory → one Lightning ``.ckpt`` or ``.safetensors`` (also a CLI)
:func:`load_pretrained`     full weights (rank 0 reads) into a sharded model
:func:`recover_directory`   repair interrupted commits in a checkpoint directory (saves and loads do it too)
:class:`CheckpointError`    every failure; the message names the file and the fix
==========================  =====================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from lightning_fsdp.checkpoint.checkpointer import Checkpointer
from lightning_fsdp.checkpoint.consolidate import consolidate_checkpoint
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import Manifest, read_manifest, verify_files
from lightning_fsdp.checkpoint.pretrained import LoadReport, load_pretrained


def verify_checkpoint(path: Union[str, Path], checksums: bool = True) -> Manifest | None:
    """Check a checkpoint without loading it (one process): a directory needs a valid manifest and every file
    at its size and checksum; a ``.ckpt`` file must be an intact archive. Raises :class:`CheckpointError`.

    Returns the manifest of a directory, ``None`` for a file.
    """
    from lightning_fsdp.checkpoint.full import check_zip

    path = Path(path)
    if path.is_file():
        check_zip(path, checksums)
        return None
    manifest = read_manifest(path)
    verify_files(path, manifest, checksums=checksums)
    return manifest


def recover_directory(dirpath: Union[str, Path]) -> list[str]:
    """Finish or roll back interrupted commits in ``dirpath`` and delete leftovers; returns what was done.

    Do not run it while a job is saving into ``dirpath``.
    """
    from lightning_fsdp.checkpoint.commit import recover

    return recover(Path(dirpath))


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LoadReport",
    "Manifest",
    "consolidate_checkpoint",
    "load_pretrained",
    "recover_directory",
    "verify_checkpoint",
]
