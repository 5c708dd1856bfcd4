"""Fabric's checkpoint state (``{"model": m, "optimizer": o, "step": n, ...}``) ↔ the checkpoint directory.

Both front ends write the same verified, atomic, reshardable directory through
:class:`~lightning_fsdp.checkpoint.Checkpointer`, in the layout :mod:`lightning_fsdp.checkpoint.schema` names: the
model's shards under ``state_dict`` and the optimizers' under ``optimizer_states``, as the Trainer does. What is
Fabric's own goes into one plain entry, :data:`FABRIC_ENTRY`: the names the model and optimizers had in ``state``,
and every other entry (``state_dict()`` of objects that have one, plain values as they are). So ``consolidate``,
``verify`` and ``inspect`` read a Fabric checkpoint as they read a Trainer one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.formatting import short_list

#: the checkpoint entry holding Fabric's names and its state's other entries
FABRIC_ENTRY = SCHEMA.fabric
#: entries the package writes for itself (export's description of the HF model), not handed back to the loop
INTERNAL = (SCHEMA.hf_model,)
#: checkpoint keys the Trainer's layout uses; a Fabric state entry of that name would be ambiguous
RESERVED = (SCHEMA.model, SCHEMA.optimizers, FABRIC_ENTRY)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class FabricState:
    """A ``state`` dict sorted by what the checkpoint does with each entry."""

    model_name: str
    model: nn.Module
    optimizers: dict[str, Optimizer] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, state: Mapping[str, Any], what: str) -> FabricState:
        """``what`` (``"fabric.save"``/``"fabric.load"``) names the call in errors."""
        modules = [name for name, obj in state.items() if isinstance(obj, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"{what} with the fsdp_custom strategies takes exactly one model in `state`, found"
                f" {len(modules)} ({short_list(modules) if modules else 'none'}). Put the model under one key, e.g."
                ' {"model": model, "optimizer": optimizer, "step": step}.'
            )
        reserved = [name for name in state if name in RESERVED]
        if reserved:
            raise ValueError(f"{what}: `state` keys {short_list(reserved)} are reserved by the checkpoint; rename them.")
        sorted_state = cls(modules[0], state[modules[0]])
        for name, obj in state.items():
            if name == modules[0]:
                continue
            if isinstance(obj, Optimizer):
                sorted_state.optimizers[name] = obj
            elif _is_stateful(obj):
                sorted_state.stateful[name] = obj
            else:
                sorted_state.plain[name] = obj
        return sorted_state

    def entries(self) -> dict[str, Any]:
        """What :data:`FABRIC_ENTRY` holds besides the names."""
        return {**{n: o.state_dict() for n, o in self.stateful.items()}, **self.plain}


def to_checkpoint(state: FabricState, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint dict the :class:`~lightning_fsdp.checkpoint.Checkpointer` writes."""
    return {
        SCHEMA.model: model_state,
        SCHEMA.optimizers: optimizer_states,
        FABRIC_ENTRY: {"model": state.model_name, "optimizers": list(state.optimizers), "entries": state.entries()},
    }


def restore_entries(state: FabricState, target: dict[str, Any], rest: dict[str, Any], path: Path, strict: bool) -> dict[str, Any]:
    """After the model and optimizers are restored: every other ``state`` entry from the checkpoint (objects via
    ``load_state_dict``, plain values replaced in ``target``). Returns what the checkpoint holds that ``state`` did
    not ask for. ``strict``: an entry of ``state`` the checkpoint lacks is an error naming it."""
    for key in INTERNAL:
        rest.pop(key, None)
    saved = rest.pop(FABRIC_ENTRY, None)
    entries = dict(saved["entries"]) if isinstance(saved, Mapping) else {}
    requested = [*state.stateful, *state.plain]
    missing = [name for name in requested if name not in entries]
    if strict and missing:
        raise KeyError(
            f"Checkpoint {path} has no {short_list(missing)} (it holds {short_list(sorted(entries)) if entries else 'no other entries'})."
            " Pass strict=False to restore the rest."
        )
    for name, obj in state.stateful.items():
        if name in entries:
            obj.load_state_dict(entries.pop(name))
    for name in state.plain:
        if name in entries:
            target[name] = entries.pop(name)
    return {**rest, **entries}
