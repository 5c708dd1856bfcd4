"""The plan: each rank's bytes of sharded state, gathered units, unsharded gradients and activations.

Byte sizes per precision come from the package's one precision table (:data:`lightning_fsdp.precision.PRECISIONS`).
With ``quantize_base="nf4"`` the frozen linear weights inside blocks are stored, gathered and offloaded in NF4
(:func:`lightning_fsdp.sharding.nf4.bytes_per_element`), and the one weight being dequantized for its matmul adds
itself in the compute dtype plus one step's transient while it computes (:func:`dequantize_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_fsdp.loss.preference import REFERENCE_MODES
from lightning_fsdp.planner.geometry import GPTDims, ModelSpec, Param
from lightning_fsdp.planner.loss import loss_bytes
from lightning_fsdp.precision import PRECISIONS, normalize_precision
from lightning_fsdp.sharding import nf4
from lightning_fsdp.sharding.quantize import METHODS as QUANTIZE_METHODS

#: precision → (bytes of the stored params/grads/optimizer state, bytes of compute (gathered params, activations))
PRECISION_BYTES: dict[str, tuple[int, int]] = {
    name: (spec.stored_bytes, spec.compute_bytes) for name, spec in PRECISIONS.items()
}

#: tensors of optimizer state per parameter (each the size of the parameter shard, in its stored dtype)
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0, "none": 0}

#: bytes of transient per byte of 4-bit codes while one step of a weight is dequantized (the codes widened to int64,
#: the bf16 levels and the scaled values): about 12.5 measured; :func:`dequantize_bytes` adds the result itself
DEQUANTIZE_BYTES_PER_CODE_BYTE = 13
#: what one quantized tensor stores besides its elements: the scaler mean (bf16) and the 16 levels (bf16)
NF4_TENSOR_OVERHEAD = 2 + 16 * 2


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
    quantize_base: Optional[str] = None
    #: tokens per chunk of a chunked loss (``HFCausalLM``'s default, ``loss_chunk=`` of either example model);
    #: ``None``: the whole logits (the GPT example's default)
    loss_chunk: Optional[int] = None
    #: DPO's reference model (``HFPreferenceLM(reference=...)``): ``"copy"`` holds a frozen sharded copy of the base
    #: (1/N of it per rank); ``"adapters_off"`` (LoRA) and ``"precomputed"`` hold nothing more; ``None``: no DPO
    reference: Optional[str] = None
    #: ranks that split each sequence (ring attention): activations of ``seq_len / context_parallel`` tokens per
    #: rank; parameters stay sharded over every rank of a replica
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if self.reference not in (None, *REFERENCE_MODES):
            raise ValueError(f"reference={self.reference!r}: choose one of {REFERENCE_MODES} or None.")
        if self.quantize_base is not None and self.quantize_base not in QUANTIZE_METHODS:
            raise ValueError(f"quantize_base={self.quantize_base!r}: choose one of {sorted(QUANTIZE_METHODS)} or None.")
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
        if self.context_parallel < 1 or (self.world_size // self.replicate) % self.context_parallel:
            raise ValueError(f"context_parallel={self.context_parallel} must divide the ranks of a replica"
                             f" ({self.world_size // self.replicate}).")
        if self.context_parallel > 1 and self.strategy != "fsdp":
            raise ValueError("context_parallel needs strategy='fsdp'.")
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
    dequantized: int = 0
    on_device_when_offloaded: int = 0
    #: a frozen reference copy's parameters on this rank (DPO, ``reference="copy"``)
    reference: int = 0
    #: what a unit's all-gather holds beyond the computing moment's ``gathered + dequantized`` (see
    #: :func:`all_gather_moment`)
    all_gather_buffers: int = 0

    @property
    def state(self) -> int:
        """Sharded training state on this rank: params + grads + optimizer state (a reference copy is not state)."""
        return self.params + self.grads + self.optimizer

    @property
    def ideal_state(self) -> int:
        """The unsharded state divided evenly: what perfect sharding would leave each rank."""
        return self.unsharded_state // self.shard

    @property
    def device(self) -> int:
        """Peak bytes on the accelerator (or in process memory on CPU, where ``host`` is added)."""
        resident = self.on_device_when_offloaded if self.options.cpu_offload else self.state + self.reference
        transient = (self.gathered + self.dequantized + self.all_gather_buffers + self.unsharded_grads
                     + self.comm_buffers + self.activations)
        return resident + transient

    @property
    def peak(self) -> int:
        """Everything this rank holds at its peak, wherever it lives (``device + host``)."""
        return self.device + self.host

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "options"}
        out.update(state=self.state, ideal_state=self.ideal_state, device=self.device, peak=self.peak)
        out["options"] = asdict(self.options)
        return out


def quantized_params(spec: ModelSpec, options: PlanOptions) -> set[str]:
    """The parameters ``quantize_base`` holds quantized: frozen linear weights inside blocks whose shards hold
    whole scaler blocks (:func:`lightning_fsdp.sharding.nf4.shard_fits`), as the strategy chooses them."""
    if options.quantize_base is None or options.strategy != "fsdp":
        return set()
    return {
        p.name for u in spec.blocks for p in u.params
        if p.linear and not p.trainable and nf4.shard_fits(p.shape, options.shard)
    }


def _quantized_bytes(numel: int) -> int:
    return int(numel * nf4.bytes_per_element()) + NF4_TENSOR_OVERHEAD


def gathered_bytes(params: Sequence[Param], quantized: set[str], compute: int) -> int:
    """A unit's parameters while it computes: quantized weights gathered in NF4, the rest in the compute dtype."""
    return sum(_quantized_bytes(p.numel) if p.name in quantized else p.numel * compute for p in params)


