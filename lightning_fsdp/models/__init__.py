"""LightningModules: Hugging Face causal LMs for SFT (:class:`HFCausalLM`), DPO/SimPO (:class:`HFPreferenceLM`) and
GRPO (:class:`HFGRPOLM`), and for the examples a GPT-style decoder and a small CNN with BatchNorm.

All are ordinary LightningModules; none imports a strategy. :mod:`.reference` holds the frozen reference (adapters
off, a sharded copy, or precomputed), :mod:`.rollout` GRPO's sampled completions. :data:`PRESETS` and
:func:`count_params` let other tools (benchmarks, the memory planner) build a decoder of a given size.
"""

from lightning_fsdp.models.cnn import ConvBlock, ShapesCNN, average_batchnorm_stats
from lightning_fsdp.models.gpt import GPT, TransformerBlock
from lightning_fsdp.models.gpt_module import GPTLightningModule
from lightning_fsdp.models.grpo import HFGRPOLM
from lightning_fsdp.models.gpt_config import PRESETS, GPTConfig, config_with_params, count_params, get_preset
from lightning_fsdp.models.hf_causal_lm import HFCausalLM
from lightning_fsdp.models.preference import HFPreferenceLM

__all__ = [
    "HFGRPOLM",
    "HFPreferenceLM",
    "GPT",
    "PRESETS",
    "ConvBlock",
    "GPTConfig",
    "GPTLightningModule",
    "HFCausalLM",
    "ShapesCNN",
    "TransformerBlock",
    "average_batchnorm_stats",
    "config_with_params",
    "count_params",
    "get_preset",
]
