"""Memory planner: each rank's bytes for a model before anything is launched (``lightning-fsdp estimate``).

Everything above :func:`main` is plain arithmetic over parameter shapes, so it is unit-testable and runs in
milliseconds for any model size. The model can be described three ways:

- a GPT-style decoder by its dimensions (:class:`GPTDims`, counted from first principles),
- a Hydra model config (built on the meta device: exact shapes, no memory allocated),
- a checkpoint (shapes read from DCP metadata or from a state dict).

What a rank holds under FSDP2 (``fully_shard``), with ``N`` ranks in its shard group:

- parameters, gradients and optimizer state: each tensor is split on dim 0 into ``ceil(dim0 / N)``-row chunks
  (``torch.chunk``), so rank 0 holds the largest shard: the plan reports that rank (the one that runs out first);
- gathered parameters: one unit is all-gathered at a time, plus the next one prefetched, plus the root unit, which
  the strategy keeps gathered from forward into backward; and the unsharded gradients of the unit being
  reduce-scattered;
- activations: a per-layer count for a pre-norm decoder (see :func:`gpt_activation_bytes`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Optional

GiB = 1024**3
MiB = 1024**2

Strategy = Literal["fsdp", "ddp", "single"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd_nomomentum", "none"]

#: precision → (bytes of the stored params/grads/optimizer state, bytes of compute (gathered params, activations))
PRECISION_BYTES: dict[str, tuple[int, int]] = {
    "32-true": (4, 4),
    "64-true": (8, 8),
    "bf16-mixed": (4, 2),
    "16-mixed": (4, 2),
    "bf16-true": (2, 2),
    "16-true": (2, 2),
}
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}

#: tensors of optimizer state per parameter (each the size of the parameter shard, in its stored dtype)
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0, "none": 0}

#: share of the device memory kept free for allocator fragmentation, kernels' workspaces and the runtime
DEFAULT_HEADROOM = 0.10


def normalize_precision(precision: str | int) -> str:
    value = _PRECISION_ALIASES.get(str(precision), str(precision))
    if value not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is not known; choose one of {sorted(PRECISION_BYTES)}.")
    return value


# -- the model: parameter shapes grouped into FSDP units ---------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One parameter tensor: its shape and whether it is trained (has a gradient and optimizer state)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a block, or the root holding everything not inside a block)."""

    name: str
    params: tuple[Param, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True)
class GPTDims:
    """A pre-norm GPT decoder: token (+ learned position) embedding, ``n_layer`` blocks, final norm, LM head.

    Block: LayerNorm → fused QKV projection → causal attention → output projection; LayerNorm → MLP
    (``mlp_ratio × d_model`` hidden). The defaults are GPT-2 (biases everywhere, learned positions);
    :func:`package_gpt` gives the package's own decoder (no linear biases, rotary positions).

    Args:
        bias: the linear layers have biases.
        norm_bias: the LayerNorms have biases.
        learned_pos: a learned ``seq_len × d_model`` position embedding (in the root unit).
        rotary: rotary position embeddings (no parameters; rotated copies of q and k are kept for backward).
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    mlp_ratio: float = 4.0
    tie_weights: bool = True
    bias: bool = True
    norm_bias: bool = True
    learned_pos: bool = True
    rotary: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTDims.{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}.")

    @property
    def d_mlp(self) -> int:
        return int(self.mlp_ratio * self.d_model)


def package_gpt(n_layer: int, d_model: int, n_head: int, vocab_size: int = 256, seq_len: int = 256,
                mlp_ratio: float = 4.0, tie_weights: bool = True) -> GPTDims:
    """The package's decoder (``lightning_fsdp.models.GPTLightningModule``): rotary, no linear biases."""
    return GPTDims(n_layer=n_layer, d_model=d_model, n_head=n_head, vocab_size=vocab_size, seq_len=seq_len,
                   mlp_ratio=mlp_ratio, tie_weights=tie_weights, bias=False, learned_pos=False, rotary=True)


@dataclass(frozen=True)
class ModelSpec:
    """A model for the planner: its FSDP units (the root last) and, for a GPT, its dimensions."""

    name: str
    units: tuple[Unit, ...]
    gpt: Optional[GPTDims] = None

    @property
    def params(self) -> list[Param]:
        return [p for u in self.units for p in u.params]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def root(self) -> Unit:
        return self.units[-1]

    @property
    def blocks(self) -> tuple[Unit, ...]:
        return self.units[:-1]


