"""Ring attention inside Hugging Face models, through transformers' attention-function registry (no modelling code
is copied or patched).

Under context parallelism every ``PreTrainedModel`` in the module gets the attention implementation
:data:`RING_ATTENTION`: within a context-parallel step it attends across the ranks
(:func:`~lightning_fsdp.parallel.ring.ring_attention`, the queries and keys already rotated at the tokens' global
positions, because the step passes ``position_ids``); anywhere else (generation, a step without a split) it is
transformers' own SDPA attention, with SDPA's masks.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from torch import Tensor, nn

from lightning_fsdp.parallel.ring import ring_attention
from lightning_fsdp.parallel.sequence import active_split

RING_ATTENTION = "lightning_fsdp_ring"
#: implementations whose attention is plain causal attention over the row, which ring attention computes exactly
SPLITTABLE = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", RING_ATTENTION)

__all__ = ["RING_ATTENTION", "use_ring_attention"]


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register :data:`RING_ATTENTION` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(RING_ATTENTION, _attention)
    AttentionMaskInterface.register(RING_ATTENTION, _mask)


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
               dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any) -> tuple[Tensor, None]:
    split = active_split()
    if split is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"Ring attention has no attention dropout; set the model's attention_dropout to 0 (got {dropout}).")
    if kwargs.get("sliding_window"):
        raise ValueError("Ring attention attends to the whole causal context; a sliding-window layer cannot be split."
                         " Set context_parallel=1 for this model.")
    out = ring_attention(query, key, value, split, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args: Any, **kwargs: Any) -> Optional[Tensor]:
    """No mask inside a split (ring attention builds its own, per block); SDPA's anywhere else."""
    if active_split() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def use_ring_attention(module: nn.Module) -> int:
    """Switch every Hugging Face model inside ``module`` to ring attention; returns how many were switched.

    Raises naming the model when its attention is not plain causal attention (a custom implementation)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return 0
    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    outermost = [m for m in models if not any(m is not o and any(c is m for c in o.modules()) for o in models)]
    if outermost:
        register()
    for model in outermost:
        current = getattr(model.config, "_attn_implementation", None)
        if current not in SPLITTABLE:
            raise ValueError(
                f"context_parallel cannot split {type(model).__name__}'s attention implementation {current!r}: ring"
                f" attention computes plain causal attention. Load the model with attn_implementation='sdpa' (or one"
                f" of {SPLITTABLE[:-1]}), or set context_parallel=1."
            )
        model.set_attn_implementation(RING_ATTENTION)
    return len(outermost)
