"""``torch.compile`` per FSDP unit, in the order that works: activation checkpointing → compile → ``fully_shard``.

Each unit's ``forward`` is replaced by its compiled version, so parameter names (and checkpoints) are unchanged —
no ``_orig_mod.`` — and the hooks of activation checkpointing and FSDP2 keep running eagerly around the compiled
region, where they expect to run. Identical blocks share one compiled graph (torch inlines built-in modules), so a
model compiles each distinct block once. The root stays eager unless ``{"root": True}``.

A block that cannot be compiled fails at its first forward with a :class:`CompileError` naming the block and the
fix, instead of a compiler traceback without context.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn

from lightning_fsdp._torch_compat import compile_errors

CompileArg = Union[bool, Mapping[str, Any], None]

#: ``torch.compile`` options accepted in a ``compile`` dict, plus ``root`` (compile the root unit's forward too)
TORCH_COMPILE_KEYS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options", "disable"})
OWN_KEYS = frozenset({"root"})


class CompileError(RuntimeError):
    """A unit's forward could not be compiled; the message names the unit and how to run it anyway."""


def compile_options(compile: CompileArg) -> dict[str, Any] | None:
    """``False``/``None`` → ``None`` (eager); ``True`` → ``{}``; a dict is checked key by key (YAML-friendly)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise TypeError(f"`compile` must be a bool or a dict of torch.compile options, got {type(compile).__name__}.")
    unknown = sorted(set(compile) - TORCH_COMPILE_KEYS - OWN_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown `compile` keys {unknown}; allowed: {sorted(TORCH_COMPILE_KEYS | OWN_KEYS)} (torch.compile's"
            " options, and `root` to compile the root unit too)."
        )
    return dict(compile)


def compile_units(model: nn.Module, unit_names: Iterable[str], compile: CompileArg) -> list[str]:
    """Compile the ``forward`` of each named unit (``""`` is the root: only with ``root``). Returns the names."""
    options = compile_options(compile)
    if options is None:
        return []
    with_root = bool(options.pop("root", False))
    names = [n for n in unit_names if n or with_root]
    modules = dict(model.named_modules())
    for name in names:
        _compile_forward(modules[name], name or type(model).__name__, options)
    return names


def _compile_forward(module: nn.Module, name: str, options: Mapping[str, Any]) -> None:
    compiled = torch.compile(module.forward, **options)
    errors = compile_errors()
    fullgraph = bool(options.get("fullgraph"))

    @functools.wraps(module.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except errors as err:
            fix = "drop `fullgraph` from the `compile` options, or set" if fullgraph else "set"
            raise CompileError(
                f"torch.compile could not compile the FSDP unit {name!r} ({type(module).__name__}):"
                f" {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}."
                f" To train anyway, {fix} compile=False (or leave this block out of the wrap policy)."
            ) from err

    module.forward = forward
