"""How a checkpoint is loaded, whatever its format: one value the checkpointer builds and each format's ``load`` reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_fsdp.checkpoint.base_weights import BaseResolver


@dataclass(frozen=True)
class LoadOptions:
    """``strict``: every saved key must match the model's; ``checksums``: bytes are checked against the manifest (or
    the archive's CRCs) as they are read; ``model_entries``: entries keyed like the model (an EMA's) to return,
    resharded like it; ``resolve_base`` restores the frozen base a sharded checkpoint refers to; ``verify_before_load``
    hashes every file of a sharded checkpoint before any state changes."""

    strict: bool = True
    checksums: bool = True
    model_entries: Sequence[str] = ()
    resolve_base: Optional[BaseResolver] = None
    verify_before_load: bool = False
