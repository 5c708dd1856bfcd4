"""Frozen pretrained weights a sharded checkpoint refers to instead of storing them (LoRA on a 70B base: megabytes
per save instead of 140 GB).

A checkpoint saved while the frozen parameters came from ``pretrained_weights`` records a :class:`BaseReference`
(the source's identity: path, index hash, every file's size and CRC-32; and which model keys it supplies) and stores
everything else. On load the strategy's resolver makes the model hold exactly those weights again, or raises a
:class:`~lightning_fsdp.checkpoint.CheckpointError` when the source is missing or changed: a resumed run never
silently mixes a new base with old adapters.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.formatting import short_list
from lightning_fsdp.sharding.quantize import SETTINGS, QuantizedBase


@dataclass(frozen=True)
class BaseReference:
    """Where the frozen base comes from (``identity``), which model keys it supplies, how keys map to its files.

    The strategy keeps one for the base it loaded from ``pretrained_weights``; a checkpoint records the part of it
    whose parameters stayed frozen (:meth:`only`)."""

    identity: dict[str, Any]
    keys: tuple[str, ...]
    key_map: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return str(self.identity.get("path", ""))

    def only(self, keys: Collection[str]) -> Optional[BaseReference]:
        """The same base supplying just those of its keys in ``keys`` (``None``: none of them)."""
        wanted = set(keys)
        kept = tuple(k for k in self.keys if k in wanted)
        return BaseReference(self.identity, kept, self.key_map) if kept else None

    def to_dict(self) -> dict[str, Any]:
        return {"identity": self.identity, "keys": list(self.keys), "key_map": dict(self.key_map)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: Path) -> BaseReference:
        try:
            return cls(dict(data["identity"]), tuple(str(k) for k in data["keys"]), dict(data.get("key_map") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: its reference to pretrained base weights is malformed ({err}).") from None


#: makes the model hold the referenced base weights (loading them if needed), or raises a CheckpointError
BaseResolver = Callable[[BaseReference], None]


def pop_reference(meta: dict[str, Any], where: Path) -> Optional[BaseReference]:
    data = meta.pop(SCHEMA.pretrained_base, None)
    return BaseReference.from_dict(data, where) if data is not None else None


#: a resolver, or another function of the reference (``consolidate`` reads the base weights through one)
R = TypeVar("R", bound=Callable[[BaseReference], object])


def require_resolver(reference: BaseReference, resolver: Optional[R], where: Path) -> R:
    if resolver is None:
        raise CheckpointError(
            f"{where} stores only the trainable weights: its {len(reference.keys)} frozen base weights come from"
            f" {reference.path}. Load it with the strategy that trained it (`pretrained_weights={reference.path!r}`),"
            " or consolidate it with `lightning-fsdp consolidate`, which reads the base too."
        )
    return resolver


# -- a quantized base (QLoRA) -------------------------------------------------------------------------------------------
def leave_out_quantized(checkpoint: dict[str, Any], quantized: QuantizedBase) -> None:
    """Before a save: quantized weights never go into a checkpoint (they are re-quantized from the base files, or
    from the model as built, on resume); record which they were and how they were quantized."""
    names = set(quantized.names)
    state = checkpoint.get(SCHEMA.model, {})
    checkpoint[SCHEMA.model] = {k: v for k, v in state.items() if k not in names}
    checkpoint[SCHEMA.quantized_base] = quantized.to_dict()


def pop_quantized(meta: dict[str, Any], where: Path) -> Optional[QuantizedBase]:
    data = meta.pop(SCHEMA.quantized_base, None)
    if data is None:
        return None
    try:
        return QuantizedBase.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: its record of the quantized base is malformed ({err}).") from None


def check_quantization(where: Path, saved: Optional[QuantizedBase], current: Collection[str]) -> None:
    """The base must be held as it was in training: the same weights quantized the same way (``current``: the
    model's quantized parameter names). Adapters trained on one base would otherwise continue on another."""
    current = set(current)
    if saved is None and current:
        raise CheckpointError(
            f"{where} was trained on a base held in full precision, but this run quantizes {len(current)} base weights"
            " (`quantize_base`). Resume it without `quantize_base`, or start the quantized run from the pretrained"
            " weights instead of this checkpoint."
        )
    if saved is None:
        return
    fix = f"Resume with `quantize_base={saved.method!r}`"
    if saved.settings != SETTINGS:
        raise CheckpointError(
            f"{where} was trained on a base quantized with {saved.settings}; this version quantizes with {SETTINGS}."
            " Resume it with the version that trained it."
        )
    if not current:
        raise CheckpointError(
            f"{where} was trained on a base quantized with {saved.method!r} ({len(saved.names)} weights), but this run"
            f" holds the base in full precision. {fix}."
        )
    if set(saved.names) != current:
        differ = sorted(set(saved.names) ^ current)
        raise CheckpointError(
            f"{where} was trained with other base weights quantized than this run holds quantized: {short_list(differ)}"
            f" differ (a weight stays unquantized when its shards would split a block of"
            f" {saved.settings.get('block_size', 64) * saved.settings.get('scaler_block_size', 256)} elements, which"
            f" depends on the number of shards). {fix} on a world size whose shards hold whole blocks for the same"
            " weights."
        )
