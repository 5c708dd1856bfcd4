"""Meta-device models made real after sharding: each rank allocates and initialises only its own shards.

A model built under the strategy's init contexts has its parameters on the meta device (no memory) while its
buffers stay real: buffers that are computed rather than stored (rotary frequencies, causal masks) keep the
values their ``__init__`` computed (:func:`parameters_on_meta`). After ``fully_shard``, :func:`materialize_meta_module`
allocates the local shards (``to_empty``), puts the real buffers back, and initialises every module that owns
meta tensors with the first :data:`InitRule` that claims it. The package's default rule is the module's own
``reset_parameters()``; integrations add theirs (e.g. Hugging Face's ``_init_weights``, PEFT's adapter init).
A module that no rule claims is named in a ``TypeError`` before anything is allocated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from lightning_fsdp._torch_compat import distributed_rng_supported
from lightning_fsdp.sharding.units import tied_aliases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: ``rule(model, name, module)`` → ``(key, init)`` if the rule initialises ``module``, else ``None``. Modules that
#: return the same ``key`` are initialised by one call (e.g. an adapter's A and B matrices).
InitRule = Callable[[nn.Module, str, nn.Module], Optional[tuple[object, Callable[[], None]]]]


def reset_parameters_rule(model: nn.Module, name: str, module: nn.Module) -> Optional[tuple[object, Callable[[], None]]]:
    """The module's own ``reset_parameters()`` (torch's layers and most hand-written modules)."""
    reset = getattr(module, "reset_parameters", None)
    return (id(module), reset) if callable(reset) else None


DEFAULT_RULES: tuple[InitRule, ...] = (reset_parameters_rule,)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device and everything else (buffers, temporaries) as usual.

    A parameter is moved to meta when a module registers it, before the module initialises it, so no parameter
    is ever filled on a real device; buffers computed in ``__init__`` keep real values, which a meta-device model
    could not recover (e.g. Hugging Face's rotary ``inv_freq``, stored in no checkpoint).
    """
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            try:
                param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with another constructor
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model, recurse=True))


def modules_needing_init(model: nn.Module, loaded: Collection[str] = ()) -> list[tuple[str, nn.Module]]:
    """Modules that own meta tensors directly, except where every one of them is about to be loaded (``loaded``:
    fully qualified names of parameters and buffers that pretrained weights will overwrite)."""
    out = []
    for name, module in model.named_modules():
        meta = [
            f"{name}.{n}" if name else n
            for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if t is not None and t.is_meta
        ]
        if meta and not all(n in loaded for n in meta):
            out.append((name, module))
    return out


def plan_initialization(
    model: nn.Module, rules: Sequence[InitRule] = DEFAULT_RULES, loaded: Collection[str] = ()
) -> list[tuple[Callable[[], None], list[str]]]:
    """The initialisers to run after allocation, one per claimed key, each with the names of the modules it
    initialises; a ``TypeError`` naming unclaimed modules."""
    inits: dict[object, tuple[Callable[[], None], list[str]]] = {}
    missing: list[str] = []
    for name, module in modules_needing_init(model, loaded):
        for rule in rules:
            claimed = rule(model, name, module)
            if claimed is not None:
                inits.setdefault(claimed[0], (claimed[1], []))[1].append(name)
                break
        else:
            missing.append(type(module).__name__)
    if missing:
        raise TypeError(
            f"Cannot initialise a model created on the meta device: {sorted(set(missing))} own parameters or buffers"
            " but define no `reset_parameters()` (and no library initialiser claims them). Add a"
            " `reset_parameters()` that initialises them, load them with `pretrained_weights`, or build the model"
            " outside `configure_model` / `init_module(empty_init=True)`."
        )
    return list(inits.values())


def materialize_meta_module(
    model: nn.Module,
    device: torch.device,
    mesh: Optional[DeviceMesh] = None,
    rules: Sequence[InitRule] = DEFAULT_RULES,
    loaded: Collection[str] = (),
) -> None:
    """Allocate a (sharded) meta-device model on ``device`` and initialise it shard by shard.

    ``to_empty`` allocates only each rank's local shards (and moves buffers); real buffers get their values back;
    then each claimed module is initialised (on DTensors, so each rank initialises its own shard). A quantized
    weight is initialised through a full-precision stand-in, then quantized (:func:`~lightning_fsdp.sharding
    .quantize.standins`).
    """
    from lightning_fsdp.sharding.quantize import standins

    if not has_meta_tensors(model):
        return
    inits = plan_initialization(model, rules, loaded)  # raises before anything is allocated
    real_buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    ties = tied_aliases(model)
    model.to_empty(device=device)
    _retie(model, ties)  # ``to_empty`` replaces a plain (unsharded) parameter once per module that holds it
    with torch.no_grad():
        for name, value in real_buffers.items():
            model.get_buffer(name).copy_(value)
        with _distinct_shard_rng(mesh):
            for init, modules in inits:
                with standins(model, modules, loaded):
                    init()


def _retie(model: nn.Module, ties: dict[str, str]) -> None:
    """Make every alias of a tied parameter the same ``Parameter`` as its first name again."""
    for alias, canonical in ties.items():
        owner, _, attr = alias.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        shared = model.get_parameter(canonical)
        if getattr(module, attr) is not shared:
            module.register_parameter(attr, shared)


def _tensors(module: nn.Module, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


@contextmanager
def _distinct_shard_rng(mesh: Optional[DeviceMesh]) -> Iterator[None]:
    """Give each shard its own random stream where DTensor has no distributed RNG (CPU meshes).

    On CUDA, DTensor's offset-based RNG makes every shard a different slice of one random stream. Elsewhere each
    rank would draw its shard from the same local generator state, so all shards of a weight came out identical.
    The seed is offset by the shard index only: HSDP replicas of the same shard stay equal, as they must. The
    generator is forked, so the global random stream after initialisation is the same on every rank.
    """
    if mesh is None or (mesh.device_type != "cpu" and distributed_rng_supported(mesh)):
        yield
        return
    shard_index = mesh.get_local_rank(mesh.ndim - 1)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # DTensor warns on every random op on a CPU mesh; the per-shard seed below is what handles it
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed((torch.initial_seed() + 7919 * shard_index) % (2**63))
        yield
