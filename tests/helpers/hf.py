"""Tiny Hugging Face models written to disk for the tests (no download): a Llama-style directory of several shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: uneven shards (vocabulary 37, MLP 150, k/v 32 rows: no world size of 3 or 4 divides all), grouped-query
#: attention, an untied head; the base outweighs LoRA adapters ~30×, as it does in real fine-tunes
TINY_LLAMA = dict(
    vocab_size=37, hidden_size=64, intermediate_size=150, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, rms_norm_eps=1e-5,
)


def write_llama(path: Path, seed: int = 0, max_shard_size: str = "64KB", dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """A random Llama saved with ``save_pretrained`` in several safetensors shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def save_safetensors_dir(state_dict: dict[str, torch.Tensor], path: Path, files: int) -> Path:
    """``state_dict`` as a Hugging Face-style directory: ``files`` safetensors shards and their index."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(state_dict)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: state_dict[k].contiguous() for k in keys[i::files]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


#: tiny configs of the other families the package claims, sized so every shard is uneven at 2 ranks: Mistral (dense,
#: Llama's keys), Mixtral (experts fused by transformers at load time, blocks renamed) and Qwen2-MoE (fused experts
#: beside a shared expert, attention biases); five experts split 3 + 2
FAMILIES = {
    "mistral": dict(model_type="mistral", intermediate_size=150),
    "mixtral": dict(model_type="mixtral", intermediate_size=128, num_local_experts=5, num_experts_per_tok=2,
                    num_hidden_layers=12),  # many small layers: the load-memory bound is about one tensor at a time
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=96, num_experts=5, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=80),
}


def write_family(path: Path, family: str, seed: int = 0, max_shard_size: str = "64KB") -> Path:
    """A random model of ``family`` (:data:`FAMILIES`) with the tiny Llama's dimensions, saved with
    ``save_pretrained`` in several shards: the layout a downloaded checkpoint has."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**TINY_LLAMA, **FAMILIES[family]}
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size=max_shard_size)
    return path


#: Llama-2-70B's published config.json (its layers sliced off by ``num_hidden_layers``)
LLAMA_2_70B = dict(
    vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def write_llama_slice(path: Path, layers: int, files: int = 2) -> Path:
    """A bf16 safetensors directory of a Llama-2-70B with ``layers`` of its 80 layers, at its real shapes: the
    shapes come from transformers' model built on the meta device, the values are seeded (std 0.02)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_2_70B, "num_hidden_layers": layers}, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, meta in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_safetensors_dir(state, path, files)
    config.save_pretrained(path)
    return path
