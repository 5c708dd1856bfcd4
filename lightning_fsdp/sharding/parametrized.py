"""Parametrized modules (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, ``orthogonal``, your own)
built on the meta device, initialised the way building them eagerly does.

Eagerly, a module is initialised first; registering a parametrization then turns its weight into
``parametrizations.<name>.original*`` through the parametrization's ``right_inverse`` (``weight_norm``: the norms
and the direction; ``orthogonal``: the orthogonal base), and ``spectral_norm`` starts its power iteration from it.
On the meta device all that ran on values that do not exist. :func:`parametrization_rule` re-does it after
allocation: the module's own initialiser runs on a plain stand-in weight (sharded like the originals, so each rank
draws only its rows), the stand-in is gathered whole and passed through each parametrization's ``right_inverse``,
last to first, as registering does; each rank then takes its rows of the results into the originals, scattered
from the first rank, so that random parts (orthogonal's completion of a non-square matrix) agree. Buffers a
parametrization computes from the weight are re-derived too (``spectral_norm``'s ``_u``/``_v``; ``orthogonal``'s
``base`` is set by its ``right_inverse``) and made equal on every rank; one that nothing re-derives is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.nn.utils import parametrize

from lightning_fsdp._torch_compat import private_reset_parameters, spectral_norm_vectors

#: the parametrized weight's (shape, dtype), by tensor name
Specs = dict[str, tuple[torch.Size, torch.dtype]]


def parametrized_host(model: nn.Module, name: str, module: nn.Module) -> Optional[nn.Module]:
    """The parametrized module that ``module`` is or belongs to (``<host>.parametrizations.<tensor>[.<i>]``)."""
    if parametrize.is_parametrized(module):
        return module
    parts = name.split(".") if name else []
    for depth in (2, 3):
        if len(parts) >= depth and parts[-depth] == "parametrizations":
            host_name = ".".join(parts[:-depth])
            host = model.get_submodule(host_name) if host_name else model
            if parametrize.is_parametrized(host):
                return host
    return None


def parametrization_rule(model: nn.Module, name: str, module: nn.Module) -> Optional[tuple[object, Callable[[], None]]]:
    """A parametrized module and its parametrizations: the module's own initialiser (``reset_parameters()`` or torch's
    private ``_reset_parameters()``) on a plain weight, then the originals re-derived as registering does."""
    host = parametrized_host(model, name, module)
    if host is None:
        return None
    reset = getattr(host, "reset_parameters", None)
    init = reset if callable(reset) else private_reset_parameters(host)
    lists = _lists(host)
    specs = {tensor: _weight_spec(plist) for tensor, plist in lists.items()}
    if init is None or any(spec is None for spec in specs.values()) or not all(map(_rederivable, lists.values())):
        return None
    meta_buffers = {(id(p), n) for plist in lists.values() for p in plist for n, b in p.named_buffers() if b.is_meta}
    known: Specs = {tensor: spec for tensor, spec in specs.items() if spec is not None}
    return (("parametrized", id(host)), lambda: _initialise(host, init, known, meta_buffers))


def _lists(host: nn.Module) -> dict[str, parametrize.ParametrizationList]:
    """Each parametrized tensor's ``ParametrizationList`` (``host.parametrizations``)."""
    return dict(cast(Any, host).parametrizations.items())


def _originals(plist: parametrize.ParametrizationList) -> list[torch.Tensor]:
    p: Any = plist
    return [p.original] if p.is_tensor else [getattr(p, f"original{i}") for i in range(p.ntensors)]


def _weight_spec(plist: parametrize.ParametrizationList) -> Optional[tuple[torch.Size, torch.dtype]]:
    """The parametrized tensor's shape and dtype: the parametrizations' forward over meta stand-ins of the originals
    (a parametrization that cannot run on meta: a single original's own, which registering keeps the shape of)."""
    originals = _originals(plist)
    probes = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in originals]
    try:
        with torch.no_grad():
            value = plist[0](*probes)
            for parametrization in list(plist)[1:]:
                value = parametrization(value)
        return value.shape, value.dtype
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return (originals[0].shape, originals[0].dtype) if len(originals) == 1 else None


