"""``ShardedAverage``: an exponential moving average of a sharded model's weights, kept on each rank's shards.

Lightning's ``WeightAveraging`` deep-copies the whole module into an ``AveragedModel`` (a full copy on every rank)
and then mixes plain tensors with the sharded DTensor parameters in its update, which fails. Here the average is a
copy of each rank's *local shards* only (1/N of the model, optionally in CPU memory), updated with fused ``foreach``
ops, and never gathered. Frozen parameters are not copied: their average is themselves (under LoRA only the
adapters are averaged).

This object knows no front end: a Fabric loop calls :meth:`ShardedAverage.update` after its optimizer steps; the
Trainer's ``ShardedEMA`` callback (:mod:`lightning_fsdp.trainer.averaging`) calls it on Lightning's schedule and
saves :meth:`ShardedAverage.entry` next to the model's ``state_dict``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_fsdp._torch_compat import foreach_copy_, foreach_lerp_
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.memory import tensor_bytes
from lightning_fsdp.parallel.mesh import local_shard

#: the checkpoint entry holding the average (model keys → tensors, sharded like the model)
EMA_ENTRY = SCHEMA.ema


class ShardedAverage:
    """``decay·average + (1 − decay)·weights`` per update, on this rank's local shards (see the module docstring).

    Args:
        decay: in [0, 1]; the first update copies the weights.
        device: where the average lives (e.g. ``"cpu"``); default the parameters' device.
        use_buffers: average floating-point buffers too.
    """

    def __init__(
        self, decay: float = 0.999, device: Optional[Union[torch.device, str, int]] = None, use_buffers: bool = True
    ) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay={decay}: the decay must be in [0, 1].")
        self.decay = float(decay)
        self.device = torch.device(device) if isinstance(device, (str, int)) else device
        self.use_buffers = use_buffers
        self.n_averaged = 0
        self.names: list[str] = []
        self.aliases: dict[str, list[str]] = {}  # tracked name → every state-dict key of that tensor (tied weights)
        self._average: list[Tensor] = []  # local shards (or replicated buffers), on `self.device` if given

    def tracked(self, module: nn.Module) -> list[tuple[str, Tensor]]:
        """What is averaged: trainable parameters (frozen ones never change: not copied) and float buffers."""
        tracked: list[tuple[str, Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self.use_buffers:
            tracked += [(n, b) for n, b in module.named_buffers() if b is not None and b.is_floating_point()]
        return tracked

    @property
    def started(self) -> bool:
        return bool(self._average)

    def ensure(self, module: nn.Module) -> None:
        """Take the average's first value from the (sharded) weights, once the model exists."""
        if self._average:
            return
        tracked = self.tracked(module)
        saved_keys = set(module.state_dict(keep_vars=True))
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
            if name in saved_keys:
                by_tensor.setdefault(id(tensor), []).append(name)
        self.names = [name for name, _ in tracked]
        self.aliases = {name: by_tensor.get(id(t), []) for name, t in tracked}
        self._average = [local_shard(t).detach().to(self.device or t.device, copy=True) for _, t in tracked]

    def average_tensors(self) -> list[Tensor]:
        """This rank's part of the average (its local shards), in tracking order."""
        return list(self._average)

    def average_bytes(self) -> int:
        """Bytes this rank holds for the average (its local shards)."""
        return sum(tensor_bytes(t) for t in self._average)

    def update(self, module: nn.Module) -> None:
        """Fold the current weights into the average (the first update copies them)."""
        self.ensure(module)
        current = [local_shard(t).detach() for _, t in self.tracked(module)]
        with torch.no_grad():
            if self.n_averaged == 0:
                foreach_copy_(self._average, [c.to(a.device) for a, c in zip(self._average, current)])
            else:
                by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
                for avg, cur in zip(self._average, current):
                    pair = by_device.setdefault(avg.device, ([], []))
                    pair[0].append(avg)
                    pair[1].append(cur.to(avg.device))
                for averages, values in by_device.values():
                    foreach_lerp_(averages, values, 1.0 - self.decay)  # decay·avg + (1 − decay)·value
        self.n_averaged += 1

    def swap(self, module: nn.Module) -> None:
        """Exchange the weights and the average (both local shards): evaluate the average, then swap back."""
        with torch.no_grad():
            for avg, (_, t) in zip(self._average, self.tracked(module)):
                local = local_shard(t)
                held = local.detach().clone()
                local.copy_(avg.to(local.device))
                avg.copy_(held.to(avg.device))

    def copy_to(self, module: nn.Module) -> None:
        """Make the module's weights the average (keeping the average)."""
        with torch.no_grad():
            for avg, (_, t) in zip(self._average, self.tracked(module)):
                local_shard(t).copy_(avg.to(local_shard(t).device))

    def entry(self, module: nn.Module, full: bool, keep: bool) -> dict[str, Tensor]:
        """The checkpoint entry, under every key of each tensor (tied weights too): DTensors sharded like the
        parameters, or (``full``) gathered tensor by tensor to CPU — a collective: every rank calls it — and held
        only where ``keep``."""
        from torch.distributed.tensor import DTensor

        entry: dict[str, Tensor] = {}
        for name, avg, (_, t) in zip(self.names, self._average, self.tracked(module)):
            value = avg.to(local_shard(t).device)
            if isinstance(t, DTensor):
                value = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                           stride=t.stride())
                if full:
                    value = value.full_tensor()
            if full:
                value = value.cpu()
            if keep:
                for key in self.aliases.get(name) or [name]:
                    entry[key] = value.detach()
        return entry

    def missing_from(self, saved: dict[str, Tensor]) -> list[str]:
        return [name for name in self.names if name not in saved]

    def load_entry(self, module: nn.Module, saved: dict[str, Tensor]) -> None:
        """Take the average from a checkpoint entry: local shards of DTensors, or this rank's slice of full tensors."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.ensure(module)
        tracked = dict(self.tracked(module))
        with torch.no_grad():
            for name, avg in zip(self.names, self._average):
                value, param = saved[name], tracked[name]
                if isinstance(value, DTensor):
                    value = value.to_local()
                elif isinstance(param, DTensor):  # a full tensor held by every rank: this rank's slice of it
                    value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
                avg.copy_(value.to(avg.device))
