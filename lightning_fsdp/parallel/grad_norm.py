"""The global norm of sharded gradients, and clipping by it, without a host round-trip per parameter.

A sharded (DTensor) gradient contributes its local shard on every rank of its shard group, so the partial sums are
all-reduced over that group only (for HSDP, replicas hold identical shards and are not summed). A plain tensor
gradient is replicated and counted once. Per group: one fused local reduction (``torch.nn.utils.get_total_norm``)
and one all-reduce; the result stays on the device, so neither the norm nor clipping forces a host sync.

:class:`StepGradNorm` computes the norm at most once per optimizer step, so gradient clipping and the non-finite
step check share it. Gradients changed in place through :func:`scale_gradients_` or :func:`clip_grad_norm_` (a
token-weighted loss normalising them, the scaler unscaling them) make that shared norm stale, so it is recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp._torch_compat import foreach_mul_

#: added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does
CLIP_EPS = 1e-6
#: counts in-place edits of gradients made here; a norm computed before an edit is stale after it
_gradient_edits = 0


def _grad_groups(parameters: Iterable[Tensor]) -> tuple[list[Tensor], dict[tuple[Any, tuple[int, ...]], list[Tensor]]]:
    """Gradients split into replicated plain tensors and, per (mesh, shard dims), local shards of DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    seen: set[int] = set()
    replicated: list[Tensor] = []
    sharded: dict[tuple[Any, tuple[int, ...]], list[Tensor]] = {}
    for p in parameters:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g = p.grad.detach()
        if isinstance(g, DTensor):
            dims = tuple(i for i, placement in enumerate(g.placements) if isinstance(placement, Shard))
            sharded.setdefault((g.device_mesh, dims), []).append(g.to_local())
        else:
            replicated.append(g)
    return replicated, sharded


def _local_partial(grads: list[Tensor], norm_type: float) -> Tensor:
    """``Σ|g|^p`` (or ``max|g|`` for p = inf) of the local tensors, as float64 on their device, in one fused pass."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type).to(torch.float64)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all gradients as if they were unsharded (float32, 0-d, on the gradients' communication device)."""
    norm_type = float(norm_type)
    inf_norm = math.isinf(norm_type)
    replicated, sharded = _grad_groups(parameters)
    if not replicated and not sharded:
        return torch.tensor(0.0)
    partials: list[Tensor] = []
    if replicated:
        partials.append(_local_partial(replicated, norm_type))
    op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
    for (mesh, shard_dims), grads in sharded.items():
        part = _local_partial(grads, norm_type).to(mesh.device_type)  # e.g. CPU-offloaded shards, nccl groups
        for dim in shard_dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        partials.append(part)
    device = partials[-1].device
    stacked = torch.stack([p.to(device) for p in partials])
    total = stacked.max() if inf_norm else stacked.sum().pow(1.0 / norm_type)
    return total.to(torch.float32)


def _scale_in_place(params: list[Tensor], factor: Tensor) -> None:
    global _gradient_edits
    replicated, sharded = _grad_groups(params)
    by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in replicated + [t for grads in sharded.values() for t in grads]:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    with torch.no_grad():
        for (device, dtype), grads in by_device.items():
            foreach_mul_(grads, factor.to(device=device, dtype=dtype))
    _gradient_edits += 1


def scale_gradients_(parameters: Iterable[Tensor], factor: Union[Tensor, float]) -> None:
    """Multiply every gradient (local shards of sharded ones) by ``factor`` in place, fused per device and dtype;
    a 0-d tensor factor stays on its device (no host sync)."""
    _scale_in_place(list(parameters), torch.as_tensor(factor, dtype=torch.float32))


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, total_norm: Optional[Tensor] = None
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded gradients: scale every gradient by ``max_norm / norm`` when
    that is below 1. ``total_norm`` skips computing the norm again. Returns the norm before clipping."""
    params = list(parameters)
    total = total_grad_norm(params, norm_type) if total_norm is None else total_norm
    coef = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    _scale_in_place(params, coef)
    return total


class StepGradNorm:
    """The gradient norm of the current optimizer step, computed once however many features need it.

    The strategy runs each optimizer step inside :meth:`step`; within it the non-finite check (right after
    backward) and gradient clipping (after the loss scaler unscaled the gradients) share one norm. Outside a step,
    or after :meth:`invalidate` (the gradients changed, e.g. were unscaled), :meth:`get` computes afresh.
    """

    def __init__(self) -> None:
        self._active = False
        self._norm: Optional[Tensor] = None
        self._norm_type: Optional[float] = None
        self._edits = -1  # the gradient edits counted when the norm was computed

    @contextmanager
    def step(self) -> Iterator[None]:
        self._active, self._norm = True, None
        try:
            yield
        finally:
            self._active, self._norm = False, None

    def invalidate(self) -> None:
        self._norm = None

    def get(self, parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
        fresh = self._edits == _gradient_edits
        if self._active and self._norm is not None and self._norm_type == float(norm_type) and fresh:
            return self._norm
        norm = total_grad_norm(parameters, norm_type)
        if self._active:
            self._norm, self._norm_type, self._edits = norm, float(norm_type), _gradient_edits
        return norm
