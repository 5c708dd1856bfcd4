"""Policies: which submodules become FSDP units (or are activation-checkpointed), normalised to one form.

The same forms are accepted for the wrap policy and the activation-checkpointing policy:

- ``"auto"``: the model's repeated blocks, found without the user naming anything: classes listed in any
  module's ``_no_split_modules`` (the Hugging Face convention), else the children of every ``nn.ModuleList`` /
  ``nn.Sequential`` that holds two or more modules of one class (the layers of a transformer).
- a set (or list) of module classes, or of class names as strings (so YAML can name them; a bare ``"Block"``
  or a qualified ``"my_pkg.model.Block"``).
- an ``int``: size-based, a module becomes a unit once it holds at least this many parameters not already
  inside a smaller unit.
- a callable ``fn(module) -> bool``.
- ``None`` / ``False``: no units below the root.

:func:`validate_policy` checks the form alone (in the strategy's constructor, before the model exists);
:func:`resolve_policy` turns a valid policy into a :class:`UnitPolicy` for one model: a predicate over a module and
the number of its parameters not yet inside a smaller unit. Every form becomes that one predicate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Union

from torch import nn

WrapPolicy = Union[str, int, Callable[[nn.Module], bool], Iterable[Union[type, str]], None, bool]

AUTO = "auto"


@dataclass(frozen=True)
class UnitPolicy:
    """A resolved policy: ``matches(module, unwrapped_params)`` says whether ``module`` becomes a unit, given how many
    of its parameters are not already inside a smaller unit. ``auto``: found by ``"auto"``, so matching nothing is
    not the user's error."""

    matches: Callable[[nn.Module, int], bool]
    auto: bool = False


def validate_policy(policy: WrapPolicy, arg_name: str = "auto_wrap_policy") -> None:
    """Raise ``ValueError``/``TypeError`` naming ``arg_name`` if ``policy`` is not one of the accepted forms."""
    if policy is None or policy is False or policy == AUTO:
        return
    if isinstance(policy, str):
        raise ValueError(
            f"`{arg_name}={policy!r}` is not a known policy. Use 'auto', a set of module classes or class names"
            " (e.g. {'TransformerBlock'}), a minimum parameter count (int), a callable, or None."
        )
    if isinstance(policy, bool):  # True
        raise TypeError(f"`{arg_name}=True` is ambiguous; use 'auto' or name the module classes.")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"`{arg_name}={policy}`: a minimum parameter count must be >= 1.")
        return
    if isinstance(policy, type):
        if not issubclass(policy, nn.Module):
            raise TypeError(f"`{arg_name}` must hold nn.Module classes or class names, got {[policy]!r}.")
        return
    if callable(policy):
        return
    if isinstance(policy, Iterable):
        items = list(policy)
        if not items:
            raise ValueError(f"`{arg_name}` is an empty collection; use None for no units below the root.")
        bad = [c for c in items if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))]
        if bad:
            raise TypeError(f"`{arg_name}` must hold nn.Module classes or class names, got {bad!r}.")
        return
    raise TypeError(f"`{arg_name}` of type {type(policy).__name__} is not supported: {policy!r}.")


def resolve_policy(policy: WrapPolicy, model: nn.Module, *, arg_name: str = "auto_wrap_policy") -> UnitPolicy | None:
    """The :class:`UnitPolicy` of ``policy`` for ``model``; ``None`` for no units below the root (or "auto" finding
    no repeated blocks)."""
    validate_policy(policy, arg_name)
    if policy is None or policy is False:
        return None
    if policy == AUTO:
        classes = tuple(find_repeated_block_classes(model))
        return UnitPolicy(lambda module, _n: isinstance(module, classes), auto=True) if classes else None
    if isinstance(policy, int):
        minimum = int(policy)
        return UnitPolicy(lambda _module, unwrapped: unwrapped >= minimum)
    if isinstance(policy, type):
        policy = {policy}
    if callable(policy):
        fn = policy
        return UnitPolicy(lambda module, _n: bool(fn(module)))
    items = list(policy)
    classes = tuple(c for c in items if isinstance(c, type))
    names = frozenset(c for c in items if isinstance(c, str))
    return UnitPolicy(lambda module, _n: isinstance(module, classes) or class_matches(module, names))


def class_matches(module: nn.Module, names: frozenset[str]) -> bool:
    """``module``'s class is named in ``names``, bare (``"Block"``) or qualified (``"pkg.model.Block"``)."""
    cls = type(module)
    return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def find_repeated_block_classes(model: nn.Module) -> set[type]:
    """The classes of the model's repeated blocks (see the module docstring for the rule)."""
    no_split: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            no_split.update(declared)
    if no_split:
        found = {type(m) for m in model.modules() if type(m).__name__ in no_split}
        if found:
            return found
    blocks: set[type] = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(child) for child in module.children())
            blocks.update(cls for cls, n in counts.items() if n >= 2 and _has_parameters_type(cls, module))
    return blocks


def _has_parameters_type(cls: type, container: nn.Module) -> bool:
    """Only blocks that own parameters are worth a unit (not e.g. repeated ``nn.ReLU``)."""
    return any(isinstance(c, cls) and any(True for _ in c.parameters()) for c in container.children())