def state_bytes(spec: ModelSpec, options: PlanOptions, rank: int = 0) -> tuple[int, int, int]:
    """Local (params, grads, optimizer) bytes on ``rank`` of its shard group: ``torch.chunk`` rows, no padding.

    This is what :func:`lightning_fsdp.memory.local_state_bytes` measures (``DTensor.to_local()``).
    """
    stored, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    shard = options.shard
    quantized = quantized_params(spec, options)
    # *-mixed under FSDP holds frozen parameters in the compute dtype (``store_frozen_in_compute_dtype``)
    frozen = compute if options.precision.endswith("-mixed") and options.strategy == "fsdp" else stored
    numel = [sharded_numel(p.shape, shard, rank) for p in spec.params]
    trainable = sum(n for n, p in zip(numel, spec.params) if p.trainable)
    params = sum(
        _quantized_bytes(n) if p.name in quantized else n * (stored if p.trainable else frozen)
        for n, p in zip(numel, spec.params)
    )
    grads = trainable * stored
    optimizer = OPTIMIZER_STATES[options.optimizer] * trainable * stored
    return params, grads, optimizer


def estimate(spec: ModelSpec, options: PlanOptions) -> Estimate:
    """Each rank's expected peak bytes for training ``spec`` under ``options`` (see the module docstring)."""
    stored, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    mixed = options.precision.endswith("-mixed")
    reduce_bytes = stored if mixed else compute
    params, grads, optimizer = state_bytes(spec, options, rank=0)
    quantized = quantized_params(spec, options)
    full_trainable = sum(p.numel for p in spec.params if p.trainable)
    unsharded_state = gathered_bytes(spec.params, quantized, stored) + (
        (1 + OPTIMIZER_STATES[options.optimizer]) * full_trainable * stored
    )

    gathered = unsharded_grads = comm = dequantized = all_gather_buffers = 0
    if options.strategy == "fsdp":
        largest = max((gathered_bytes(u.params, quantized, compute) for u in spec.blocks), default=0)
        root_trainable = sum(p.numel for p in spec.root.params if p.trainable)
        largest_trainable = max((sum(p.numel for p in u.params if p.trainable) for u in spec.blocks), default=0)
        # root stays gathered from forward into backward; one unit runs while the next is prefetched
        root = gathered_bytes(spec.root.params, quantized, compute)
        gathered = root + (1 + options.prefetch) * largest
        # one quantized weight at a time is dequantized for its matmul (forward, and again in backward)
        largest_quantized = max((p.numel for p in spec.params if p.name in quantized), default=0)
        dequantized = dequantize_bytes(largest_quantized, compute)
        at_all_gather = all_gather_moment(root, largest, options.shard)
        all_gather_buffers = max(0, at_all_gather - gathered - dequantized)
        # gradients exist unsharded until their unit's reduce-scatter: the root's for all of backward, plus one unit
        unsharded_grads = (root_trainable + largest_trainable) * reduce_bytes
    elif options.strategy == "ddp":
        comm = full_trainable * reduce_bytes  # DDP's gradient buckets are a second copy of the gradients

    reference = 0
    if options.reference == "adapters_off" and all(p.trainable for p in spec.params):
        raise ValueError("reference='adapters_off' is the base with its LoRA adapters switched off: plan LoRA"
                         " (--lora-rank), or reference 'copy' or 'precomputed' for a full fine-tune.")
    if options.reference == "copy":
        # the base (the frozen parameters under LoRA, every parameter of a full fine-tune), frozen and sharded
        base = [p for p in spec.params if not p.trainable] or list(spec.params)
        frozen = compute if mixed and options.strategy == "fsdp" else stored
        reference = sum(sharded_numel(p.shape, options.shard) * frozen for p in base)
        if options.strategy == "fsdp":  # its root is gathered while it scores, beside the model's
            names = {p.name for p in base}
            gathered += gathered_bytes([p for p in spec.root.params if p.name in names], set(), compute)
    activations = activation_bytes(spec, options)
    # a one-rank shard group keeps its quantized weights out of FSDP, and so out of its CPU offload
    kept = sum(_quantized_bytes(p.numel) for p in spec.params if p.name in quantized) if options.shard == 1 else 0
    host = params + grads + optimizer + reference - kept if options.cpu_offload else 0
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
        dequantized=dequantized,
        on_device_when_offloaded=kept if options.cpu_offload else 0,
        reference=reference,
        all_gather_buffers=all_gather_buffers,
    )


