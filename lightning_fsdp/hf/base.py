"""The pretrained base a run loaded, and what its checkpoints record about it.

:func:`loaded_base` describes the base the strategy loaded from ``pretrained_weights`` (a
:class:`~lightning_fsdp.checkpoint.base_weights.BaseReference`). Its sharded checkpoints then leave out the
parameters that came from the base and stayed frozen (a LoRA fine-tune), and record that part of the reference
instead; :func:`resolve_base` makes a model hold those weights again on resume, refusing a base that is missing or
changed. A full fine-tune trains every parameter, so nothing is left out and its checkpoints stand alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

from lightning_fsdp.checkpoint.base_weights import BaseReference
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.checkpoint.sharded import agreed
from lightning_fsdp.formatting import short_list
from lightning_fsdp.hf.directory import HFDirectory, hash_directory, identity_differences
from lightning_fsdp.hf.load import LoadPlan, load_safetensors


def loaded_base(plan: LoadPlan, key_map: Optional[Mapping[str, str]]) -> BaseReference:
    """The base a run loaded from a safetensors directory: its identity and every model key it supplied (every
    rank; the files are hashed split over the ranks)."""
    identity = hash_directory(plan.directory, agreed)
    return BaseReference(identity, tuple(sorted(plan.file_key_of)), dict(key_map or {}))


def leave_out_base(checkpoint: dict[str, Any], model: nn.Module, base: BaseReference) -> None:
    """Before a sharded save: drop the frozen base parameters from ``checkpoint["state_dict"]`` and record where
    they come from."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    reference = base.only(frozen)
    if reference is None:
        return
    state = checkpoint.get(SCHEMA.model, {})
    checkpoint[SCHEMA.model] = {k: v for k, v in state.items() if k not in set(reference.keys)}
    checkpoint[SCHEMA.pretrained_base] = reference.to_dict()


def resolve_base(model: nn.Module, reference: BaseReference, loaded: Optional[BaseReference]) -> None:
    """Make ``model`` hold the base weights ``reference`` names (every rank). Nothing to do when this run loaded the
    same files; otherwise they are read again from the recorded path, after checking they did not change."""
    if loaded is not None and not identity_differences(reference.identity, loaded.identity):
        if set(reference.keys) <= set(loaded.keys):
            return

    def open_recorded() -> HFDirectory:
        try:
            return HFDirectory.open(reference.path)
        except CheckpointError as err:
            raise CheckpointError(
                f"The checkpoint stores only its trainable weights; its frozen base weights come from"
                f" {reference.path}, which cannot be read: {err} Restore that directory, or pass"
                " `pretrained_weights=` pointing at a copy with the same files."
            ) from None

    directory = agreed(open_recorded, f"Resolving the checkpoint's base weights {reference.path}")
    changed = identity_differences(reference.identity, hash_directory(directory, agreed))
    if changed:
        raise _changed(reference, changed)
    load_safetensors(model, reference.path, strict=True, key_map=reference.key_map or None, only=reference.keys)


def _changed(reference: BaseReference, changed: list[str]) -> CheckpointError:
    return CheckpointError(
        f"The frozen base weights the checkpoint was trained on, {reference.path}, have changed since it was saved:"
        f" {short_list(changed)}. Resuming would combine its adapters with other base weights. Point"
        " `pretrained_weights` at the original base model (a copy with the same files is fine)."
    )
