"""Preference losses over (chosen, rejected) pairs: DPO (sigmoid, β) and the reference-free SimPO.

A batch holds ``B`` pairs as ``2B`` rows, the chosen completions first: row ``i`` and row ``B + i`` share a prompt.
Each row's log-probability is the sum over its completion tokens (labels ``!= -100``) of ``log p(token | prefix)``,
computed from the final hidden states and the output projection a chunk of tokens at a time, so that the whole
logits never exist (:func:`lightning_fsdp.loss.chunked.sequence_log_probs`).

The step's objective is the mean over *pairs*: every micro-batch back-propagates its summed pair losses and
:class:`~lightning_fsdp.loss.TokenWeightedLoss` (the same mechanism as the per-token SFT mean, with pairs as the
unit) divides the gradients by the global count of pairs, so the step is the same at any world size and
``accumulate_grad_batches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

__all__ = ["PREFERENCE_LOSSES", "REFERENCE_MODES", "PairScores", "preference_loss"]

#: name → whether the loss compares against a reference model
PREFERENCE_LOSSES = {"dpo": True, "simpo": False}
#: how the reference model's log-probabilities are made (:mod:`lightning_fsdp.models.reference`)
REFERENCE_MODES = ("adapters_off", "copy", "precomputed")

@dataclass
class PairScores:
    """Per pair: the loss, the implicit rewards and the policy's log-probabilities (all ``(B,)``)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor

    @property
    def margins(self) -> Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float()


def preference_loss(
    loss: str,
    logps: Tensor,
    counts: Tensor,
    reference_logps: Optional[Tensor] = None,
    *,
    beta: float = 0.1,
    simpo_gamma: float = 0.5,
) -> PairScores:
    """The per-pair losses of ``2B`` rows' log-probabilities (chosen first).

    - ``"dpo"``: ``-log σ(β((π_c - ref_c) - (π_r - ref_r)))``; rewards ``β(π - ref)`` (Rafailov et al., 2023).
    - ``"simpo"``: ``-log σ(β π_c/|c| - β π_r/|r| - γ)``, no reference; rewards ``β π/|y|`` (Meng et al., 2024).
    """
    if loss not in PREFERENCE_LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {sorted(PREFERENCE_LOSSES)}.")
    chosen, rejected = logps.chunk(2)
    if loss == "dpo":
        if reference_logps is None:
            raise ValueError("loss='dpo' compares against a reference model: pass reference_logps.")
        ref_chosen, ref_rejected = reference_logps.detach().chunk(2)
        chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
    else:
        lengths_chosen, lengths_rejected = counts.clamp(min=1).float().chunk(2)
        chosen_rewards, rejected_rewards = beta * chosen / lengths_chosen, beta * rejected / lengths_rejected
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards - simpo_gamma)
    return PairScores(losses, chosen_rewards.detach(), rejected_rewards.detach(), chosen.detach(), rejected.detach())
