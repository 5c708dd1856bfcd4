"""What every part of the compat module shares: the tested version, the loud fallback and the probe registry."""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable

import torch

#: the version every internal in this package was checked against
TESTED_TORCH = "2.13"


class FastPathLost(RuntimeWarning):
    """An internal this package optimises with is not where the tested torch had it."""


#: the fast paths already reported lost in this process
WARNED: set[str] = set()

#: each fast path's name → a check that the installed torch provides it as this package expects
PROBES: dict[str, Callable[[], bool]] = {}


def warn_lost(name: str, what_is_lost: str, detail: str = "") -> None:
    """Warn once per process that the fast path ``name`` is unavailable, and what that costs."""
    if name in WARNED:
        return
    WARNED.add(name)
    warnings.warn(
        f"lightning_fsdp: the fast path {name!r} is unavailable with torch {torch.__version__} (written for torch"
        f" {TESTED_TORCH}): {what_is_lost}."
        f" Training stays correct.{' ' + detail if detail else ''} Please report it with these versions.",
        FastPathLost,
        stacklevel=3,
    )


def requirement(name: str, feature: str, error: BaseException) -> ImportError:
    """The error a feature raises when an internal it cannot work without has moved."""
    return ImportError(
        f"{feature} needs {name}, which torch {torch.__version__} does not provide in the form this package was"
        f" written for (torch {TESTED_TORCH}): {type(error).__name__}: {error}. Pin torch=={TESTED_TORCH}.* or report"
        " it with your versions."
    )


def has(module: str, *names: str) -> bool:
    try:
        return all(hasattr(importlib.import_module(module), n) for n in names)
    except ImportError:
        return False


@functools.lru_cache(maxsize=1)
def fast_paths() -> dict[str, bool]:
    """Each fast path by name → whether the installed torch provides it as this package expects."""
    return {name: bool(probe()) for name, probe in PROBES.items()}