def gpt_activation_bytes(
    dims: GPTDims,
    batch_size: int,
    seq_len: Optional[int] = None,
    *,
    compute_bytes: int = 4,
    activation_checkpointing: bool = False,
    attention: str = "sdpa",
    loss_chunk: Optional[int] = None,
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
    fp32 copy, log-softmax and its gradient that cross entropy holds (``V·(p + 12)`` bytes when ``p < 4``), for every
    token or, with ``loss_chunk``, one chunk at a time (:func:`loss_bytes`).
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
    return int(tokens * (blocks + 2 * d * p) + loss_bytes(dims.vocab_size, d, p, tokens, loss_chunk))


def activation_bytes(spec: ModelSpec, options: PlanOptions) -> int:
    """Activation estimate for GPT-like and Llama-family models; ``0`` (reported as unknown) for others. Under
    context parallelism a rank keeps the activations of ``seq_len / context_parallel`` tokens, plus the ring's
    buffers."""
    _, compute = PRECISION_BYTES[normalize_precision(options.precision)]
    dims = spec.llama if spec.llama is not None else spec.gpt
    if dims is None:
        return 0
    cp = options.context_parallel
    local = -(-(options.seq_len or dims.seq_len) // cp)
    ring = ring_buffer_bytes(options.batch_size * local, getattr(dims, "kv_dim", dims.d_model), compute) if cp > 1 else 0
    if spec.llama is not None:
        from lightning_fsdp.planner.llama import llama_activation_bytes

        return ring + llama_activation_bytes(
            spec.llama, options.batch_size, local, compute_bytes=compute,
            activation_checkpointing=options.activation_checkpointing, loss_chunk=options.loss_chunk,
        )
    assert spec.gpt is not None
    return ring + gpt_activation_bytes(
        spec.gpt, options.batch_size, local, compute_bytes=compute,
        activation_checkpointing=options.activation_checkpointing, attention=options.attention,
        loss_chunk=options.loss_chunk,
    )


def all_gather_moment(root: int, largest: int, shard: int) -> int:
    """The gathered bytes while a unit's all-gather runs in forward (``root``: the root unit's gathered bytes, which
    stay gathered; ``largest``: the largest other unit's). FSDP2 keeps the previous unit's all-gather output until
    the next all-gather has run (to overlap that copy-out with it): the root's when the first block gathers. Beside
    it: this unit's all-gather output and its copy-in, counted as twice its local shard (what a quantized weight's
    fields take; a plain unit's copy-in is one shard, so this over-counts it by one shard of one unit)."""
    if shard <= 1:
        return root + largest
    return root + max(root, largest) + largest + 2 * -(-largest // shard)


def dequantize_bytes(numel: int, compute_bytes: int) -> int:
    """What dequantizing one NF4 weight of ``numel`` elements for its matmul holds at its peak: the weight in the
    compute dtype, and one step's transient (:func:`lightning_fsdp.sharding.nf4.dequantize`)."""
    from lightning_fsdp.sharding.nf4 import DEQUANTIZE_STEP

    return numel * compute_bytes + min(numel // 2, DEQUANTIZE_STEP) * DEQUANTIZE_BYTES_PER_CODE_BYTE


def ring_buffer_bytes(tokens: int, kv_width: int, compute_bytes: int) -> int:
    """Ring attention's transient: the keys and values a rank attends to and the ones arriving from its neighbour,
    plus the backward's gradient accumulators (fp32) for the chunk that travels."""
    return tokens * kv_width * (2 * 2 * compute_bytes + 2 * 4)
