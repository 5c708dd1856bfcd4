"""Atomic commit of a checkpoint (a directory or a file) on a local/POSIX file system, and crash recovery.

A checkpoint is written under a hidden staging name in the same parent directory, then renamed into place.
Hidden names (``.staging-<token>-<name>``) can never match a checkpoint pattern such as Lightning's
``last*.ckpt``. Replacing an existing checkpoint uses ``renameat2(RENAME_EXCHANGE)`` where the file system has it
(the target name is never missing); otherwise the old one is first moved aside to ``.replaced-<token>-<name>``.

Recovery rules (:func:`recover`), applied by the next save or load in that directory:

- the target exists → any staging/replaced/trash entry for it is garbage and is deleted;
- the target is missing and a replaced copy exists (a crash between the two renames) → if the staging entry of
  the same token is complete (has a manifest) it is renamed in (roll forward), else the old one is restored.

Everything here runs on one process (rank 0 in a distributed job) and needs no process group.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

STAGING = "staging"
REPLACED = "replaced"
TRASH = "trash"
_ENTRY = re.compile(r"^\.(staging|replaced|trash)-([0-9a-f]{12})-(.+)$")


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_path(target: Path, kind: str, token: str) -> Path:
    """The hidden sibling of ``target`` used while it is written (``kind="staging"``), replaced or deleted."""
    return target.parent / f".{kind}-{token}-{target.name}"


@dataclass(frozen=True)
class TempEntry:
    kind: str
    token: str
    target_name: str
    path: Path


def parse_temp_entry(path: Path) -> Optional[TempEntry]:
    m = _ENTRY.match(path.name)
    return TempEntry(m.group(1), m.group(2), m.group(3), path) if m else None


# -- durability ---------------------------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directory entries: creations and renames)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # pragma: no cover - e.g. directories cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    except OSError as err:  # pragma: no cover - some file systems do not support fsync on directories
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# -- rename primitives --------------------------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; ``False`` if the OS or file system cannot (the caller falls back)."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b} failed: {os.strerror(err)}")


def delete(path: Path) -> None:
    """Remove a file or a directory tree; a missing path is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=False)
    elif path.exists() or path.is_symlink():
        path.unlink()


# -- commit -------------------------------------------------------------------------------------------------------------
def commit(staging: Path, target: Path, *, use_exchange: Optional[bool] = None) -> None:
    """Make the complete ``staging`` entry visible as ``target``, replacing what was there, then delete the old.

    ``staging`` must already be durable (fsynced). ``use_exchange=None`` uses ``RENAME_EXCHANGE`` when
    available; ``False`` forces the move-aside fallback (also what other platforms get).
    """
    staging, target = Path(staging), Path(target)
    entry = parse_temp_entry(staging)
    if entry is None or entry.kind != STAGING or entry.target_name != target.name or staging.parent != target.parent:
        raise ValueError(f"{staging} is not a staging entry for {target}.")
    if not target.exists() and not target.is_symlink():
        os.rename(staging, target)
        fsync_path(target.parent)
        return
    if use_exchange is not False and exchange(staging, target):
        fsync_path(target.parent)
        delete(staging)  # now holds the old checkpoint
        return
    replaced = temp_path(target, REPLACED, entry.token)
    os.rename(target, replaced)
    fsync_path(target.parent)
    # a crash here leaves `replaced` + complete `staging`: `recover` rolls forward
    os.rename(staging, target)
    fsync_path(target.parent)
    delete(replaced)


@contextmanager
def staged(target: Path, token: Optional[str] = None, *, directory: bool = False) -> Iterator[Path]:
    """Write ``target`` through a hidden sibling: yields the staging path (a fresh directory with ``directory``;
    for a file, the writer creates it and fsyncs it), then makes the directory durable and commits it onto
    ``target``; on any error the staging entry is deleted and ``target`` is left as it was. Every writer of a whole
    file or directory (full ``.ckpt``, ``consolidate``, the HF/PEFT export) goes through here; the sharded save
    stages and commits across ranks with the same ``temp_path``/``commit``/``delete``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_path(target, STAGING, token or new_token())
    try:
        if directory:
            staging.mkdir()
        yield staging
        if directory:
            fsync_path(staging)
        commit(staging, target)
    except BaseException:
        delete(staging)
        raise


def remove(target: Path) -> None:
    """Delete a checkpoint so that a crash midway never leaves a partial one under its name."""
    target = Path(target)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink():
        trash = temp_path(target, TRASH, new_token())
        os.rename(target, trash)
        fsync_path(target.parent)
        delete(trash)
    else:
        target.unlink()
        fsync_path(target.parent)


def is_complete(path: Path) -> bool:
    """A staged entry is complete when it is a file (written then renamed) or a directory with a manifest."""
    path = Path(path)
    return path.is_file() or (path / MANIFEST_NAME).is_file()


def recover(parent: Path, names: Optional[set[str]] = None, *, delete_leftovers: bool = True) -> list[str]:
    """Repair interrupted commits and delete leftovers in ``parent``; returns what was done (for the log).

    ``names`` limits the work to those checkpoint names. A reader (load) passes ``delete_leftovers=False``: a
    staging entry may belong to another job that is saving into the same directory right now.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    entries = [e for e in (parse_temp_entry(p) for p in parent.iterdir()) if e is not None]
    if names is not None:
        entries = [e for e in entries if e.target_name in names]
    actions: list[str] = []
    by_target: dict[str, list[TempEntry]] = {}
    for e in entries:
        by_target.setdefault(e.target_name, []).append(e)
    for name, group in sorted(by_target.items()):
        target = parent / name
        if not target.exists():
            replaced = sorted((e for e in group if e.kind == REPLACED), key=lambda e: e.path.stat().st_mtime)
            for old in reversed(replaced):
                staged = temp_path(target, STAGING, old.token)
                if staged.exists() and is_complete(staged):
                    os.rename(staged, target)
                    actions.append(f"completed the interrupted commit of {target}")
                else:
                    os.rename(old.path, target)
                    actions.append(f"restored {target} after an interrupted commit")
                fsync_path(parent)
                break
        if not delete_leftovers:
            continue
        for e in group:
            if e.path.exists() or e.path.is_symlink():
                delete(e.path)
                actions.append(f"deleted leftover {e.path.name}")
    for action in actions:
        log.warning("checkpoint recovery: %s", action)
    return actions
