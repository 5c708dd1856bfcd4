"""Generation on sharded models: one decoding loop (:func:`generate`) for the held-out answers, ``chat``, GRPO
rollouts and lm-eval, and the two ways a sharded model's units are gathered for it (:mod:`.fsdp`)."""

from lightning_fsdp.generation.engine import Completions, generate
from lightning_fsdp.generation.fsdp import (
    ROLLOUT_MODES,
    Gathering,
    choose_rollout_mode,
    fsdp_units,
    in_root_forward,
    reshard_gathered,
    rollout_gathering,
)
from lightning_fsdp.generation.sharded import (
    check_cache_fits,
    free_device_bytes,
    generate_on_ranks,
    kv_cache_bytes,
    resolve_rollout_mode,
)
from lightning_fsdp.generation.sampling import Sampling, filter_logits, row_generators, row_seed, sample_rows

__all__ = [
    "ROLLOUT_MODES", "Completions", "Gathering", "Sampling", "check_cache_fits", "choose_rollout_mode", "filter_logits", "free_device_bytes",
    "fsdp_units", "generate", "generate_on_ranks", "in_root_forward", "kv_cache_bytes", "reshard_gathered", "resolve_rollout_mode",
    "rollout_gathering", "row_generators", "row_seed", "sample_rows",
]
