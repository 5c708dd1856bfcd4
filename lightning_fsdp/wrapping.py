"""Which modules become FSDP units, activation checkpointing, and the bottom-up ``fully_shard`` walk.

A *policy* says which submodules form their own FSDP unit (one all-gather / reduce-scatter each). The same
forms are accepted for the wrap policy and the activation-checkpointing policy:

- ``"auto"``: the model's repeated blocks, found without the user naming anything: classes listed in any
  module's ``_no_split_modules`` (the Hugging Face convention), else the children of every ``nn.ModuleList`` /
  ``nn.Sequential`` that holds two or more modules of one class (the layers of a transformer).
- a set (or list) of module classes, or of class names as strings (so YAML can name them; a bare ``"Block"``
  or a qualified ``"my_pkg.model.Block"``).
- an ``int``: size-based, a module becomes a unit once it holds at least this many parameters not already
  inside a smaller unit.
- a callable ``fn(module) -> bool``.
- ``None`` / ``False``: no units below the root.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

log = logging.getLogger(__name__)

WrapPolicy = Union[str, int, Callable[[nn.Module], bool], Iterable[Union[type, str]], None, bool]
ModulePredicate = Callable[[nn.Module], bool]

AUTO = "auto"


def _class_matches(module: nn.Module, names: frozenset[str]) -> bool:
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


def resolve_policy(policy: WrapPolicy, model: nn.Module, *, arg_name: str = "auto_wrap_policy") -> ModulePredicate | int | None:
    """Turn a user policy into a predicate over modules, a minimum parameter count, or ``None``.

    Raises ``ValueError``/``TypeError`` naming ``arg_name`` for anything it does not understand.
    """
    if policy is None or policy is False:
        return None
    if isinstance(policy, str):
        if policy != AUTO:
            raise ValueError(
                f"`{arg_name}={policy!r}` is not a known policy. Use 'auto', a set of module classes or class names"
                " (e.g. {'TransformerBlock'}), a minimum parameter count (int), a callable, or None."
            )
        classes = find_repeated_block_classes(model)
        if not classes:
            return None
        return lambda module: isinstance(module, tuple(classes))
    if isinstance(policy, bool):  # True
        raise TypeError(f"`{arg_name}=True` is ambiguous; use 'auto' or name the module classes.")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"`{arg_name}={policy}`: a minimum parameter count must be >= 1.")
        return policy
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if callable(policy) and not isinstance(policy, type):
        return policy  # type: ignore[return-value]
    if isinstance(policy, Iterable):
        items = list(policy)
        if not items:
            raise ValueError(f"`{arg_name}` is an empty collection; use None for no units below the root.")
        classes = tuple(c for c in items if isinstance(c, type))
        names = frozenset(c for c in items if isinstance(c, str))
        bad = [c for c in items if not isinstance(c, (type, str)) or (isinstance(c, type) and not issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"`{arg_name}` must hold nn.Module classes or class names, got {bad!r}.")
        return lambda module: isinstance(module, classes) or _class_matches(module, names)
    raise TypeError(f"`{arg_name}` of type {type(policy).__name__} is not supported: {policy!r}.")


def _runs_forward(module: nn.Module) -> bool:
    """FSDP2 hooks a unit's ``forward``; containers without one (``ModuleList``, ``ModuleDict``) cannot be units."""
    return type(module).forward is not nn.Module.forward


