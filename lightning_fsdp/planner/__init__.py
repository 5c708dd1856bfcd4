"""Memory planner: each rank's bytes for a model before anything is launched (``lightning-fsdp estimate``).

Everything here is plain arithmetic over parameter shapes, so it is unit-testable and runs in milliseconds for any
model size. The model can be described three ways (:mod:`.sources`): a GPT-style decoder by its dimensions
(:class:`GPTDims`, counted from first principles in :mod:`.geometry`), a Hydra model config (built on the meta
device: exact shapes, no memory allocated), or a checkpoint (shapes read from DCP metadata or a state dict).

What a rank holds under FSDP2 (``fully_shard``), with ``N`` ranks in its shard group (:mod:`.estimate`):

- parameters, gradients and optimizer state: each tensor is split on dim 0 into ``ceil(dim0 / N)``-row chunks
  (``torch.chunk``), so rank 0 holds the largest shard: the plan reports that rank (the one that runs out first);
- gathered parameters: one unit is all-gathered at a time, plus the next one prefetched, plus the root unit, which
  the strategy keeps gathered from forward into backward; and the unsharded gradients of the unit being
  reduce-scattered;
- activations: a per-layer count for a pre-norm decoder (see :func:`gpt_activation_bytes`).

:mod:`.advice` turns an estimate into a verdict against a device budget; :mod:`.cli` is the command.
"""

from lightning_fsdp.formatting import GiB, MiB, parse_bytes
from lightning_fsdp.planner.advice import DEFAULT_HEADROOM, Verdict, largest_gpt, minimum_world_size, verdict
from lightning_fsdp.planner.cli import format_estimate, main, resolve_spec
from lightning_fsdp.planner.estimate import (
    OPTIMIZER_STATES,
    PRECISION_BYTES,
    Estimate,
    PlanOptions,
    activation_bytes,
    estimate,
    gpt_activation_bytes,
    padded_numel,
    shard_rows,
    sharded_numel,
    state_bytes,
)
from lightning_fsdp.planner.geometry import (
    GPTDims,
    ModelSpec,
    Param,
    Unit,
    gpt_block_params,
    gpt_flops_per_token,
    gpt_model_spec,
    gpt_param_count,
    package_gpt,
)
from lightning_fsdp.planner.sources import (
    checkpoint_hparams,
    gpt_dims_from_mapping,
    infer_gpt_from_shapes,
    load_config,
    shapes_from_checkpoint,
    spec_from_checkpoint,
    spec_from_config,
    spec_from_module,
    spec_from_shapes,
)
from lightning_fsdp.precision import normalize_precision

__all__ = [
    "DEFAULT_HEADROOM",
    "OPTIMIZER_STATES",
    "PRECISION_BYTES",
    "Estimate",
    "GPTDims",
    "GiB",
    "MiB",
    "ModelSpec",
    "Param",
    "PlanOptions",
    "Unit",
    "Verdict",
    "activation_bytes",
    "checkpoint_hparams",
    "estimate",
    "format_estimate",
    "gpt_activation_bytes",
    "gpt_block_params",
    "gpt_dims_from_mapping",
    "gpt_flops_per_token",
    "gpt_model_spec",
    "gpt_param_count",
    "infer_gpt_from_shapes",
    "largest_gpt",
    "load_config",
    "main",
    "minimum_world_size",
    "normalize_precision",
    "package_gpt",
    "padded_numel",
    "parse_bytes",
    "resolve_spec",
    "shapes_from_checkpoint",
    "shard_rows",
    "sharded_numel",
    "spec_from_checkpoint",
    "spec_from_config",
    "spec_from_module",
    "spec_from_shapes",
    "state_bytes",
    "verdict",
]