def _rederivable(plist: parametrize.ParametrizationList) -> bool:
    """A parametrization with meta buffers has a ``right_inverse`` that may re-derive them (checked after it ran)."""
    return all(hasattr(p, "right_inverse") or not any(b.is_meta for b in p.buffers()) for p in plist)


def _initialise(host: nn.Module, init: Callable[[], None], specs: Specs, meta_buffers: set[tuple[int, str]]) -> None:
    lists = _lists(host)
    standins = {tensor: _standin(_originals(lists[tensor])[0], *spec) for tensor, spec in specs.items()}
    with _plain_weights(host, standins):
        init()
    for tensor, plist in lists.items():
        standin = standins[tensor]
        full = standin.full_tensor() if isinstance(standin, DTensor) else standin.detach()
        _from_weight(host, tensor, plist, full, meta_buffers)


def _standin(original: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised weight, sharded like ``original`` (every rank draws only its rows)."""
    local = original.to_local() if isinstance(original, DTensor) else original
    whole = torch.empty(shape, dtype=dtype, device=local.device)
    if isinstance(original, DTensor):
        return distribute_tensor(whole, original.device_mesh, original.placements, src_data_rank=None)
    return whole


@contextmanager
def _plain_weights(host: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """While the host's initialiser runs, ``host.<tensor>`` is a plain parameter instead of the parametrization's
    output (the class parametrize made for the host loses the tensor's property meanwhile)."""
    removed = []
    try:
        for tensor, weight in weights.items():
            owner = next(c for c in type(host).__mro__ if isinstance(vars(c).get(tensor), property))
            removed.append((owner, tensor, vars(owner)[tensor]))
            delattr(owner, tensor)
            host.register_parameter(tensor, nn.Parameter(weight, requires_grad=False))
        yield
    finally:
        for owner, tensor, prop in removed:
            if tensor in dict(host.named_parameters(recurse=False)):
                delattr(host, tensor)
            setattr(owner, tensor, prop)


def _from_weight(host: nn.Module, tensor: str, plist: parametrize.ParametrizationList, weight: torch.Tensor, meta: set[tuple[int, str]]) -> None:
    """Registering's work for ``weight``: ``right_inverse`` of each parametrization, last to first, into the
    originals; buffers re-derived; one forward where registering checks it (``spectral_norm``: a power iteration);
    the buffers made equal on every rank."""
    value: Any = weight
    inputs = {}
    buffers = {id(p): dict(p.named_buffers()) for p in plist}
    for parametrization in reversed(list(plist)):
        inputs[id(parametrization)] = value
        if hasattr(parametrization, "right_inverse"):
            try:
                value = cast(Any, parametrization).right_inverse(value)
            except NotImplementedError:  # registering treats it as the identity too
                pass
    originals = _originals(plist)
    results = [value] if cast(Any, plist).is_tensor else list(value)
    for original, result in zip(originals, results):
        if isinstance(original, DTensor):  # each rank's rows of the first rank's result
            original.copy_(distribute_tensor(result.to(original.dtype), original.device_mesh, original.placements))
        else:
            original.copy_(result)
    for parametrization in plist:
        derived = spectral_norm_vectors(parametrization, inputs[id(parametrization)])
        for name, before in buffers[id(parametrization)].items():
            if (id(parametrization), name) in meta and not derived and parametrization.get_buffer(name) is before:
                raise TypeError(
                    f"{type(host).__name__}.{tensor}: the parametrization {type(parametrization).__name__} keeps the"
                    f" buffer {name!r}, computed from the weight when it was registered; on the meta device it holds no"
                    " value and nothing re-derives it. Register the parametrization after the model is materialised,"
                    " or build the model outside `configure_model` / `init_module(empty_init=True)`."
                )
    if not cast(Any, plist).unsafe:  # registering checks the result with one forward
        value = plist[0](*results)
        for parametrization in list(plist)[1:]:
            value = parametrization(value)
    if isinstance(originals[0], DTensor):
        mesh = originals[0].device_mesh
        for buffer in plist.buffers():
            buffer.copy_(distribute_tensor(buffer, mesh, [Replicate()] * mesh.ndim).to_local())
