"""Generation on a sharded model from its root: the rollout mode resolved against the device's free memory, the
prompts split over the ranks, and every completion gathered back in order (:func:`generate_on_ranks`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from lightning_fsdp.generation.engine import Completions, generate
from lightning_fsdp.generation.fsdp import choose_rollout_mode, in_root_forward, rollout_gathering
from lightning_fsdp.generation.sampling import Sampling
from lightning_fsdp.memory import full_param_bytes
from lightning_fsdp.parallel.collectives import all_gather_object, is_distributed, rank, world_size

__all__ = ["check_cache_fits", "free_device_bytes", "generate_on_ranks", "kv_cache_bytes", "resolve_rollout_mode"]


def free_device_bytes(device: torch.device) -> Optional[int]:
    """What this rank may still use on ``device``: a GPU's free memory, or its share of the host's available memory
    (``MemAvailable`` over the node's local ranks); ``None`` where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def kv_cache_bytes(config: Any, rows: int, tokens: int, element_bytes: int = 4) -> int:
    """Bytes of a Hugging Face decoder's key/value cache for ``rows`` sequences of ``tokens`` (prompt + completion):
    keys and values of every layer, ``num_key_value_heads × head_dim`` wide."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads"))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or int(getattr(text, "hidden_size")) // heads)
    return 2 * int(getattr(text, "num_hidden_layers")) * kv_heads * head_dim * rows * tokens * element_bytes


def check_cache_fits(cache_bytes: int, free_bytes: Optional[int], what: str, headroom: float = 0.5) -> None:
    """A clear error, before any rollout, when ``what``'s key/value cache would not fit beside what is allocated."""
    if free_bytes is not None and cache_bytes > headroom * free_bytes:
        raise ValueError(
            f"The key/value cache of {what} needs {cache_bytes / 2**30:.2f} GiB, more than half of the"
            f" {free_bytes / 2**30:.2f} GiB this rank has free. Lower max_completion_length, num_generations or"
            " data.batch_size, or decode fewer rows at once (model.generation_batch_size)."
        )


def resolve_rollout_mode(mode: str, module: nn.Module, device: torch.device) -> str:
    """``mode``, with ``"auto"`` decided by whether the whole model fits beside what the device holds now."""
    if mode != "auto":
        return choose_rollout_mode(mode, 0, None)
    return choose_rollout_mode(mode, full_param_bytes(module), free_device_bytes(device))


def generate_on_ranks(
    root: nn.Module,
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    pad_id: int,
    mode: str = "auto",
    batch_size: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> Completions:
    """Every prompt completed once, the work split over the ranks and the result the same on every rank.

    ``root`` is the module FSDP2 sharded last (a LightningModule: its forward hooks gather the root unit), ``model``
    what is called to decode (e.g. its Hugging Face model). Rank ``r`` of ``N`` takes prompts ``r, r + N, ...``;
    every rank decodes as many prompts (the last ones padded with a copy of the first), so a streamed rollout makes
    the same calls everywhere. Each prompt is seeded by its index here, so the answers do not depend on ``N``.
    """
    if not prompts:
        return Completions([], [], 0, 0.0)
    device = device if device is not None else next(root.parameters()).device
    world, me = (world_size(), rank()) if is_distributed() else (1, 0)
    mine = list(range(me, len(prompts), world))
    share = -(-len(prompts) // world)
    padded = mine + [mine[0] if mine else 0] * (share - len(mine))
    resolved = resolve_rollout_mode(mode, root, device)

    def work() -> Completions:
        with rollout_gathering(root, resolved) as gathering:
            return generate(model, [prompts[i] for i in padded], sampling, pad_id=pad_id, keys=padded,
                            batch_size=batch_size, device=device, synchronized=gathering.synchronized)

    done = in_root_forward(root, work)
    local = [(i, done.ids[k], done.stopped[k], done.logprobs[k]) for k, i in enumerate(padded[: len(mine)])]
    ids: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    for part in all_gather_object(local):
        for i, row, was_stopped, row_logprobs in part:
            ids[i], stopped[i], logprobs[i] = row, was_stopped, row_logprobs
    return Completions(ids, stopped, done.steps, done.seconds, logprobs)