def _shared_parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """Parameter id → names of every module that holds it directly (several for tied weights)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _is_inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def select_units(model: nn.Module, policy: WrapPolicy, *, arg_name: str = "auto_wrap_policy") -> list[str]:
    """Names of the submodules that become FSDP units, deepest first (the root is not included).

    A module whose parameters are shared with a module outside it (tied weights) is skipped: its parameters
    must live in one unit with every user, which the enclosing unit (ultimately the root) provides.
    Modules already sharded by the user (``fully_shard`` in ``configure_model``) are kept as they are.
    """
    from torch.distributed.fsdp import FSDPModule

    resolved = resolve_policy(policy, model, arg_name=arg_name)
    if resolved is None:
        if policy == AUTO:
            warnings.warn(
                f"{arg_name}='auto' found no repeated blocks in {type(model).__name__}; the whole model is one FSDP"
                " unit, so every rank gathers all parameters during forward. Name the block classes to shard finer.",
                stacklevel=2,
            )
        return []
    owners = _shared_parameter_owners(model)
    named = [(n, m) for n, m in model.named_modules() if n]
    already = [n for n, m in named if isinstance(m, FSDPModule)]
    chosen: list[str] = []
    skipped_tied: list[str] = []
    if isinstance(resolved, int):
        chosen = _size_based_units(model, resolved, already)
    else:
        for name, module in named:
            if any(_is_inside(name, a) for a in already) or not _runs_forward(module) or not resolved(module):
                continue
            if not any(True for _ in module.parameters()):
                continue
            if _shares_params_outside(module, name, owners):
                skipped_tied.append(name)
                continue
            chosen.append(name)
    if skipped_tied:
        log.info("Not wrapping %s separately: parameters tied to modules outside them.", skipped_tied)
    if not chosen and not already:
        if policy == AUTO:
            return []
        raise ValueError(
            f"`{arg_name}={policy!r}` matched no module in {type(model).__name__}"
            + (f" (tied-weight modules skipped: {skipped_tied})" if skipped_tied else "")
            + f". Module classes present: {sorted({type(m).__name__ for _, m in named})[:20]}."
            " Name one of those classes, use 'auto', or pass None to shard the model as a single unit."
        )
    # deepest first, so nested units are sharded before the modules that contain them
    return sorted(chosen, key=lambda n: n.count("."), reverse=True)


def _shares_params_outside(module: nn.Module, name: str, owners: dict[int, set[str]]) -> bool:
    return any(not _is_inside(owner, name) for p in module.parameters() for owner in owners.get(id(p), ()))


def _size_based_units(model: nn.Module, min_params: int, already: list[str]) -> list[str]:
    """Post-order walk: a module becomes a unit when its not-yet-wrapped parameters reach ``min_params``."""
    owners = _shared_parameter_owners(model)
    chosen: list[str] = []

    def visit(name: str, module: nn.Module) -> int:
        if name in already:
            return 0
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(f"{name}.{child_name}" if name else child_name, child)
        if name and remaining >= min_params and _runs_forward(module) and not _shares_params_outside(module, name, owners):
            chosen.append(name)
            return 0
        return remaining

    visit("", model)
    return chosen


def apply_activation_checkpointing(model: nn.Module, policy: WrapPolicy) -> list[str]:
    """Recompute the selected modules' activations in backward. Returns the names checkpointed.

    Uses the composable ``checkpoint`` API, which keeps parameter names (and so checkpoints) unchanged.
    """
    if policy is None or policy is False:
        return []
    from torch.distributed._composable import checkpoint

    names = select_units(model, policy, arg_name="activation_checkpointing_policy")
    modules = dict(model.named_modules())
    for name in names:
        checkpoint(modules[name])
    return names


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    policy: WrapPolicy,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
) -> list[str]:
    """``fully_shard`` each selected unit bottom-up, then the root. Returns the unit names (root is ``""``).

    Idempotent: a model whose root is already an ``FSDPModule`` is left untouched.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return []
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    names = select_units(model, policy)
    modules = dict(model.named_modules())
    for name in names:
        fully_shard(modules[name], reshard_after_forward=reshard_after_forward, **kwargs)
    # the root's parameters are needed again right at the start of backward: keep them gathered
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return names + [""]


def keep_root_gathered_after_nested_forward(root: nn.Module) -> None:
    """Call inside the root's forward, after a nested ``root(...)`` call has returned: keeps FSDP2 from resharding
    the root's parameters when the outer forward ends.

    Steps run through the root's ``__call__`` (so its hooks fire even when ``training_step`` never calls
    ``self(...)``); a ``training_step`` that does call ``self(x)`` nests a second root forward inside it. The nested
    call's post-forward marks the root's parameter group idle, and the outer post-forward then reshards an idle group
    unconditionally, although the root is built with ``reshard_after_forward=False``: backward would all-gather the
    root's parameters (embeddings, head) a second time in every step. Marking the still-gathered group as in forward
    again lets the outer post-forward honour the root's setting. A no-op on layouts of FSDP2 it does not recognise.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        state = root._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.10: at most one group per module
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            if group._training_state == TrainingState.IDLE and group.is_unsharded and not group._reshard_after_forward:
                group._training_state = TrainingState.FORWARD
    except (ImportError, AttributeError):
        return


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in _params_and_buffers(model))


def _params_and_buffers(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def materialize_meta_module(model: nn.Module, device: torch.device, mesh: DeviceMesh | None = None) -> None:
    """Allocate a (sharded) meta-device model on ``device`` and initialise it shard by shard.

    ``to_empty`` allocates only each rank's local shards; every module that owns parameters or buffers directly
    then re-runs its ``reset_parameters()`` (on DTensors, so each rank initialises its own shard).
    """
    if not has_meta_tensors(model):
        return
    missing = [
        type(m).__name__
        for m in model.modules()
        if _owns_state(m) and not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise TypeError(
            f"Cannot initialise a model created on the meta device: {sorted(set(missing))} own parameters or buffers"
            " but define no `reset_parameters()`. Add a `reset_parameters()` that initialises them, or build the"
            " model outside `configure_model` / `init_module(empty_init=True)`."
        )
    model.to_empty(device=device)
    with torch.no_grad(), _distinct_shard_rng(mesh):
        for module in model.modules():
            if _owns_state(module):
                module.reset_parameters()


@contextmanager
def _distinct_shard_rng(mesh: DeviceMesh | None) -> Iterator[None]:
    """Give each shard its own random stream where DTensor has no distributed RNG (CPU meshes).

    On CUDA, DTensor's offset-based RNG makes every shard a different slice of one random stream. Elsewhere each
    rank would draw its shard from the same local generator state, so all shards of a weight came out identical.
    The seed is offset by the shard index only: HSDP replicas of the same shard stay equal, as they must. The
    generator is forked, so the global random stream after initialisation is the same on every rank.
    """
    from torch.distributed.tensor._random import is_rng_supported_mesh

    if mesh is None or (mesh.device_type != "cpu" and is_rng_supported_mesh(mesh)):
        yield
        return
    shard_index = mesh.get_local_rank(mesh.ndim - 1)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # DTensor warns on every random op on a CPU mesh; the per-shard seed below is what handles it
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed((torch.initial_seed() + 7919 * shard_index) % (2**63))
        yield


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
