"""Model geometry for the planner: parameter shapes grouped into FSDP units, and the GPT family counted from first
principles (the package's own GPT, ``lightning_fsdp.models.gpt``, counts its parameters with these functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_fsdp.planner.dims import check_positive_ints

if TYPE_CHECKING:
    from lightning_fsdp.planner.dims import LlamaDims


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its shape, whether it is trained (has a gradient and optimizer state), and whether it is
    an ``nn.Linear`` weight (which ``quantize_base`` holds quantized when frozen inside a block)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    linear: bool = False

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
        check_positive_ints(self, ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"))
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
    """A model for the planner: its FSDP units (the root last) and, for a GPT or a Llama-family model, its
    dimensions (which give the activation estimate)."""

    name: str
    units: tuple[Unit, ...]
    gpt: Optional[GPTDims] = None
    llama: Optional[LlamaDims] = None

    @property
    def has_activation_model(self) -> bool:
        return self.gpt is not None or self.llama is not None

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

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
    return [Param(f"{name}.weight", (n_out, n_in), linear=True)] + ([Param(f"{name}.bias", (n_out,))] if bias else [])


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
