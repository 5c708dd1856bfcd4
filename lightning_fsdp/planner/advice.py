"""The verdict against a device budget, and the one change that would make a plan fit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_fsdp.formatting import format_bytes
from lightning_fsdp.planner.estimate import PlanOptions, estimate
from lightning_fsdp.planner.geometry import GPTDims, ModelSpec, gpt_model_spec
from lightning_fsdp.precision import normalize_precision

#: share of the device memory kept free for allocator fragmentation, kernels' workspaces and the runtime
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Verdict:
    fits: bool
    budget: int
    usable: int
    needed: int
    advice: tuple[str, ...]


def verdict(
    spec: ModelSpec, options: PlanOptions, device_bytes: int, *, headroom: float = DEFAULT_HEADROOM, max_world: int = 4096
) -> Verdict:
    """Does the plan fit ``device_bytes`` per rank (minus ``headroom``)? If not, which change would make it fit."""
    if device_bytes <= 0:
        raise ValueError(f"device memory must be positive, got {device_bytes} bytes.")
    usable = int(device_bytes * (1 - headroom))
    est = estimate(spec, options)
    if est.device <= usable:
        return Verdict(True, device_bytes, usable, est.device, ())
    advice: list[str] = []
    if options.strategy != "fsdp":
        fsdp = replace(options, strategy="fsdp")
        need = estimate(spec, fsdp).device
        alone = "fits" if need <= usable else "not enough alone; the advice below assumes it"
        advice.append(f"shard the model with strategy='fsdp_custom': {format_bytes(need)} per rank at {options.world_size} ranks ({alone})")
        options = fsdp
    world = minimum_world_size(spec, options, usable, max_world=max_world)
    if world is not None and world > options.world_size:
        advice.append(f"more ranks: the plan fits with {world} ranks ({world // options.replicate} per replica)")
    if options.replicate > 1:
        flat = replace(options, replicate=1)
        if estimate(spec, flat).device <= usable:
            advice.append("shard across all ranks (replicate_size=1) instead of hybrid replicas")
    if not options.cpu_offload:
        off = estimate(spec, replace(options, cpu_offload=True))
        if off.device <= usable:
            advice.append(
                f"cpu_offload=True: the device keeps {format_bytes(off.device)}; params, grads and optimizer state"
                f" ({format_bytes(off.host)}) move to host memory (slower steps)"
            )
    if options.quantize_base is None and any(p.linear and not p.trainable for u in spec.blocks for p in u.params):
        quantized = estimate(spec, replace(options, quantize_base="nf4"))
        if quantized.device <= usable:
            advice.append(
                f"quantize_base='nf4' (QLoRA): the frozen base in 4 bits; the device keeps {format_bytes(quantized.device)}"
            )
    if spec.has_activation_model and not options.activation_checkpointing:
        ac = estimate(spec, replace(options, activation_checkpointing=True))
        if ac.device <= usable:
            advice.append(
                f"activation checkpointing (activation_checkpointing_policy='auto'): activations"
                f" {format_bytes(est.activations)} → {format_bytes(ac.activations)}, ~1/3 more compute"
            )
    if normalize_precision(options.precision) == "32-true":
        bf16 = estimate(spec, replace(options, precision="bf16-mixed"))
        if bf16.device <= usable:
            advice.append("precision='bf16-mixed' halves gathered parameters and activations")
    if spec.has_activation_model and options.batch_size > 1:
        advice.append("a smaller per-rank batch with accumulate_grad_batches keeps the global batch")
    if not advice:
        advice.append("no single change fits: combine more ranks, cpu_offload and activation checkpointing")
    return Verdict(False, device_bytes, usable, est.device, tuple(advice))


def minimum_world_size(spec: ModelSpec, options: PlanOptions, usable: int, *, max_world: int = 4096) -> Optional[int]:
    """The smallest multiple of ``replicate`` (in powers of two of shard ranks) at which the plan fits ``usable``."""
    if options.strategy != "fsdp":
        return None
    shard = 1
    while shard * options.replicate <= max_world:
        candidate = replace(options, world_size=shard * options.replicate)
        if estimate(spec, candidate).device <= usable:
            return candidate.world_size
        shard *= 2
    return None


def largest_gpt(
    template: GPTDims,
    options: PlanOptions,
    budget: int,
    *,
    max_layers: int = 4096,
) -> Optional[GPTDims]:
    """The deepest variant of ``template`` (same width, vocab, heads) whose plan fits ``budget`` bytes per rank."""
    lo, hi = 0, max_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(gpt_model_spec(replace(template, n_layer=mid)), options).peak <= budget:
            lo = mid
        else:
            hi = mid - 1
    return replace(template, n_layer=lo) if lo >= 1 else None