def _linear(name: str, n_out: int, n_in: int, bias: bool) -> list[Param]:
    return [Param(f"{name}.weight", (n_out, n_in))] + ([Param(f"{name}.bias", (n_out,))] if bias else [])


def _norm(name: str, d: int, bias: bool) -> list[Param]:
    return [Param(f"{name}.weight", (d,))] + ([Param(f"{name}.bias", (d,))] if bias else [])


def gpt_block_params(dims: GPTDims, prefix: str = "") -> list[Param]:
    d, b, nb = dims.d_model, dims.bias, dims.norm_bias
    return [
        *_norm(f"{prefix}ln1", d, nb),
        *_linear(f"{prefix}attn.qkv", 3 * d, d, b),
        *_linear(f"{prefix}attn.proj", d, d, b),
        *_norm(f"{prefix}ln2", d, nb),
        *_linear(f"{prefix}mlp.fc", dims.d_mlp, d, b),
        *_linear(f"{prefix}mlp.proj", d, dims.d_mlp, b),
    ]


def gpt_model_spec(dims: GPTDims, name: str = "gpt") -> ModelSpec:
    """Units of a GPT decoder: one per block, then the root (embeddings, final norm, untied head)."""
    blocks = tuple(Unit(f"blocks.{i}", tuple(gpt_block_params(dims, f"blocks.{i}."))) for i in range(dims.n_layer))
    root = [Param("tok_emb.weight", (dims.vocab_size, dims.d_model))]
    if dims.learned_pos:
        root.append(Param("pos_emb.weight", (dims.seq_len, dims.d_model)))
    root += _norm("ln_f", dims.d_model, dims.norm_bias)
    if not dims.tie_weights:
        root.append(Param("head.weight", (dims.vocab_size, dims.d_model)))
    return ModelSpec(name, (*blocks, Unit("", tuple(root))), dims)


def gpt_param_count(dims: GPTDims) -> int:
    """Parameters of :func:`gpt_model_spec` (≈ ``12·L·d² + V·d`` for mlp_ratio 4)."""
    return gpt_model_spec(dims).numel


def gpt_flops_per_token(dims: GPTDims, *, training: bool = True) -> float:
    """Matmul FLOPs per token: ``2·N`` forward (×3 with backward) plus causal attention scores ``2·L·s·d`` per pass."""
    n = gpt_param_count(dims) - (dims.seq_len * dims.d_model if dims.learned_pos else 0)
    if dims.tie_weights:
        n += dims.vocab_size * dims.d_model  # the head matmul still runs
    forward = 2 * n + 2 * dims.n_layer * dims.seq_len * dims.d_model
    return 3 * forward if training else forward


