"""Losses whose value and gradient do not depend on how a global batch is split over ranks and micro-batches.

- :func:`causal_lm_token_loss`: the summed next-token cross entropy of a batch and its count of target tokens.
- :func:`chunked_causal_lm_loss`: the same sum from the final hidden states and the output projection, one chunk of
  tokens at a time, so the whole logits never exist.
- :class:`TokenWeightedLoss`: turns those sums into the step's gradient of Σ token losses / Σ target tokens over
  every micro-batch on every rank, for the Trainer (``on_before_optimizer_step``) and for Fabric loops.
"""

from lightning_fsdp.loss.chunked import (
    DEFAULT_CHUNK_TOKENS,
    check_chunk_tokens,
    chunked_causal_lm_eval,
    chunked_causal_lm_loss,
)
from lightning_fsdp.loss.token_mean import (
    IGNORE_INDEX,
    TokenWeightedLoss,
    causal_lm_token_loss,
    gradient_divisor,
)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "TokenWeightedLoss",
    "causal_lm_token_loss",
    "check_chunk_tokens",
    "chunked_causal_lm_eval",
    "chunked_causal_lm_loss",
    "gradient_divisor",
]
