"""GRPO's memory, planned: a step is a rollout (decoding ``num_generations`` completions per prompt on the sharded
model) and then training on them, and its peak is the larger of the two (:func:`grpo_estimate`).

- **Rollout.** The sharded state (and a reference copy) stays; on top of it the parameters being decoded with (every
  unit at once in ``gather_once`` mode, the compute dtype; one unit beside the root, as training, in ``stream``
  mode), the key/value cache of every row decoded at once over prompt + completion tokens, and one step's logits.
- **Training.** The ordinary training estimate (:func:`~lightning_fsdp.planner.estimate`) of ``prompts ×
  num_generations`` rows of ``prompt + completion`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_fsdp.planner.estimate import PRECISION_BYTES, Estimate, PlanOptions, gathered_bytes, estimate, quantized_params
from lightning_fsdp.planner.geometry import ModelSpec
from lightning_fsdp.precision import normalize_precision

__all__ = ["GRPOPlan", "RolloutEstimate", "grpo_estimate", "rollout_estimate"]

ROLLOUT_PLAN_MODES = ("gather_once", "stream")


@dataclass(frozen=True)
class GRPOPlan:
    """A GRPO run's shape: ``PlanOptions.batch_size`` counts prompts per rank; each gets ``num_generations``
    completions of at most ``completion_length`` tokens after a prompt of at most ``prompt_length``."""

    num_generations: int
    completion_length: int
    prompt_length: int
    mode: str = "gather_once"
    #: completions decoded at once (default: every completion of the rank's prompts)
    generation_rows: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_PLAN_MODES:
            raise ValueError(f"rollout mode {self.mode!r}: choose one of {ROLLOUT_PLAN_MODES}.")
        if min(self.num_generations, self.completion_length, self.prompt_length) < 1:
            raise ValueError("num_generations, completion_length and prompt_length must be >= 1.")


@dataclass(frozen=True)
class RolloutEstimate:
    """The rollout's bytes on the most loaded rank."""

    resident: int  # sharded state and reference, as in training
    gathered: int
    kv_cache: int
    logits: int

    @property
    def peak(self) -> int:
        return self.resident + self.gathered + self.kv_cache + self.logits


def rollout_estimate(spec: ModelSpec, options: PlanOptions, plan: GRPOPlan, training: Estimate) -> RolloutEstimate:
    """The rollout's peak beside the state ``training`` planned."""
    if spec.llama is None:
        raise ValueError("GRPO plans need a Llama-family decoder (--hf-config): its key/value cache is counted from"
                         " its layers and key/value heads.")
    _, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    dims = spec.llama
    rows = plan.generation_rows or options.batch_size * plan.num_generations
    tokens = plan.prompt_length + plan.completion_length
    kv_cache = 2 * dims.n_layer * dims.kv_dim * rows * tokens * compute
    logits = rows * dims.vocab_size * 4 * 3  # one step's logits, their fp32 copy and the sampler's softmax
    quantized = quantized_params(spec, options)
    if options.strategy != "fsdp" or plan.mode == "stream":
        gathered = training.gathered if options.strategy == "fsdp" else 0
    else:
        gathered = gathered_bytes(spec.params, quantized, compute)
    resident = training.on_device_when_offloaded if options.cpu_offload else training.state + training.reference
    return RolloutEstimate(resident, gathered, kv_cache, logits)


def grpo_estimate(spec: ModelSpec, options: PlanOptions, plan: GRPOPlan) -> tuple[Estimate, RolloutEstimate, int]:
    """``(training, rollout, peak)``: the training estimate of the step's completions, the rollout's, and the larger
    of their device peaks."""
    rows = options.batch_size * plan.num_generations
    training = estimate(spec, replace(options, batch_size=rows, seq_len=plan.prompt_length + plan.completion_length))
    rollout = rollout_estimate(spec, options, plan, training)
    return training, rollout, max(training.device, rollout.peak)


def describe(rollout: RolloutEstimate, training: Estimate, plan: GRPOPlan) -> dict[str, Any]:
    return {"mode": plan.mode, "rollout_peak": rollout.peak, "kv_cache": rollout.kv_cache,
            "rollout_gathered": rollout.gathered, "rollout_logits": rollout.logits, "training_peak": training.device}
