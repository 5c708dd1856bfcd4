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
