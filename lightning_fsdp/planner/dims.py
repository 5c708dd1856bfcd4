"""The shape of a Llama-family decoder and of its LoRA, as plain data: what ``geometry`` (the units and parameters
the planner walks) and ``llama`` (building them from a ``config.json``) both refer to, without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def check_positive_ints(dims: object, names: tuple[str, ...]) -> None:
    """A clear error when one of the fields ``names`` of a shape dataclass is not a positive int."""
    for name in names:
        value = getattr(dims, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(dims).__name__}.{name} must be a positive int, got {value!r}.")


#: PEFT's default LoRA targets for Llama-family models
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA of rank ``rank`` on the projections named in ``targets`` (the base is frozen)."""

    rank: int = 8
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}.")


@dataclass(frozen=True)
class LlamaDims:
    """A Llama-family decoder's shape."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    seq_len: int
    tie_weights: bool = False
    head_dim: Optional[int] = None
    attention_bias: bool = False
    lora: Optional[LoraSpec] = None

    def __post_init__(self) -> None:
        check_positive_ints(self, ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "seq_len"))
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}.")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_size
