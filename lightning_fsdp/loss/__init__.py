"""Losses whose value and gradient do not depend on how a global batch is split over ranks and micro-batches.

- :func:`causal_lm_token_loss`: the summed next-token cross entropy of a batch and its count of target tokens.
- :class:`TokenWeightedLoss`: turns those sums into the step's gradient of Σ token losses / Σ target tokens over
  every micro-batch on every rank, for the Trainer (``on_before_optimizer_step``) and for Fabric loops.
"""

from lightning_fsdp.loss.token_mean import (
    IGNORE_INDEX,
    TokenWeightedLoss,
    causal_lm_token_loss,
    gradient_divisor,
)

__all__ = ["IGNORE_INDEX", "TokenWeightedLoss", "causal_lm_token_loss", "gradient_divisor"]
