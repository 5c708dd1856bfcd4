"""Meta-device models made real after sharding: each rank allocates and initialises only its own shards.

**The rule: materialisation touches only what is on the meta device.** Under the strategy's init contexts
(:func:`parameters_on_meta`) parameters go to the meta device and everything else stays real: buffers computed in
``__init__`` (rotary frequencies, causal masks) keep their values, torchmetrics states and reset defaults are real
tensors. After ``fully_shard``, :func:`materialize_meta_module` allocates each meta parameter and buffer on the
module that owns it, one tensor at a time: ``to_empty(recurse=False)`` restricted to meta tensors. A sharded
parameter gets only this rank's shard (FSDP2 then re-reads it), a tied one stays one ``Parameter``. No real tensor,
and no ``Module._apply`` override (``torchmetrics.Metric`` maps its states *and* its reset defaults through it),
ever goes through ``to_empty``. Then every module that owns meta tensors, and every module whose own initialiser
reaches below it (``nn.Transformer``), is initialised children before parents (the order ``__init__`` initialises
them) by the first :data:`InitRule` that claims it: the integrations' (Hugging Face's ``_init_weights``, PEFT's
adapters), then parametrizations, ``reset_parameters()`` and torch's private ``_reset_parameters()``
(:mod:`.init_rules`). A module that no rule claims is named in a ``TypeError`` before anything is allocated. A
metric whose states were created on meta (inside ``torch.device("meta")``) is rebuilt (:mod:`.metric_states`).

**Random values do not depend on the world size**: while initialisers run, every random fill of a sharded tensor is
drawn for the whole tensor and each rank keeps its rows (:mod:`.seeded_init`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from lightning_fsdp._torch_compat import (
    private_reset_parameters,
    reset_sharded_params,
    swaps_on_conversion,
)
from lightning_fsdp.sharding.init_rules import DEFAULT_RULES, InitRule
from lightning_fsdp.sharding.metric_states import plan_metric_states
from lightning_fsdp.sharding.parametrized import parametrized_host
from lightning_fsdp.sharding.seeded_init import seeded_draws
from lightning_fsdp.sharding.units import tied_aliases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh



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
    return any(t.is_meta for _, t in _named_tensors(model, recurse=True))


def modules_needing_init(model: nn.Module, loaded: Collection[str] = ()) -> list[tuple[str, nn.Module]]:
    """Modules that own meta tensors directly, and modules whose private ``_reset_parameters()`` initialises the
    meta tensors below them (``nn.Transformer``), children before parents; except where every meta tensor is about
    to be loaded (``loaded``: fully qualified names of parameters and buffers that pretrained weights overwrite)."""
    out = []
    for name, module in _children_first(model):
        prefix = f"{name}." if name else ""
        meta = [f"{prefix}{n}" for n, t in _named_tensors(module, recurse=False) if t.is_meta]
        if not meta and private_reset_parameters(module) is not None:
            meta = [f"{prefix}{n}" for n, t in _named_tensors(module, recurse=True) if t.is_meta]
        if meta and not all(n in loaded for n in meta):
            out.append((name, module))
    return out


def plan_initialization(
    model: nn.Module, rules: Sequence[InitRule] = DEFAULT_RULES, loaded: Collection[str] = ()
) -> list[tuple[Callable[[], None], list[str]]]:
    """The initialisers to run after allocation, one per claimed key, each with the names of the modules it
    initialises; a ``TypeError`` naming unclaimed modules (a parametrization by the module it parametrizes)."""
    inits: dict[object, tuple[Callable[[], None], list[str]]] = {}
    missing: list[str] = []
    for name, module in modules_needing_init(model, loaded):
        for rule in rules:
            claimed = rule(model, name, module)
            if claimed is not None:
                inits.setdefault(claimed[0], (claimed[1], []))[1].append(name)
                break
        else:
            host = parametrized_host(model, name, module)
            missing.append(type(module if host is None else host).__name__)
    if missing:
        raise TypeError(
            f"Cannot initialise a model created on the meta device: {sorted(set(missing))} own parameters or buffers"
            " but define no `reset_parameters()` (and no library or torch initialiser claims them). Add a"
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
    """Allocate the meta tensors of a (sharded) model, each rank its own shards, and initialise them.

    Meta parameters are allocated on ``device`` (each rank its local shards), meta buffers where the model computes
    (the mesh's device; ``device`` without a mesh). Then each claimed module is initialised: on DTensors, each rank
    keeps its rows of every random fill drawn whole, so values do not depend on the world size. A quantized weight is
    initialised through a full-precision stand-in, then quantized (:func:`~lightning_fsdp.sharding.quantize.standins`).
    Metrics with meta states are rebuilt last.
    """
    from lightning_fsdp.sharding.quantize import device_of, standins

    metrics = plan_metric_states(model)  # raises before anything is allocated
    if not has_meta_tensors(model) and not metrics:
        return
    inits = plan_initialization(model, rules, loaded)  # raises before anything is allocated
    compute_device = device_of(mesh) if mesh is not None else device
    ties = tied_aliases(model)
    _allocate_meta_tensors(model, device, compute_device)
    _retie(model, ties)  # a plain (unsharded) tied parameter is allocated once per module that holds it
    with torch.no_grad():
        with seeded_draws(mesh, compute_device):
            for init, modules in inits:
                with standins(model, modules, loaded):
                    init()
        _zero_sharded_padding_rows(model, [name for _, modules in inits for name in modules])
    for restore in metrics:
        restore(compute_device)


def _allocate_meta_tensors(model: nn.Module, device: torch.device, buffer_device: torch.device) -> None:
    """``to_empty(recurse=False)`` of every module, for its meta tensors only: a parameter is swapped in place or
    replaced as ``Module._apply`` does (a DTensor keeps its identity); then each FSDP unit re-reads its shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                empty = torch.empty_like(param, device=device)
                allocated = nn.Parameter(empty, requires_grad=param.requires_grad)
                if swaps_on_conversion(empty):
                    torch.utils.swap_tensors(param, allocated)
                else:
                    setattr(module, name, allocated)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device=buffer_device))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            reset_sharded_params(module)


def _zero_sharded_padding_rows(model: nn.Module, initialised: list[str]) -> None:
    """``nn.Embedding(padding_idx=i)`` starts with row ``i`` zero. On a sharded weight, ``reset_parameters()``'s
    (and Hugging Face's) ``weight[i].fill_(0)`` writes into a gathered copy, so the rank holding the row zeroes it."""
    from torch.distributed.tensor import DTensor

    from lightning_fsdp.parallel.mesh import local_rows, local_shard

    for name in initialised:
        module = model.get_submodule(name)
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.padding_idx is not None:
            if isinstance(module.weight, DTensor):
                start, stop = local_rows(module.weight)
                if start <= module.padding_idx < stop:
                    local_shard(module.weight)[module.padding_idx - start].zero_()


def _retie(model: nn.Module, ties: dict[str, str]) -> None:
    """Make every alias of a tied parameter the same ``Parameter`` as its first name again."""
    for alias, canonical in ties.items():
        owner, _, attr = alias.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        shared = model.get_parameter(canonical)
        if getattr(module, attr) is not shared:
            module.register_parameter(attr, shared)


def _named_tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse)
    yield from ((n, b) for n, b in module.named_buffers(recurse=recurse) if b is not None)


def _children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules()`` (each module once) in post-order: a module after everything below it."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", model)
    return out
