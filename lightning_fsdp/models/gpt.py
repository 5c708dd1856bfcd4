"""A small GPT-style decoder, shaped for sharding (the network; :mod:`.gpt_module` trains it as a LightningModule).

The network is built in ``configure_model``: under a sharded strategy Lightning calls it on the meta device, the
strategy shards the empty model and then calls ``reset_parameters()`` on every module that owns parameters or
buffers, so each rank initialises only its own shards. Every such module here therefore has a ``reset_parameters``
that fully (re)initialises it, including the rotary tables, which are buffers. In a plain single process the same
code builds the network on the CPU/GPU directly.

The blocks are all one class, :class:`TransformerBlock`, held in an ``nn.ModuleList``: ``auto_wrap_policy="auto"``
makes each block an FSDP unit without naming anything, and ``[TransformerBlock]`` names it explicitly in YAML.

Sizes (:mod:`lightning_fsdp.models.gpt_config`): :data:`PRESETS` maps names (``"gpt-5m"``, ``"gpt-50m"``, ...) to a :class:`GPTConfig`; :func:`count_params`
gives the exact parameter count of a config without building it; :func:`config_with_params` picks a width for a
target size. Benchmarks and the memory planner build models from these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fsdp.models.gpt_config import GPTConfig
from lightning_fsdp.parallel.ring import ring_attention
from lightning_fsdp.parallel.sequence import active_split

__all__ = ["GPT", "TransformerBlock"]


# -- building blocks: each module that owns parameters/buffers initialises them in `reset_parameters` ------------------
class NormalLinear(nn.Linear):
    """``nn.Linear`` (no bias by default) initialised from N(0, ``std``²), the GPT-2 scheme."""

    def __init__(self, in_features: int, out_features: int, std: float, bias: bool = False) -> None:
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised from N(0, ``std``²)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class RotaryEmbedding(nn.Module):
    """Rotary position tables (cos/sin) as non-persistent buffers, rebuilt by ``reset_parameters``.

    Buffers created on the meta device hold no values; ``reset_parameters`` is what makes them correct after
    the strategy materialises the model.
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, device=device, dtype=torch.float32), inv_freq)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The tables of positions ``0..seq_len-1``, or under context parallelism of this rank's tokens' positions
        in the whole row (``seq_len`` is then this rank's part)."""
        split = active_split()
        whole = seq_len * split.layout.size if split is not None else seq_len
        if whole > self.max_seq_len:
            raise ValueError(f"Sequence of length {whole} is longer than the model's seq_len={self.max_seq_len}.")
        if split is None:
            return self.cos[:seq_len].to(device), self.sin[:seq_len].to(device)
        positions = split.layout.local_positions(seq_len, self.cos.device)
        return self.cos[positions].to(device), self.sin[positions].to(device)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + d/2])`` of ``x`` (B, H, T, d) by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, std = config.d_model, 0.02
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = NormalLinear(d, 3 * d, std)
        self.proj = NormalLinear(d, d, std / math.sqrt(2 * config.n_layer))  # residual branch: scaled init

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        split = active_split()
        if split is not None:
            if self.dropout and self.training:
                raise ValueError("Ring attention has no attention dropout: set dropout=0 to train with context_parallel.")
            out = ring_attention(q, k, v, split)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden = config.d_model, config.mlp_ratio * config.d_model
        self.fc = NormalLinear(d, hidden, 0.02)
        self.out = NormalLinear(hidden, d, 0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.gelu(self.fc(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``. The unit of sharding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cos, sin))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The bare decoder: token ids (B, T) → logits (B, T, vocab). No Lightning; benchmarks can use it directly."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = NormalEmbedding(config.vocab_size, config.d_model, 0.02)
        self.rotary = RotaryEmbedding(config.head_dim, config.seq_len)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        # Tied: the output projection reuses the embedding matrix in `forward` instead of sharing one Parameter
        # between two modules; a shared Parameter comes apart when a meta-device model is materialised with
        # `to_empty` outside FSDP, a functional tie cannot.
        self.head = None if config.tie_weights else NormalLinear(config.d_model, config.vocab_size, 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        return self.project(self.hidden_states(idx))

    def hidden_states(self, idx: Tensor) -> Tensor:
        """The final hidden states (after the last norm): what the chunked loss projects a chunk at a time."""
        cos, sin = self.rotary(idx.shape[1], idx.device)
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def project(self, hidden: Tensor) -> Tensor:
        """The output projection: the head, or the embedding matrix when tied."""
        return F.linear(hidden, self.tok_emb.weight) if self.head is None else self.head(hidden)
