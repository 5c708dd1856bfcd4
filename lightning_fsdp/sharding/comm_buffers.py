"""Hand FSDP2's host communication buffers from one unit, and one step, to the next.

Each FSDP unit all-gathers its parameters into one flat buffer (in forward, and again in backward) and copies its
gradients into another for the reduce-scatter, every step. On a GPU the caching allocator hands the same blocks
back; on the host each is a fresh ``malloc`` of a unit's whole size: glibc either maps it anew, and the kernel
faults in and zeroes every page of it again, or carves it from a heap that fragments around the gradient shards
allocated between them. A transformer's blocks are all one size, so a few buffers serve them all.

:class:`HostBufferPool` keeps those buffers and hands out one that is idle: no tensor, view or pending collective
holds its storage any more (c10's use count says so), which makes a reused buffer exactly as safe as
``torch.empty``. Only units whose parameters have the same shapes as another unit's take part (a model's one-off
root, with its large embedding, allocates as FSDP does, so the pool never holds it), only host (CPU) buffers are
pooled, and only transient ones: a reduce-scatter's output becomes the sharded gradient and lives until
``zero_grad``, so it too is allocated as FSDP does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from lightning_fsdp._torch_compat import fsdp_default_comms, storage_holders

__all__ = ["HostBufferPool", "reuse_host_comm_buffers"]


class HostBufferPool:
    """Flat host buffers by ``(dtype, numel)``, at most ``per_size`` of each; an idle one is handed out again."""

    def __init__(self, per_size: int = 4) -> None:
        self.per_size = per_size
        self._buffers: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.reused = 0
        self.allocated = 0

    def allocate(self, size: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``size`` whose contents are undefined, as ``torch.empty(size)`` would give."""
        if torch.device(device).type != "cpu":
            return torch.empty(*size, dtype=dtype, device=device)
        numel = math.prod(int(s) for s in size)
        kept = self._buffers.setdefault((dtype, numel), [])
        for buffer in kept:
            if storage_holders(buffer) == 1:  # the pool's own reference only
                self.reused += 1
                return buffer.view(*size)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) < self.per_size:  # more at once than that: the surplus is allocated and freed as usual
            kept.append(buffer)
            self.allocated += 1
        return buffer.view(*size)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for kept in self._buffers.values() for b in kept)


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters a unit's own all-gather covers: its own, less those of FSDP units nested in it."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


def _signature(unit: nn.Module) -> tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]:
    return tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in _own_parameters(unit))


def reuse_host_comm_buffers(units: Sequence[nn.Module]) -> Optional[HostBufferPool]:
    """Give the FSDP ``units`` that share their parameters' shapes with another unit an all-gather and a
    reduce-scatter whose host buffers come from one :class:`HostBufferPool` (returned; ``None`` where the installed
    torch has moved the hooks, which warns once). The others keep FSDP's own."""
    comms = fsdp_default_comms()
    if comms is None:
        return None
    default_all_gather, default_reduce_scatter = comms
    shared = HostBufferPool()

    class PooledAllGather(default_all_gather):  # type: ignore[valid-type,misc]
        """All-gathers into a pooled buffer, and notes its size for its unit's reduce-scatter."""

        numel: Optional[int] = None

        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            self.numel = math.prod(int(s) for s in size)
            return shared.allocate(size, dtype, device)

    class PooledReduceScatter(default_reduce_scatter):  # type: ignore[valid-type,misc]
        """Copies the gradients into a pooled buffer when it is as large as the unit's gather (the input, not the
        output, which becomes the sharded gradient)."""

        def __init__(self, gather: PooledAllGather) -> None:
            super().__init__()
            self.gather = gather

        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if math.prod(int(s) for s in size) == self.gather.numel:
                return shared.allocate(size, dtype, device)
            return torch.empty(*size, dtype=dtype, device=device)

    signatures = {id(u): _signature(u) for u in units}
    repeated = Counter(signatures.values())
    for unit in units:
        if not signatures[id(unit)] or repeated[signatures[id(unit)]] < 2:
            continue
        gather = PooledAllGather()
        try:
            unit.set_custom_all_gather(gather)  # type: ignore[operator]
            unit.set_custom_reduce_scatter(PooledReduceScatter(gather))  # type: ignore[operator]
        except ValueError:  # parameters on several meshes (``shard_placement_fn``): FSDP keeps its own buffers
            continue
    return shared
