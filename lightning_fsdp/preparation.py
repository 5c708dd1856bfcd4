"""From the user's module to a sharded, initialised model on this rank: the one order every step happens in.

activation checkpointing → the frozen base quantized (``quantize_base``) → ``fully_shard`` units bottom-up and the
root → allocate and initialise each rank's shards (meta-device models: by the library's own initialisers, skipping
what the pretrained files will overwrite) → pretrained weights straight into the shards (quantized as they load).

Pretrained safetensors (a Hugging Face directory or one file) are read shard by shard on every rank
(:mod:`lightning_fsdp.hf.load`); other files (``.ckpt``/``.pt``) are read by rank 0 and broadcast tensor by tensor.
A plain function of ``(model, mesh, options)``, so it runs without a Trainer (the strategy's ``setup`` calls it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from lightning_fsdp.checkpoint.base_weights import BaseReference
from lightning_fsdp.hf.base import loaded_base
from lightning_fsdp.hf.init_rules import LIBRARY_RULES
from lightning_fsdp.sharding import DEFAULT_RULES, Sharded, ShardingPlan, materialize_meta_module, parallelize
from lightning_fsdp.sharding.comm_buffers import HostBufferPool
from lightning_fsdp.sharding.quantize import QuantizedBase

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Preparation:
    """Everything :func:`prepare_model` needs besides the model and the mesh."""

    plan: ShardingPlan
    device: torch.device
    pretrained_weights: Optional[Union[str, Path]] = None
    strict: bool = True
    key_map: Optional[Mapping[str, str]] = None


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_model` did: the FSDP units, the pretrained base it loaded from safetensors, the frozen
    weights it holds quantized, and the pool of host communication buffers its units of one shape share."""

    units: list[str] = field(default_factory=list)
    base: Optional[BaseReference] = None
    quantized: Optional[QuantizedBase] = None
    comm_buffers: Optional[HostBufferPool] = None


def prepare_model(model: nn.Module, mesh: DeviceMesh, preparation: Preparation) -> Prepared:
    """Shard ``model`` in place on ``mesh``, materialise it, load pretrained weights (every rank). A model that is
    sharded already is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_fsdp.hf.load import is_safetensors_source, load_safetensors, planned_keys

    if isinstance(model, FSDPModule):
        return Prepared()
    sharded = parallelize(model, mesh, preparation.plan)
    units = sharded.units
    _train_hf_models_without_cache(model, sharded)
    source = preparation.pretrained_weights
    sharded_source = source if source is not None and is_safetensors_source(source) else None
    loaded = (
        planned_keys(model, sharded_source, strict=preparation.strict, key_map=preparation.key_map)
        if sharded_source is not None
        else ()
    )
    materialize_meta_module(model, preparation.device, mesh, rules=LIBRARY_RULES + DEFAULT_RULES, loaded=loaded)
    base = None
    if sharded_source is not None:
        plan = load_safetensors(model, sharded_source, strict=preparation.strict, key_map=preparation.key_map)
        base = loaded_base(plan, preparation.key_map)
    elif source is not None:
        from lightning_fsdp.checkpoint import load_pretrained

        load_pretrained(model, source, strict=preparation.strict)
    return Prepared(units, base, sharded.quantized, sharded.comm_buffers)


def _train_hf_models_without_cache(model: nn.Module, sharded: Sharded) -> None:
    """Checkpointed or compiled blocks of a HF model: its training forward builds no KV cache (one notice)."""
    import warnings

    from lightning_fsdp.hf.cache import train_without_cache
    from lightning_fsdp.parallel.collectives import rank

    hooked = train_without_cache(model, sharded.checkpointed + sharded.compiled)
    if hooked and rank() == 0:
        what = " and ".join(w for w, on in (("activation checkpointing", sharded.checkpointed), ("compile", sharded.compiled)) if on)
        warnings.warn(
            f"{what} of Hugging Face blocks: {', '.join(repr(h or type(model).__name__) for h in hooked)} run"
            " the training forward with use_cache=False, as transformers' gradient_checkpointing_enable does (a KV"
            " cache built in training is appended to again when a block is recomputed, and makes compiled blocks"
            " recompile per layer); eval and generate keep config.use_cache.",
            stacklevel=3,
        )
