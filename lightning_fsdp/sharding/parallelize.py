"""Apply a sharding plan to a model in the one order that works: activation checkpointing → the frozen base
quantized (``quantize_base``) → the other frozen parameters held in the compute dtype (``*-mixed``) →
``torch.compile`` each unit → ``fully_shard`` each unit bottom-up → the root.

Every function takes ``(model, mesh, options)`` and returns what it did, so it is usable and testable without a
Trainer.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from lightning_fsdp._torch_compat import composable_checkpoint
from lightning_fsdp.parallel.collectives import rank
from lightning_fsdp.sharding.comm_buffers import HostBufferPool, reuse_host_comm_buffers
from lightning_fsdp.sharding.compile import CompileArg, compile_options, compile_units
from lightning_fsdp.sharding.policy import WrapPolicy, validate_policy
from lightning_fsdp.sharding.quantize import QuantizedBase, check_method, device_of, quantize_units
from lightning_fsdp.sharding.units import select_units

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy


@dataclass(frozen=True)
class ShardingPlan:
    """How a model is sharded (the strategy builds it from its constructor arguments)."""

    wrap_policy: WrapPolicy = "auto"
    activation_checkpointing: WrapPolicy = None
    mp_policy: Optional[MixedPrecisionPolicy] = None
    offload_policy: Optional[OffloadPolicy] = None
    reshard_after_forward: Union[bool, int] = True
    compile: CompileArg = False
    quantize_base: Optional[str] = None
    #: units of one shape hand their host all-gather and reduce-scatter buffers on (:mod:`.comm_buffers`)
    reuse_host_buffers: bool = True

    def __post_init__(self) -> None:
        compile_options(self.compile)  # validates
        check_method(self.quantize_base)
        validate_policy(self.wrap_policy, "auto_wrap_policy")
        validate_policy(self.activation_checkpointing, "activation_checkpointing_policy")
        if not isinstance(self.reshard_after_forward, (bool, int)):
            raise TypeError(f"`reshard_after_forward` must be a bool or an int, got {self.reshard_after_forward!r}.")


def apply_activation_checkpointing(model: nn.Module, policy: WrapPolicy) -> list[str]:
    """Recompute the selected modules' activations in backward. Returns the names checkpointed.

    Uses the composable ``checkpoint`` API, which keeps parameter names (and so checkpoints) unchanged.
    """
    if policy is None or policy is False:
        return []
    names = select_units(model, policy, arg_name="activation_checkpointing_policy")
    modules = dict(model.named_modules())
    for name in names:
        composable_checkpoint(modules[name])
    return names


def store_frozen_in_compute_dtype(
    model: nn.Module, mp_policy: MixedPrecisionPolicy, skip: Collection[str] = ()
) -> list[str]:
    """Hold every frozen floating-point parameter in the policy's compute dtype (``param_dtype``); returns their names.

    FSDP2 casts each parameter to ``param_dtype`` for its all-gather, and no optimizer updates a frozen one, so an
    fp32 copy of it (a LoRA run's embedding, head and norms) costs twice the bytes for bit-identical compute.
    Quantized weights (``skip``) and other tensor subclasses keep their own format.
    """
    dtype = mp_policy.param_dtype
    if dtype is None:
        return []
    changed = []
    for name, param in model.named_parameters():
        if param.requires_grad or not param.is_floating_point() or param.dtype == dtype or name in skip:
            continue
        if type(param.data) is not torch.Tensor:  # e.g. an NF4 weight
            continue
        param.data = param.data.to(dtype)  # the same Parameter: ties and references stay
        changed.append(name)
    return changed


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    policy: WrapPolicy,
    *,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    reshard_after_forward: Union[bool, int] = True,
    compile: CompileArg = False,
    quantize_base: Optional[str] = None,
) -> tuple[list[str], Optional[QuantizedBase]]:
    """``fully_shard`` each selected unit bottom-up, then the root (each unit compiled first, with ``compile``; the
    frozen linear weights inside units quantized first, with ``quantize_base``). Returns the unit names (root is
    ``""``) and what was quantized.

    Idempotent: a model whose root is already an ``FSDPModule`` is left untouched.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return [], None
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    names = select_units(model, policy)
    quantized = quantize_units(model, names, mesh, quantize_base, device_of(mesh)) if quantize_base else None
    if quantized is not None and mesh.size(mesh.ndim - 1) == 1:
        # one rank per shard holds each quantized weight whole: FSDP2 gathers a one-rank group by copying a single
        # tensor, which a quantized weight (several) is not, so FSDP leaves them alone and they compute as they are
        kwargs["ignored_params"] = {model.get_parameter(name) for name in quantized.names} or None
        if isinstance(offload_policy, CPUOffloadPolicy) and quantized.names and rank() == 0:
            warnings.warn(
                f"cpu_offload with quantize_base={quantize_base!r} on one rank per shard group: the"
                f" {len(quantized.names)} quantized weights stay on the device (only groups of 2+ ranks offload them);"
                " everything else is offloaded.",
                stacklevel=3,
            )
    store_frozen_in_compute_dtype(model, kwargs["mp_policy"], quantized.names if quantized is not None else ())
    compile_units(model, [*names, ""], compile)
    modules = dict(model.named_modules())
    for name in names:
        fully_shard(modules[name], reshard_after_forward=reshard_after_forward, **kwargs)
    # the root's parameters are needed again right at the start of backward: keep them gathered
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return names + [""], quantized


@dataclass(frozen=True)
class Sharded:
    """What :func:`parallelize` did: the FSDP units (the root is ``""``), the modules that recompute activations,
    the units whose forward is compiled, the frozen weights held quantized, and the pool the units of one shape
    take their host communication buffers from."""

    units: list[str]
    checkpointed: list[str]
    compiled: list[str]
    quantized: Optional[QuantizedBase] = None
    comm_buffers: Optional[HostBufferPool] = None


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan) -> Sharded:
    """Activation checkpointing, the frozen base quantized, then FSDP units bottom-up and the root; then units of
    one shape share their host communication buffers."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return Sharded([], [], [])
    checkpointed = apply_activation_checkpointing(model, plan.activation_checkpointing)
    units, quantized = shard_model(
        model,
        mesh,
        plan.wrap_policy,
        mp_policy=plan.mp_policy,
        offload_policy=plan.offload_policy,
        reshard_after_forward=plan.reshard_after_forward,
        compile=plan.compile,
        quantize_base=plan.quantize_base,
    )
    modules = dict(model.named_modules())
    pool = reuse_host_comm_buffers([modules[name] for name in units]) if plan.reuse_host_buffers else None
    options = compile_options(plan.compile)
    compiled = [] if options is None else [u for u in units if u or options.get("root")]
    return Sharded(units, checkpointed, compiled, quantized, pool)
