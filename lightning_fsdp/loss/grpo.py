"""GRPO's objective as pure functions: group-relative advantages, the clipped surrogate with a KL term, and the
normalisations TRL names ``grpo``, ``dr_grpo``, ``dapo`` and ``bnpo``, each as a ``(total, count)`` pair for the one
:class:`~lightning_fsdp.loss.TokenWeightedLoss`.

The formulas are TRL's ``GRPOTrainer``'s (1.16), so the same completions give the same loss and gradients:

- advantages: each completion's reward minus its group's mean (the ``num_generations`` completions of one prompt),
  divided by the group's standard deviation (``scale_rewards="group"``), the whole batch's (``"batch"``) or
  nothing (``"none"``), plus 1e-4;
- per token: ``-min(r·A, clip(r, 1-ε, 1+ε_high)·A) + β·KL`` with the ratio ``r = exp(logp - logp_old)`` and the
  k3 estimator ``KL = exp(ref - logp) - (ref - logp) - 1``, multiplied by ``r`` (TRL's ``use_bias_correction_kl``);
- the aggregation over a step's tokens (:func:`aggregate`), which :class:`TokenWeightedLoss` finishes with the
  global count over every micro-batch and rank:

  ===========  ===================================================================  ================================
  loss_type    what one micro-batch adds                                            the step divides by
  ===========  ===================================================================  ================================
  ``dapo``     Σ token losses                                                       every completion token
  ``grpo``     Σ over completions of their mean token loss                          every completion
  ``dr_grpo``  Σ token losses / ``max_completion_length``                           every completion
  ``bnpo``     its own mean token loss                                              every micro-batch
  ===========  ===================================================================  ================================

  So ``dapo``, ``grpo`` and ``dr_grpo`` give the same step at any world size and accumulation; ``bnpo`` is, by its
  definition in TRL, a mean of micro-batch means, which depends on how the step's completions are split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["LOSS_TYPES", "SCALE_REWARDS", "TokenTerms", "aggregate", "group_advantages", "token_losses"]

#: TRL's names for how token losses are aggregated (TRL 1.16's default: ``dapo``)
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
#: how rewards are scaled into advantages (TRL's default: ``group``)
SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: Tensor, dim: Optional[int] = None) -> Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    out = variance.sqrt()
    return out.squeeze(dim) if dim is not None else out.reshape(())


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> tuple[Tensor, Tensor]:
    """``(advantages, zero_std)`` of ``rewards`` ``(groups × num_generations,)``, each group's completions together.
    NaN rewards (no function applied) stay out of the statistics and get advantage 0; ``zero_std`` marks the
    completions of groups whose rewards were all equal (they carry no signal)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}.")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of num_generations={num_generations}.")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass
class TokenTerms:
    """Per completion token ``(completions, tokens)``: the loss, and what is logged about it."""

    losses: Tensor
    kl: Optional[Tensor]
    clipped_low: Tensor
    clipped_high: Tensor


def token_losses(
    logps: Tensor,
    advantages: Tensor,
    *,
    old_logps: Optional[Tensor] = None,
    ref_logps: Optional[Tensor] = None,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
) -> TokenTerms:
    """The clipped surrogate (and ``beta`` × KL) per token. ``logps`` carry the gradient; ``old_logps`` are the
    policy's at generation (``None``: the same policy, ``logps.detach()``); ``ref_logps`` the reference's (needed
    when ``beta`` > 0); ``advantages`` ``(completions,)``."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    a = advantages.unsqueeze(1)
    losses = -torch.min(ratio * a, clipped * a)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 adds a KL term to the reference: pass ref_logps.")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:
            kl = kl * ratio
        losses = losses + beta * kl
    return TokenTerms(losses, kl, (ratio < 1 - epsilon) & (a < 0), (ratio > 1 + epsilon_high) & (a > 0))


def aggregate(losses: Tensor, mask: Tensor, loss_type: str, max_completion_length: int) -> tuple[Tensor, Tensor]:
    """``(total, count)`` of one micro-batch's token ``losses`` under ``mask`` (see the module's table)."""
    mask = mask.to(losses.dtype)
    masked = losses * mask
    rows = torch.tensor(float(losses.shape[0]), device=losses.device)
    if loss_type == "dapo":
        return masked.sum(), mask.sum()
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    if loss_type == "dr_grpo":
        return masked.sum() / max_completion_length, rows
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), torch.ones((), device=losses.device)
    raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}.")
