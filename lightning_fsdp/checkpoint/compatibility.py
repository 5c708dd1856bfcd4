"""Does saved state fit the model? Keys, dtypes and shapes compared once, for checkpoints and pretrained weights.

Every loader describes what it holds as ``{name: (dtype, shape)}`` and calls :func:`check_fits` against the current
tensors before anything is changed. A mismatch is a :class:`CheckpointError` naming the keys and the fix; with
``strict=False`` missing and unexpected keys are a warning instead. Dtypes are never cast silently: a checkpoint
refuses another dtype, pretrained weights may convert with a notice (``dtype_mismatch="convert"``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.fixes import current_wording
from lightning_fsdp.formatting import short_list

Described = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
DtypeMismatch = Literal["error", "convert"]


@dataclass(frozen=True)
class Fit:
    """What :func:`check_fits` found: keys only one side has, and the keys stored in another dtype (converted)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)


def describe(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, global shape)}`` of tensors (DTensors report their unsharded shape)."""
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def check_fits(
    where: Union[Path, str],
    saved: Described,
    current: Described,
    *,
    strict: bool,
    what: str = "model",
    source: str = "checkpoint",
    dtype_mismatch: DtypeMismatch = "error",
    missing_fix: str = "",
) -> Fit:
    """Compare ``saved`` (what ``source`` at ``where`` holds) with ``current``; raise a :class:`CheckpointError`
    naming every problem, or return the fit. ``missing_fix`` replaces the advice for missing/unexpected keys."""
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if strict and (missing or unexpected):
        fix = missing_fix or (
            f"Load the checkpoint of this model, or {current_wording().load_matching_keys} to load the keys that match."
        )
        raise CheckpointError(
            f"{where} does not match the {what}: missing keys {short_list(missing)}, unexpected keys"
            f" {short_list(unexpected)}. {fix}"
        )
    shapes, dtypes = [], []
    for key in sorted(set(saved) & set(current)):
        (saved_dtype, saved_shape), (dtype, shape) = saved[key], current[key]
        if tuple(saved_shape) != tuple(shape):
            shapes.append(f"{key}: {source} shape {tuple(saved_shape)}, {what} {tuple(shape)}")
        elif saved_dtype != dtype:
            dtypes.append(
                f"{key} ({saved_dtype} -> {dtype})"
                if dtype_mismatch == "convert"
                else f"{key}: {source} {saved_dtype}, {what} {dtype}"
            )
    if shapes:
        raise CheckpointError(
            f"{where} does not fit the {what} ({len(shapes)} tensor(s) of another shape): {short_list(shapes)}."
            " Tensors are never reshaped: use the same model configuration as when it was saved."
        )
    if dtypes and dtype_mismatch == "error":
        raise CheckpointError(
            f"{where} does not fit the {what} ({len(dtypes)} tensor(s) of another dtype): {short_list(dtypes)}."
            " Tensors are never cast silently: use the same precision and model configuration as when the"
            " checkpoint was saved."
        )
    if not strict and (missing or unexpected):
        warnings.warn(
            f"Loading {where} non-strictly: {what} keys not in it {short_list(missing)} keep their current values;"
            f" its keys not in the {what} {short_list(unexpected)} are ignored.",
            stacklevel=3,
        )
    return Fit(missing, unexpected, dtypes)


def check_entry_fits(where: Union[Path, str], saved: Described, model: Described, *, what: str) -> None:
    """An entry keyed like the model (``ShardedEMA``'s average): every key it holds must be a model key with the
    same dtype and shape; model keys it lacks are fine (the average covers only the trainable tensors)."""
    unknown = sorted(set(saved) - set(model))
    if unknown:
        raise CheckpointError(
            f"{where}: its {what!r} holds {short_list(unknown)}, which the current model does not have. Load it into"
            " the model it was saved from (or drop the entry in `on_load_checkpoint`)."
        )
    check_fits(where, saved, {k: model[k] for k in saved}, strict=True, what=what)


def check_count(where: Path, saved: Sequence[object], current: Sequence[object]) -> None:
    """The checkpoint holds state for as many optimizers as the model configures."""
    if len(saved) != len(current):
        raise CheckpointError(
            f"{where} holds {len(saved)} optimizer state(s), the model configures {len(current)}."
            " Return the same optimizers from `configure_optimizers` as when the checkpoint was saved."
        )
