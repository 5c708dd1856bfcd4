"""From the user's module to a sharded, initialised model on this rank: the one order every step happens in.

precision conversion → activation checkpointing → ``fully_shard`` units bottom-up and the root → allocate and
initialise each rank's shards (meta-device models) → pretrained weights straight into the shards.

A plain function of ``(model, mesh, options)``, so it runs without a Trainer (the strategy's ``setup`` calls it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from lightning_fsdp.sharding import DEFAULT_RULES, InitRule, ShardingPlan, materialize_meta_module, parallelize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Preparation:
    """Everything :func:`prepare_model` needs besides the model and the mesh."""

    plan: ShardingPlan
    device: torch.device
    pretrained_weights: Optional[Union[str, Path]] = None
    strict: bool = True
    init_rules: tuple[InitRule, ...] = DEFAULT_RULES


def prepare_model(model: nn.Module, mesh: DeviceMesh, preparation: Preparation) -> list[str]:
    """Shard ``model`` in place on ``mesh``, materialise it, load pretrained weights. Returns the FSDP unit names
    (none for a model that is sharded already)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return []
    units = parallelize(model, mesh, preparation.plan)
    materialize_meta_module(model, preparation.device, mesh, rules=preparation.init_rules)
    if preparation.pretrained_weights is not None:
        from lightning_fsdp.checkpoint import load_pretrained

        load_pretrained(model, preparation.pretrained_weights, strict=preparation.strict)
    return units