# -- sharding arithmetic --------------------------------------------------------------------------------------------
def shard_rows(dim0: int, shards: int, rank: int = 0) -> int:
    """Rows of a ``dim0``-row tensor on ``rank`` when split like ``torch.chunk`` (FSDP2's dim-0 sharding)."""
    if shards < 1 or not 0 <= rank < shards:
        raise ValueError(f"rank {rank} is outside a shard group of {shards}.")
    chunk = -(-dim0 // shards)
    return max(0, min(chunk, dim0 - rank * chunk))


def sharded_numel(shape: Sequence[int], shards: int, rank: int = 0) -> int:
    """Elements of one parameter's local shard on ``rank`` (scalars are replicated)."""
    if not shape:
        return 1
    return shard_rows(shape[0], shards, rank) * math.prod(shape[1:])


def padded_numel(shape: Sequence[int], shards: int) -> int:
    """Elements FSDP2 allocates per rank for one parameter: the shard padded to the full chunk."""
    if not shape:
        return 1
    return -(-shape[0] // shards) * math.prod(shape[1:])


# -- the plan --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanOptions:
    """How the model is trained: the choices the estimate depends on.

    ``world_size`` ranks form ``replicate`` replicas, each sharded over ``world_size / replicate`` ranks (HSDP when
    ``replicate > 1``). ``batch_size`` is per rank. ``strategy="ddp"`` keeps full copies (plus DDP's gradient
    buckets); ``"single"`` is one process without a process group.
    """

    world_size: int = 1
    replicate: int = 1
    precision: str = "32-true"
    optimizer: str = "adamw"
    cpu_offload: bool = False
    strategy: str = "fsdp"
    batch_size: int = 1
    seq_len: Optional[int] = None
    activation_checkpointing: bool = False
    prefetch: int = 1
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.replicate < 1 or self.world_size % self.replicate:
            raise ValueError(
                f"replicate={self.replicate} must divide world_size={self.world_size} (replicate × shard = world size)."
            )
        normalize_precision(self.precision)
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {sorted(OPTIMIZER_STATES)}.")
        if self.strategy not in ("fsdp", "ddp", "single"):
            raise ValueError(f"strategy={self.strategy!r}: choose 'fsdp', 'ddp' or 'single'.")
        if self.strategy == "single" and self.world_size != 1:
            raise ValueError("strategy='single' is one process: use world_size=1.")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention={self.attention!r}: choose 'sdpa' (fused, no s² scores kept) or 'eager'.")
        if self.batch_size < 1 or self.prefetch < 0:
            raise ValueError("batch_size must be >= 1 and prefetch >= 0.")

    @property
    def shard(self) -> int:
        return self.world_size // self.replicate if self.strategy == "fsdp" else 1


@dataclass(frozen=True)
class Estimate:
    """Expected bytes on the most loaded rank (rank 0). ``host`` holds what CPU offload moves off the device."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    unsharded_grads: int
    comm_buffers: int
    activations: int
    host: int
    unsharded_state: int
    shard: int
    options: PlanOptions = field(compare=False)
    model_numel: int = 0

    @property
    def state(self) -> int:
        """Sharded training state on this rank: params + grads + optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def ideal_state(self) -> int:
        """The unsharded state divided evenly: what perfect sharding would leave each rank."""
        return self.unsharded_state // self.shard

    @property
    def device(self) -> int:
        """Peak bytes on the accelerator (or in process memory on CPU, where ``host`` is added)."""
        resident = 0 if self.options.cpu_offload else self.state
        return resident + self.gathered + self.unsharded_grads + self.comm_buffers + self.activations

    @property
    def peak(self) -> int:
        """Everything this rank holds at its peak, wherever it lives (``device + host``)."""
        return self.device + self.host

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "options"}
        out.update(state=self.state, ideal_state=self.ideal_state, device=self.device, peak=self.peak)
        out["options"] = asdict(self.options)
        return out


def state_bytes(spec: ModelSpec, options: PlanOptions, rank: int = 0) -> tuple[int, int, int]:
    """Local (params, grads, optimizer) bytes on ``rank`` of its shard group: ``torch.chunk`` rows, no padding.

    This is what :func:`lightning_fsdp.memory.local_state_bytes` measures (``DTensor.to_local()``).
    """
    stored, _ = PRECISION_BYTES[normalize_precision(options.precision)]
    shard = options.shard
    numel = [sharded_numel(p.shape, shard, rank) for p in spec.params]
    trainable = sum(n for n, p in zip(numel, spec.params) if p.trainable)
    params = sum(numel) * stored
    grads = trainable * stored
    optimizer = OPTIMIZER_STATES[options.optimizer] * trainable * stored
    return params, grads, optimizer


def estimate(spec: ModelSpec, options: PlanOptions) -> Estimate:
    """Each rank's expected peak bytes for training ``spec`` under ``options`` (see the module docstring)."""
    stored, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    mixed = options.precision.endswith("-mixed")
    reduce_bytes = stored if mixed else compute
    params, grads, optimizer = state_bytes(spec, options, rank=0)
    full_trainable = sum(p.numel for p in spec.params if p.trainable)
    unsharded_state = (spec.numel + (1 + OPTIMIZER_STATES[options.optimizer]) * full_trainable) * stored

    gathered = unsharded_grads = comm = 0
    if options.strategy == "fsdp":
        largest = max((u.numel for u in spec.blocks), default=0)
        root_trainable = sum(p.numel for p in spec.root.params if p.trainable)
        largest_trainable = max((sum(p.numel for p in u.params if p.trainable) for u in spec.blocks), default=0)
        # root stays gathered from forward into backward; one unit runs while the next is prefetched
        gathered = (spec.root.numel + (1 + options.prefetch) * largest) * compute
        # gradients exist unsharded until their unit's reduce-scatter: the root's for all of backward, plus one unit
        unsharded_grads = (root_trainable + largest_trainable) * reduce_bytes
    elif options.strategy == "ddp":
        comm = full_trainable * reduce_bytes  # DDP's gradient buckets are a second copy of the gradients

    activations = activation_bytes(spec, options)
    host = params + grads + optimizer if options.cpu_offload else 0
    return Estimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        gathered=gathered,
        unsharded_grads=unsharded_grads,
        comm_buffers=comm,
        activations=activations,
        host=host,
        unsharded_state=unsharded_state,
        shard=options.shard,
        options=options,
        model_numel=spec.numel,
    )


