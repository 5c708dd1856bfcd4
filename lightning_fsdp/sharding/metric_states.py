"""torchmetrics ``Metric`` states through meta-device initialisation.

Metric states are not parameters: under the strategy's init contexts (``init_module(empty_init=True)``,
``configure_model``) they are created real, and materialisation leaves them alone (it touches meta tensors only).
A metric built inside a ``torch.device("meta")`` block holds meta states *and* meta reset defaults (``reset()``
restores those): their values are gone. Such a metric is rebuilt from its constructor arguments, which torchmetrics
keeps as attributes of the same names (``num_classes``, ``average``, ``nan_strategy`` …), on the CPU, checked state
by state against the meta one (names, shapes, dtypes, reductions, persistence); its states and defaults are taken
from that twin. A metric that cannot be rebuilt so is named in a ``TypeError`` before anything is allocated.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from lightning_fsdp._lightning_compat import metric_states, set_metric_defaults


def metric_class() -> Optional[type[nn.Module]]:
    """``torchmetrics.Metric`` if torchmetrics is imported already (never imports it)."""
    module = sys.modules.get("torchmetrics.metric")
    return getattr(module, "Metric", None) if module is not None else None


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta or isinstance(value, list) and any(map(_is_meta, value))


def plan_metric_states(model: nn.Module) -> list[Callable[[torch.device], None]]:
    """For every metric of ``model`` whose states are on the meta device, what restores them (call it with the
    device the metric computes on); a ``TypeError`` naming those that cannot be rebuilt."""
    cls = metric_class()
    if cls is None:
        return []
    restores, refused = [], []
    for name, module in model.named_modules():
        if not isinstance(module, cls):
            continue
        states = metric_states(module)
        if not any(_is_meta(default) or _is_meta(getattr(module, state)) for state, (default, _, _) in states.items()):
            continue
        twin, why = _twin(module, states)
        if twin is None:
            refused.append(f"{name or type(module).__name__} ({type(module).__name__}: {why})")
        else:
            restores.append(_restore(module, metric_states(twin)))
    if refused:
        raise TypeError(
            f"Metrics built inside `torch.device('meta')` hold no values in their states and reset defaults, and these"
            f" cannot be rebuilt from their constructor arguments: {', '.join(refused)}. Create metrics outside"
            " `torch.device('meta')`: under `trainer.init_module(empty_init=True)` and in `configure_model` the"
            " strategy keeps metric states real."
        )
    return restores


def _twin(metric: nn.Module, states: dict[str, tuple[Any, Any, bool]]) -> tuple[Optional[nn.Module], str]:
    """The metric built again on the CPU from its constructor arguments, if it has the same states."""
    kwargs = {}
    for param in list(inspect.signature(type(metric).__init__).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(metric, param.name):
            value = getattr(metric, param.name)
            if _is_meta(value):
                return None, f"its argument {param.name!r} is itself a meta tensor"
            kwargs[param.name] = value
        elif param.default is param.empty:
            return None, f"its argument {param.name!r} is not kept as an attribute"
    try:
        with torch.device("cpu"):
            twin = type(metric)(**kwargs)
    except Exception as err:  # any constructor error means: not rebuildable this way
        return None, f"rebuilding it failed: {type(err).__name__}: {err}"
    theirs = metric_states(twin)
    if theirs.keys() != states.keys():
        return None, f"rebuilt, it has the states {sorted(theirs)} instead of {sorted(states)}"
    for state, (default, reduction, persistent) in states.items():
        other, other_reduction, other_persistent = theirs[state]
        same = type(default) is type(other) and persistent == other_persistent and _same_fn(reduction, other_reduction)
        if same and isinstance(default, torch.Tensor):
            same = default.shape == other.shape and default.dtype == other.dtype
        if not same:
            return None, f"rebuilt, its state {state!r} differs"
    return twin, ""


def _same_fn(a: Any, b: Any) -> bool:
    return a is b or getattr(a, "__qualname__", repr(a)) == getattr(b, "__qualname__", repr(b))


def _restore(metric: nn.Module, twin_states: dict[str, tuple[Any, Any, bool]]) -> Callable[[torch.device], None]:
    defaults = {state: default for state, (default, _, _) in twin_states.items()}
    return lambda device: set_metric_defaults(metric, defaults, device)
