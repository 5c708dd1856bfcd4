"""Hugging Face models under activation checkpointing or ``torch.compile``: a training forward without a KV cache.

transformers' causal LMs create a ``DynamicCache`` in every forward while ``config.use_cache`` is true (the default),
also in training. A checkpointed block recomputed in backward appends its keys and values to that cache a second
time (eager attention fails on the shapes; SDPA can silently attend to the stale copy), and a compiled block guards
on the cache and each layer's index, recompiling per layer. transformers' own ``gradient_checkpointing_enable`` turns
the cache off for this reason; :func:`train_without_cache` does the same for blocks the strategy checkpoints or
compiles — only while the model trains with gradients on, so ``generate`` and evaluation keep the user's setting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fsdp.hf.init_rules import pretrained_model_class


def _uses_cache(module: nn.Module) -> bool:
    return bool(getattr(getattr(module, "config", None), "use_cache", False))


def _no_cache_in_training(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if module.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return args, kwargs


def train_without_cache(model: nn.Module, blocks: list[str]) -> list[str]:
    """Hook every outermost ``transformers.PreTrainedModel`` that contains one of ``blocks`` (checkpointed or compiled
    modules) and would build a cache, so that its training forward runs with ``use_cache=False``. Returns the names
    (``""``: the root) of the models hooked."""
    pretrained = pretrained_model_class()
    if pretrained is None or not blocks:
        return []
    hooked: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, pretrained) or any(name.startswith(f"{h}.") or not h for h in hooked):
            continue
        prefix = f"{name}." if name else ""
        if _uses_cache(module) and any(block.startswith(prefix) for block in blocks):
            module.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
            hooked.append(name)
    return hooked