def gpt_activation_bytes(
    dims: GPTDims,
    batch_size: int,
    seq_len: Optional[int] = None,
    *,
    compute_bytes: int = 4,
    activation_checkpointing: bool = False,
    attention: str = "sdpa",
) -> int:
    """Bytes autograd keeps between forward and backward for one rank's batch of a GPT decoder.

    Per token and layer, in ``d = d_model`` elements of the compute dtype: the block input and LayerNorm-1 output
    (2d), the fused q|k|v projection (3d), the attention output and the projection's input (2d: a copy unless
    the kernel's layout lets the re-shape be a view, which saves d), the LayerNorm-2 input and output (2d), the
    MLP hidden before and after GELU (2·r·d) — ``(9 + 2r)·d`` — plus fp32 statistics: two per LayerNorm and the
    attention's per-head log-sum-exp. Rotary embeddings add the rotated q and k (2d). Eager attention keeps its
    scores and probabilities instead of the log-sum-exp (``2·h·s`` per token).
    With activation checkpointing each block keeps only its input, and one block is recomputed at a time.
    Outside the blocks: the embedding sum and final norm (2d), and the logits in the compute dtype plus the
    fp32 copy, log-softmax and its gradient that cross entropy holds (``V·(p + 12)`` bytes when ``p < 4``).
    """
    s = seq_len or dims.seq_len
    tokens = batch_size * s
    d, r, p = dims.d_model, dims.mlp_ratio, compute_bytes
    stats = 4 * 4 + (0 if attention == "eager" else dims.n_head * 4)
    elements = int((9 + 2 * r) * d) + (2 * d if dims.rotary else 0)
    per_layer = elements * p + stats + (2 * dims.n_head * s * p if attention == "eager" else 0)
    if activation_checkpointing:
        blocks = dims.n_layer * d * p + per_layer
    else:
        blocks = dims.n_layer * per_layer
    logits = dims.vocab_size * (p + (4 if p < 4 else 0) + 4 + 4)
    outside = 2 * d * p + logits
    return int(tokens * (blocks + outside))


def activation_bytes(spec: ModelSpec, options: PlanOptions) -> int:
    """Activation estimate for GPT-like models; ``0`` (reported as unknown) for other architectures."""
    if spec.gpt is None:
        return 0
    _, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    return gpt_activation_bytes(
        spec.gpt,
        options.batch_size,
        options.seq_len,
        compute_bytes=compute,
        activation_checkpointing=options.activation_checkpointing,
        attention=options.attention,
    )


# -- verdict and advice ----------------------------------------------------------------------------------------------
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
        advice.append(f"shard the model with strategy='fsdp_custom': {_fmt(need)} per rank at {options.world_size} ranks ({alone})")
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
                f"cpu_offload=True: the device keeps {_fmt(off.device)}; params, grads and optimizer state"
                f" ({_fmt(off.host)}) move to host memory (slower steps)"
            )
    if spec.gpt is not None and not options.activation_checkpointing:
        ac = estimate(spec, replace(options, activation_checkpointing=True))
        if ac.device <= usable:
            advice.append(
                f"activation checkpointing (activation_checkpointing_policy='auto'): activations"
                f" {_fmt(est.activations)} → {_fmt(ac.activations)}, ~1/3 more compute"
            )
    if normalize_precision(options.precision) == "32-true":
        bf16 = estimate(spec, replace(options, precision="bf16-mixed"))
        if bf16.device <= usable:
            advice.append("precision='bf16-mixed' halves gathered parameters and activations")
    if spec.gpt is not None and options.batch_size > 1:
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


