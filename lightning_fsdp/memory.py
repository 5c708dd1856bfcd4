"""How many bytes of parameters, gradients and optimizer state each rank really holds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state resident on one rank (its local shards only)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (the local shard of a DTensor)."""
    local = _local(t)
    return local.numel() * local.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def local_state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    """Local bytes of this rank's parameter shards, gradient shards and optimizer state."""
    params = _unique(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    opt_tensors = [
        v for opt in optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return StateBytes(
        params=sum(tensor_bytes(p) for p in params),
        grads=sum(tensor_bytes(g) for g in grads),
        optimizer=sum(tensor_bytes(t) for t in opt_tensors if t.numel() > 1),
    )


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters if they were unsharded (the global shape of each DTensor)."""
    return sum(p.numel() * p.element_size() for p in _unique(model.parameters()))
