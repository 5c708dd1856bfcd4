"""Llama-family geometry for the planner (Llama, Mistral, Qwen2/3: SwiGLU MLP, grouped-query attention, RMSNorm,
an untied head) and LoRA's trainable subset, from a Hugging Face ``config.json`` or a named preset.

Parameter names follow transformers' (``model.layers.0.self_attn.q_proj.weight``), so the units are the decoder
layers (``LlamaDecoderLayer`` is the model's ``_no_split_modules``) and the root holds the embedding, final norm and
head. With LoRA, every base parameter is frozen (gathered for compute, but without gradients or optimizer state)
and each targeted projection gains ``lora_A`` (``r × in``) and ``lora_B`` (``out × r``), trainable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

from lightning_fsdp.planner.dims import DEFAULT_LORA_TARGETS, LlamaDims, LoraSpec
from lightning_fsdp.planner.geometry import ModelSpec, Param, Unit
from lightning_fsdp.planner.loss import loss_bytes

#: published configs (facts from the models' config.json files)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768),
}
def llama_dims(config: Mapping[str, Any], seq_len: Optional[int] = None, lora: Optional[LoraSpec] = None) -> LlamaDims:
    """``LlamaDims`` from a HF config dict (``hidden_size``, ``num_key_value_heads``, ...)."""
    try:
        return LlamaDims(
            n_layer=int(config["num_hidden_layers"]),
            d_model=int(config["hidden_size"]),
            n_head=int(config["num_attention_heads"]),
            n_kv_head=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            d_ff=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            seq_len=int(seq_len or config.get("max_position_embeddings") or 2048),
            tie_weights=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
            attention_bias=bool(config.get("attention_bias", False)),
            lora=lora,
        )
    except KeyError as err:
        raise ValueError(f"The config has no {err.args[0]!r}: not a Llama-family causal LM config.") from None


def load_hf_config(source: Union[str, Path]) -> dict[str, Any]:
    """A preset name, a ``config.json`` or a directory holding one."""
    if str(source) in PRESETS:
        return dict(PRESETS[str(source)])
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"--hf-config {source}: no config.json there, and not a preset ({sorted(PRESETS)}).")
    return json.loads(path.read_text())


def _linear(name: str, n_out: int, n_in: int, bias: bool, trainable: bool) -> list[Param]:
    return [Param(f"{name}.weight", (n_out, n_in), trainable, linear=True)] + (
        [Param(f"{name}.bias", (n_out,), trainable)] if bias else []
    )


def _projection(prefix: str, name: str, n_out: int, n_in: int, dims: LlamaDims, bias: bool = False) -> list[Param]:
    lora = dims.lora
    params = _linear(f"{prefix}{name}", n_out, n_in, bias, trainable=lora is None)
    if lora is not None and name.rpartition(".")[2] in lora.targets:
        params += [Param(f"{prefix}{name}.lora_A", (lora.rank, n_in)), Param(f"{prefix}{name}.lora_B", (n_out, lora.rank))]
    return params


def llama_block_params(dims: LlamaDims, prefix: str = "") -> list[Param]:
    d, kv, ff, base_trainable = dims.d_model, dims.kv_dim, dims.d_ff, dims.lora is None
    q_out = dims.n_head * dims.head_size
    bias = dims.attention_bias
    return [
        Param(f"{prefix}input_layernorm.weight", (d,), base_trainable),
        *_projection(prefix, "self_attn.q_proj", q_out, d, dims, bias),
        *_projection(prefix, "self_attn.k_proj", kv, d, dims, bias),
        *_projection(prefix, "self_attn.v_proj", kv, d, dims, bias),
        *_projection(prefix, "self_attn.o_proj", d, q_out, dims),
        Param(f"{prefix}post_attention_layernorm.weight", (d,), base_trainable),
        *_projection(prefix, "mlp.gate_proj", ff, d, dims),
        *_projection(prefix, "mlp.up_proj", ff, d, dims),
        *_projection(prefix, "mlp.down_proj", d, ff, dims),
    ]


def llama_model_spec(dims: LlamaDims, name: str = "llama") -> ModelSpec:
    """One unit per decoder layer, then the root (embedding, final norm, head)."""
    blocks = tuple(
        Unit(f"model.layers.{i}", tuple(llama_block_params(dims, f"model.layers.{i}."))) for i in range(dims.n_layer)
    )
    base_trainable = dims.lora is None
    root = [
        Param("model.embed_tokens.weight", (dims.vocab_size, dims.d_model), base_trainable),
        Param("model.norm.weight", (dims.d_model,), base_trainable),
    ]
    if not dims.tie_weights:
        root.append(Param("lm_head.weight", (dims.vocab_size, dims.d_model), base_trainable))
    return ModelSpec(name, (*blocks, Unit("", tuple(root))), llama=dims)


def llama_activation_bytes(
    dims: LlamaDims, batch_size: int, seq_len: Optional[int] = None, *, compute_bytes: int = 4,
    activation_checkpointing: bool = False, loss_chunk: Optional[int] = None,
) -> int:
    """Bytes autograd keeps between forward and backward for one rank's batch (SDPA attention).

    Per token and layer, in elements of the compute dtype: block input and RMSNorm output (2d), q and k before and
    after rotary (2·(q + kv)), v (kv), attention output (q), o_proj output (d), RMSNorm-2 input and output (2d), and
    the SwiGLU MLP's gate, up, SiLU(gate) and product (4·ff); plus fp32 statistics (two norms, the attention's
    per-head log-sum-exp). Activation checkpointing keeps each block's input and recomputes one block at a time.
    Outside the blocks: the embedding output, the final norm, and the logits (compute dtype + an fp32 copy,
    log-softmax and its gradient): of every token, or with ``loss_chunk`` of one chunk at a time (the chunked loss
    keeps the trained positions' hidden states instead, ``d`` more per token). With LoRA on a frozen base, fewer
    (:func:`lora_block_elements`).
    """
    s = seq_len or dims.seq_len
    tokens = batch_size * s
    d, kv, ff, p = dims.d_model, dims.kv_dim, dims.d_ff, compute_bytes
    q = dims.n_head * dims.head_size
    elements = 5 * d + 3 * q + 3 * kv + 4 * ff if dims.lora is None else lora_block_elements(dims)
    stats = 2 * 4 + dims.n_head * 4
    per_layer = elements * p + stats
    blocks = dims.n_layer * d * p + per_layer if activation_checkpointing else dims.n_layer * per_layer
    return int(tokens * (blocks + 2 * d * p) + loss_bytes(dims.vocab_size, d, p, tokens, loss_chunk))


def lora_block_elements(dims: LlamaDims) -> int:
    """Per token and layer, the elements autograd keeps for a frozen base with LoRA (counted with saved-tensor hooks
    on transformers' Llama): a frozen projection keeps nothing for its own backward, so what stays is the two
    residual-stream inputs of the norms (2d), a normed input wherever an adapter reads it (d each for q/k/v and for
    gate/up), attention's q, k, v and output (2q + 2kv), the MLP's gate, SiLU and up (3ff, and the product ff when
    down_proj has an adapter), and each adapter's rank-``r`` activation."""
    assert dims.lora is not None
    d, kv, ff, q = dims.d_model, dims.kv_dim, dims.d_ff, dims.n_head * dims.head_size
    targets = set(dims.lora.targets)
    read = d * bool(targets & {"q_proj", "k_proj", "v_proj"}) + d * bool(targets & {"gate_proj", "up_proj"})
    adapters = sum(1 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                   if name in targets)
    return 2 * d + read + 2 * q + 2 * kv + 3 * ff + ff * ("down_proj" in targets) + dims.lora.rank * adapters


def with_lora(dims: LlamaDims, rank: Optional[int], targets: Optional[Sequence[str]]) -> LlamaDims:
    if rank is None:
        return dims
    return replace(dims, lora=LoraSpec(rank, tuple(targets or DEFAULT_LORA_TARGETS)))