# -- model sources: config, checkpoint, module -----------------------------------------------------------------------
_GPT_KEYS = {
    "n_layer": ("n_layer", "n_layers", "num_layers", "layers", "depth"),
    "d_model": ("d_model", "n_embd", "hidden_size", "width", "dim", "embed_dim"),
    "n_head": ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads"),
    "vocab_size": ("vocab_size", "vocab", "n_vocab"),
    "seq_len": ("seq_len", "block_size", "max_seq_len", "context_length", "n_positions", "seq"),
    "mlp_ratio": ("mlp_ratio",),
    "tie_weights": ("tie_weights", "tied", "tie_word_embeddings"),
    "bias": ("bias",),
    "norm_bias": ("norm_bias",),
    "learned_pos": ("learned_pos",),
    "rotary": ("rotary",),
}


_REQUIRED_GPT_KEYS = ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")


def gpt_dims_from_mapping(cfg: Any) -> Optional[GPTDims]:
    """GPT dimensions from a config mapping under its usual names, or ``None`` if it is not GPT-shaped."""
    found: dict[str, Any] = {}
    for key, aliases in _GPT_KEYS.items():
        for alias in aliases:
            if alias in cfg and cfg[alias] is not None:
                found[key] = cfg[alias]
                break
    if not all(k in found for k in _REQUIRED_GPT_KEYS):
        return None
    kwargs: dict[str, Any] = {k: int(found[k]) for k in _REQUIRED_GPT_KEYS}
    if "mlp_ratio" in found:
        kwargs["mlp_ratio"] = float(found["mlp_ratio"])
    kwargs.update({k: bool(found[k]) for k in ("tie_weights", "bias", "norm_bias", "learned_pos", "rotary") if k in found})
    return GPTDims(**kwargs)


def spec_from_module(model: Any, name: str = "model", gpt: Optional[GPTDims] = None, policy: Any = "auto") -> ModelSpec:
    """Exact units of an ``nn.Module`` (typically built on the meta device) under the strategy's wrap policy."""
    import warnings

    from lightning_fsdp.wrapping import select_units

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unit_names = select_units(model, policy)
    modules = dict(model.named_modules())
    taken: set[int] = set()
    units: list[Unit] = []
    for unit_name in unit_names:  # deepest first, like fully_shard
        params = []
        for pname, p in modules[unit_name].named_parameters():
            if id(p) not in taken:
                taken.add(id(p))
                params.append(Param(f"{unit_name}.{pname}", tuple(p.shape), p.requires_grad))
        units.append(Unit(unit_name, tuple(params)))
    root = []
    for pname, p in model.named_parameters():
        if id(p) not in taken:
            taken.add(id(p))
            root.append(Param(pname, tuple(p.shape), p.requires_grad))
    units.append(Unit("", tuple(root)))
    return ModelSpec(name, tuple(units), _refine_gpt(model, gpt) if gpt is not None else None)


def _refine_gpt(model: Any, gpt: GPTDims) -> GPTDims:
    """What a config's numbers do not say but the built module shows: biases, position embedding kind."""
    from torch import nn

    modules = list(model.modules())
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    norms = [m for m in modules if isinstance(m, nn.LayerNorm)]
    return replace(
        gpt,
        bias=any(m.bias is not None for m in linears) if linears else gpt.bias,
        norm_bias=any(m.bias is not None for m in norms) if norms else gpt.norm_bias,
        rotary=any("rotary" in type(m).__name__.lower() for m in modules),
        learned_pos=any("pos" in n and p.ndim == 2 for n, p in model.named_parameters()),
    )


def spec_from_shapes(shapes: dict[str, tuple[int, ...]], name: str = "checkpoint", gpt: Optional[GPTDims] = None) -> ModelSpec:
    """Units from parameter names and shapes (a checkpoint): ``<...>.<index>.<...>`` prefixes of repeated
    numbered children become units, the rest is the root."""
    groups: dict[str, list[Param]] = {}
    root: list[Param] = []
    pattern = re.compile(r"^(.*?\.\d+)\.")
    for key, shape in shapes.items():
        m = pattern.match(key)
        (groups.setdefault(m.group(1), []) if m else root).append(Param(key, tuple(shape)))
    units = [Unit(k, tuple(v)) for k, v in groups.items()]
    return ModelSpec(name, (*units, Unit("", tuple(root))), gpt)


