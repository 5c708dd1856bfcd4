"""The shape of the package's GPT: :class:`GPTConfig`, named sizes, and exact parameter counts without building it.

:func:`count_params` uses the memory planner's geometry (:mod:`lightning_fsdp.planner.geometry`): one count of the
same decoder, not two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_fsdp.planner.geometry import gpt_param_count, package_gpt

__all__ = ["PRESETS", "GPTConfig", "config_with_params", "count_params", "get_preset"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder.

    Args:
        vocab_size: number of token ids (256 for the byte-level corpus).
        n_layer: number of :class:`TransformerBlock` s.
        n_head: attention heads; ``d_model`` must divide evenly and the head size must be even (rotary).
        d_model: width of the residual stream.
        seq_len: longest context; the rotary tables are built for this length.
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
        dropout: dropout on attention and residual branches (0 for small data).
        tie_weights: share the token embedding with the output head (saves ``vocab_size × d_model`` params).
    """

    vocab_size: int = 256
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 256
    seq_len: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}.")
        if (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"GPTConfig: the head size d_model/n_head={self.d_model // self.n_head} must be even for rotary"
                " position embeddings; change d_model or n_head."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


#: Named sizes (byte-level vocabulary). The name is the rounded parameter count; see :func:`count_params`.
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=64),  # ~0.12M, for tests
    "gpt-5m": GPTConfig(n_layer=6, n_head=8, d_model=256, seq_len=256),  # ~4.8M, the default job
    "gpt-25m": GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=256),  # ~25M
    "gpt-50m": GPTConfig(n_layer=10, n_head=10, d_model=640, seq_len=512),  # ~49M
    "gpt-200m": GPTConfig(n_layer=16, n_head=16, d_model=1024, seq_len=1024),  # ~202M
}


def get_preset(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` with some fields replaced, e.g. ``get_preset("gpt-50m", seq_len=1024)``."""
    if name not in PRESETS:
        raise KeyError(f"Unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[name], **overrides)


def count_params(config: GPTConfig) -> int:
    """Exact number of (unique) parameters of :class:`~lightning_fsdp.models.gpt.GPT` for ``config``, without
    building it: per block two LayerNorms (``2·d`` each), q/k/v and output projections (``4·d²``, no biases) and the
    MLP (``2·r·d²``); plus the token embedding, the final LayerNorm and, if untied, the output head."""
    dims = package_gpt(
        config.n_layer, config.d_model, config.n_head, config.vocab_size, config.seq_len,
        mlp_ratio=float(config.mlp_ratio), tie_weights=config.tie_weights,
    )
    return gpt_param_count(dims)


def config_with_params(
    target: int, *, n_layer: int, head_dim: int = 64, vocab_size: int = 256, seq_len: int = 256, **kwargs: Any
) -> GPTConfig:
    """The config with ``n_layer`` blocks whose size is closest to ``target`` params (width a multiple of ``head_dim``)."""
    if target < 1 or n_layer < 1:
        raise ValueError(f"target and n_layer must be positive, got target={target}, n_layer={n_layer}.")
    best: Optional[GPTConfig] = None
    n_head = 1
    while True:
        cfg = GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, d_model=n_head * head_dim,
                        seq_len=seq_len, **kwargs)
        if best is None or abs(count_params(cfg) - target) < abs(count_params(best) - target):
            best = cfg
        if count_params(cfg) >= target:
            return best
        n_head += 1
