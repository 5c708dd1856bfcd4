"""The package's one on-disk cache: where it lives, and how an entry is built once and appears whole or not at all.

Prepared data sets (SFT rows, preference pairs, GRPO prompts) and GGUF conversions are all cache entries: a folder
named by a key over everything that decides its content, under ``$LIGHTNING_FSDP_CACHE`` (default
``~/.cache/lightning_fsdp``). :func:`build_once` writes an entry into a hidden sibling folder and renames it into
place when complete, so a crash leaves no half entry, and two processes building the same key at once both end with
one whole entry (the second rename loses, and its identical copy is dropped).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["CACHE_ENV", "build_once", "cache_root"]

#: where every cache entry is kept (default ``~/.cache/lightning_fsdp``)
CACHE_ENV = "LIGHTNING_FSDP_CACHE"


def cache_root(kind: Optional[str] = None) -> Path:
    """The cache folder, or its ``kind`` sub-folder (``"sft"``, ``"preference"``, ``"prompts"``, ``"gguf"``)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_fsdp").expanduser()
    return root / kind if kind else root


def build_once(target: Union[str, Path], build: Callable[[Path], None], *, complete: str, force: bool = False) -> Path:
    """``target`` as ``build(folder)`` writes it, unless a complete entry is there already (it holds the file
    ``complete``, which ``build`` writes last). ``force`` rebuilds an existing entry."""
    target = Path(target)
    if (target / complete).exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        build(staging)
        if not (staging / complete).exists():
            raise RuntimeError(f"building the cache entry {target} wrote no {complete}")
        if force and target.exists():
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:  # another process renamed its entry into place first: the same content, kept
            if not (target / complete).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
