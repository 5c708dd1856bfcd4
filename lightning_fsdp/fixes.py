"""How a suggested fix is worded for the user's front end.

The lower layers know what is wrong (keys that do not match, a checkpoint that is not there, steps that overflow)
and which kind of fix helps; only the front end knows what its users call that setting: the Trainer's
``strict_loading = False`` is Fabric's ``fabric.load(..., strict=False)``. Each front end hands its
:class:`FixWording` to the runtime, which makes it current (:func:`worded_for`) around the work it delegates down,
so every rank's error, composed where the problem is found, already names the right setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class FixWording:
    """Each kind of fix, as a phrase that completes "... or <phrase> to ...". The defaults name no front end."""

    #: load only the keys that match (instead of refusing a model/checkpoint mismatch)
    load_matching_keys: str = "load non-strictly (strict=False)"
    #: do not resume, start from scratch
    start_fresh: str = "skip loading it"
    #: clip gradients
    clip_gradients: str = "enable gradient clipping"


_CURRENT: ContextVar[FixWording] = ContextVar("lightning_fsdp_fix_wording", default=FixWording())


def current_wording() -> FixWording:
    """The wording of the front end whose work is running now (the neutral one outside any)."""
    return _CURRENT.get()


@contextmanager
def worded_for(wording: FixWording) -> Iterator[None]:
    """Make ``wording`` current while the block runs."""
    token = _CURRENT.set(wording)
    try:
        yield
    finally:
        _CURRENT.reset(token)