def load_config(source: str) -> Any:
    """A model config from a YAML path or ``group=option`` of the packaged Hydra configs (``model=gpt_5m``)."""
    from omegaconf import OmegaConf

    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"--config {source}: no such YAML file.")
        return OmegaConf.load(path)
    if "=" not in source:
        raise ValueError(f"--config {source!r}: give a YAML path or a Hydra `group=option` such as model=gpt_5m.")
    from hydra import compose, initialize_config_module

    group, option = source.split("=", 1)
    with initialize_config_module(config_module="lightning_fsdp.configs", version_base="1.3"):
        try:  # within the main config, so interpolations such as ${data.seq_len} resolve
            cfg = compose(config_name="train", overrides=[f"{group}={option}"])
        except Exception:  # noqa: BLE001 - no main config, or the group is not in its defaults
            cfg = compose(config_name=None, overrides=[f"+{group}={option}"])
    return cfg[group]


def spec_from_config(cfg: Any, name: str = "config", instantiate: bool = True) -> ModelSpec:
    """Exact shapes by building the configured model on the meta device; falls back to the GPT formula."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, DictConfig):
        try:
            plain = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException:  # a lone YAML file that interpolates other groups: keep what is literal
            raw = OmegaConf.to_container(cfg, resolve=False)
            plain = {k: v for k, v in raw.items() if not (isinstance(v, str) and "${" in v)}
            cfg = OmegaConf.create(plain)
    else:
        plain = dict(cfg)
    gpt = gpt_dims_from_mapping(plain)
    if instantiate and "_target_" in plain:
        try:
            return spec_from_module(_build_on_meta(cfg), name, gpt)
        except Exception as err:  # noqa: BLE001 - report and fall back to the formula when possible
            if gpt is None:
                raise ValueError(f"Could not build the model in config {name!r} on the meta device: {err}") from err
    if gpt is None:
        raise ValueError(
            f"Config {name!r} has no `_target_` to build and no GPT dimensions"
            f" ({', '.join(_REQUIRED_GPT_KEYS)})."
        )
    return gpt_model_spec(gpt, name)


def _build_on_meta(cfg: Any) -> Any:
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        model = instantiate(cfg)
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    return model


def shapes_from_checkpoint(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter shapes from a sharded checkpoint directory (DCP ``.metadata``) or a file holding a state dict.

    Only model weights are kept: ``state_dict.`` keys of a Lightning checkpoint (optimizer entries are dropped).
    """
    path = Path(path)
    if path.is_dir():
        meta = path / ".metadata"
        if not meta.is_file():
            raise FileNotFoundError(f"{path} has no DCP `.metadata`: not a sharded checkpoint directory.")
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from lightning_fsdp.checkpoint.safe_load import read_metadata

        metadata = read_metadata(path)  # a restricted unpickler: a crafted .metadata cannot run code
        shapes = {
            k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
    elif path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    else:
        import torch

        obj = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        sd = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
        shapes = {k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}
    model = {
        _strip_prefix(k): v for k, v in shapes.items() if not k.startswith(("optimizer", "optim", "lr_scheduler"))
    }
    if not model:
        raise ValueError(f"No parameter shapes found in {path}.")
    return model


def checkpoint_hparams(path: str | Path) -> dict[str, Any]:
    """The LightningModule's saved hyper-parameters (``hyper_parameters``), or ``{}``: read without running code."""
    path = Path(path)
    try:
        if path.is_dir():
            if not (path / "meta.pt").is_file():
                return {}
            from lightning_fsdp.checkpoint.safe_load import safe_torch_load

            obj = safe_torch_load(path / "meta.pt")
        elif path.suffix in (".ckpt", ".pt", ".pth"):
            import torch

            obj = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        else:
            return {}
    except Exception:  # noqa: BLE001 - hyper-parameters are optional; shapes alone still give the state bytes
        return {}
    hparams = obj.get("hyper_parameters") if isinstance(obj, dict) else None
    return dict(hparams) if isinstance(hparams, dict) else {}


def spec_from_checkpoint(path: str | Path, n_head: Optional[int] = None, seq_len: Optional[int] = None) -> ModelSpec:
    """Shapes from the checkpoint, GPT dimensions from its hyper-parameters (or from the shapes and ``n_head``).

    A state dict names a tied embedding/head twice; when the hyper-parameters say the weights are tied, the head
    (same shape as the embedding) is counted once.
    """
    shapes = shapes_from_checkpoint(path)
    hparams = checkpoint_hparams(path)
    if seq_len is not None:
        hparams = {**hparams, "seq_len": seq_len}
    gpt = gpt_dims_from_mapping(hparams) if hparams else None
    if gpt is None and n_head:
        gpt = infer_gpt_from_shapes(shapes, n_head, seq_len)
    if gpt is not None:
        gpt = replace(
            gpt,
            learned_pos=any("pos" in k and len(s) == 2 for k, s in shapes.items()),
            bias=any(re.search(r"\.\d+\..*(proj|fc|qkv|out|attn|mlp).*\.bias$", k) for k in shapes),
        )
        gpt = replace(gpt, rotary=not gpt.learned_pos)
        if gpt.tie_weights:
            emb = [s for k, s in shapes.items() if len(s) == 2 and ("emb" in k or "wte" in k)]
            shapes = {k: s for k, s in shapes.items() if not (k.endswith("head.weight") and emb and s == emb[0])}
    return spec_from_shapes(shapes, Path(path).name, gpt)


def _strip_prefix(key: str) -> str:
    """``state_dict/net.x`` (this package's sharded format) or ``state_dict.net.x`` (plain DCP) → ``net.x``."""
    for prefix in ("state_dict/", "state_dict.", "model/", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def infer_gpt_from_shapes(shapes: dict[str, tuple[int, ...]], n_head: int, seq_len: Optional[int]) -> Optional[GPTDims]:
    """GPT dimensions from a checkpoint's shapes (embedding = vocab × width, count numbered blocks)."""
    emb = [s for k, s in shapes.items() if len(s) == 2 and ("emb" in k or "wte" in k)]
    if not emb:
        return None
    vocab, d = max(emb, key=lambda s: s[0])
    layers = {m.group(1) for k in shapes if (m := re.match(r"^(.*?\.\d+)\.", k))}
    pos = [s[0] for k, s in shapes.items() if len(s) == 2 and ("pos" in k or "wpe" in k)]
    seq = seq_len or (pos[0] if pos else None)
    if not layers or seq is None or d % n_head:
        return None
    return GPTDims(n_layer=len(layers), d_model=d, n_head=n_head, vocab_size=vocab, seq_len=seq)


# -- output ------------------------------------------------------------------------------------------------------------
def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _fmt(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5e9"`` → bytes (GB = 10⁹, GiB = 2³⁰)."""
    units = {"kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024 * GiB, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 1024, "m": MiB, "g": GiB, "b": 1}
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))


def format_estimate(spec: ModelSpec, est: Estimate, v: Optional[Verdict] = None) -> str:
    o = est.options
    mesh = f"{o.replicate} × {o.shard}" if o.strategy == "fsdp" else f"{o.world_size} replicas"
    lines = [
        f"model {spec.name}: {_count(spec.numel)} parameters in {len(spec.units)} units"
        f" (largest block {_count(max((u.numel for u in spec.blocks), default=0))}, root {_count(spec.root.numel)})",
        f"strategy {o.strategy}, world {o.world_size} (mesh replicate × shard = {mesh}), precision {o.precision},"
        f" optimizer {o.optimizer}, cpu_offload={o.cpu_offload}, activation checkpointing={o.activation_checkpointing}",
        "",
        "| per rank (rank 0, the largest shard) | bytes | |",
        "|---|---:|---|",
        f"| parameters | {_fmt(est.params)} | |",
        f"| gradients | {_fmt(est.grads)} | |",
        f"| optimizer state | {_fmt(est.optimizer)} | {OPTIMIZER_STATES[o.optimizer]} state(s) per parameter |",
        f"| = sharded state | {_fmt(est.state)} | ideal state / {est.shard} = {_fmt(est.ideal_state)} |",
        f"| gathered params (root + unit + prefetch) | {_fmt(est.gathered)} | |",
        f"| unsharded grads before reduce-scatter | {_fmt(est.unsharded_grads)} | |",
    ]
    if est.comm_buffers:
        lines.append(f"| DDP gradient buckets | {_fmt(est.comm_buffers)} | |")
    act_note = "" if spec.gpt is not None else "unknown for non-GPT models: not included"
    lines.append(f"| activations (batch {o.batch_size}) | {_fmt(est.activations)} | {act_note} |")
    lines.append(f"| **device peak** | **{_fmt(est.device)}** | |")
    if est.host:
        lines.append(f"| host (offloaded state) | {_fmt(est.host)} | |")
    if v is not None:
        lines.append("")
        state = "FITS" if v.fits else "DOES NOT FIT"
        lines.append(f"verdict: {state} — needs {_fmt(v.needed)} of {_fmt(v.usable)} usable ({_fmt(v.budget)} minus headroom)")
        lines += [f"  - {a}" for a in v.advice]
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-fsdp estimate",
        description="Each rank's expected memory for training a model with fsdp_custom (or ddp), before launching.",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--config", help="Hydra model config: a YAML path or `group=option` (e.g. model=gpt_5m)")
    src.add_argument("--checkpoint", help="a sharded checkpoint directory or a .ckpt/.pt/.safetensors file")
    src.add_argument("--layers", type=int, help="GPT: number of blocks")
    src.add_argument("--width", type=int, help="GPT: d_model")
    src.add_argument("--vocab", type=int, default=None, help="GPT: vocabulary size")
    src.add_argument("--heads", type=int, default=None, help="GPT: attention heads (for activations)")
    src.add_argument("--seq", type=int, default=None, help="sequence length (overrides the model's)")
    src.add_argument("--mlp-ratio", type=float, default=4.0)
    src.add_argument("--untied", action="store_true", help="GPT: LM head not tied to the embedding")
    run = p.add_argument_group("training setup")
    run.add_argument("--world-size", "-n", type=int, default=1)
    run.add_argument("--replicate", type=int, default=1, help="HSDP replicas (mesh replicate × shard)")
    run.add_argument("--precision", default="32-true", help=f"one of {sorted(PRECISION_BYTES)}")
    run.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    run.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp", "single"])
    run.add_argument("--cpu-offload", action="store_true")
    run.add_argument("--batch-size", type=int, default=1, help="per rank")
    run.add_argument("--activation-checkpointing", action="store_true")
    run.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    run.add_argument("--device-memory", help="per-rank memory to check against, e.g. 80GiB, 24GB, 512MiB")
    run.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="share of device memory kept free")
    run.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def resolve_spec(args: argparse.Namespace) -> ModelSpec:
    """The model the command line describes (exactly one source)."""
    sources = [s for s in ("config", "checkpoint", "layers") if getattr(args, s) is not None]
    if len(sources) != 1:
        raise ValueError("Describe the model with exactly one of --config, --checkpoint or --layers/--width/--vocab.")
    if args.config is not None:
        cfg = load_config(args.config)
        spec = spec_from_config(cfg, name=args.config)
    elif args.checkpoint is not None:
        spec = spec_from_checkpoint(args.checkpoint, args.heads, args.seq)
    else:
        if args.width is None or args.vocab is None:
            raise ValueError("--layers needs --width and --vocab (and --heads, --seq for the activation estimate).")
        heads = args.heads or max(1, args.width // 64)
        dims = GPTDims(
            n_layer=args.layers, d_model=args.width, n_head=heads, vocab_size=args.vocab,
            seq_len=args.seq or 1024, mlp_ratio=args.mlp_ratio, tie_weights=not args.untied,
        )
        spec = gpt_model_spec(dims, f"gpt L{args.layers} d{args.width} V{args.vocab}")
    if spec.gpt is not None and args.seq is not None:
        spec = replace(spec, gpt=replace(spec.gpt, seq_len=args.seq))
    return spec


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-fsdp estimate``: print the per-rank plan and, with ``--device-memory``, a verdict and advice."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        spec = resolve_spec(args)
        options = PlanOptions(
            world_size=args.world_size, replicate=args.replicate, precision=normalize_precision(args.precision),
            optimizer=args.optimizer, cpu_offload=args.cpu_offload, strategy=args.strategy,
            batch_size=args.batch_size, seq_len=args.seq, activation_checkpointing=args.activation_checkpointing,
            attention=args.attention,
        )
        est = estimate(spec, options)
        v = verdict(spec, options, parse_bytes(args.device_memory), headroom=args.headroom) if args.device_memory else None
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-fsdp estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out: dict[str, Any] = {"model": spec.name, "numel": spec.numel, **est.as_dict()}
        if v is not None:
            out["verdict"] = asdict(v)
        print(json.dumps(out, indent=2))
    else:
        print(format_estimate(spec, est, v))
    return 0 if v is None or v.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
