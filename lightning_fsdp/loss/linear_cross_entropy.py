"""Cross entropy of a plain linear projection, a chunk of tokens at a time, with its gradients computed in the same
pass, so that backward has nothing left to recompute.

Recomputing each chunk's logits in backward (activation checkpointing) costs one more projection: where the head is
much of the step (wide vocabulary, small model, short context) that was measured at 1.14-1.20x the step of the
whole logits. Here each chunk's logits are made once: the forward turns them into the loss, the softmax minus the
one-hot target, and from that the chunk's gradient for the hidden states and its contribution to the weight's
(and bias's) gradient. Backward scales what was kept by the incoming gradient. Memory: one chunk's logits at a time,
plus the hidden states' gradient (the size of the hidden states, which recomputation keeps too) and, for a trainable
head, its gradient, which exists in backward either way.

Only for a head the loss may multiply itself: an ``nn.Linear`` (or a subclass that keeps its ``forward``, such as
one with its own initialisation) without hooks, whose weight is an ordinary tensor (FSDP2's unsharded parameter
during the root's forward; not a DTensor, not a quantized subclass). Anything else (a LoRA-wrapped or quantized
head, a callable) takes the recomputing path of :mod:`lightning_fsdp.loss.chunked`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fsdp._torch_compat import has_forward_hooks
from lightning_fsdp.loss.token_mean import IGNORE_INDEX


def plain_linear(head: Any) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """``(weight, bias)`` of a head whose product the loss may compute itself, else ``None``."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or has_forward_hooks(head):
        return None
    tensors = [head.weight] if head.bias is None else [head.weight, head.bias]
    if any(type(t) not in (Tensor, nn.Parameter) for t in tensors):
        return None
    return head.weight, head.bias


class LinearCrossEntropy(torch.autograd.Function):
    """``Σ cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` (``-100`` ignored), chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk_tokens: int
    ) -> Tensor:
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wants_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if wants_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.shape[0], chunk_tokens):
            part = slice(start, start + chunk_tokens)
            h, y = hidden[part], labels[part]
            logits = F.linear(h, weight, bias)
            compute_dtype = logits.dtype
            logits = logits.float()
            trained = y != IGNORE_INDEX
            target = torch.where(trained, y, 0)
            log_norm = logits.logsumexp(-1)
            picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
            total = total + ((log_norm - picked) * trained).sum()
            if not (wants_hidden or wants_weight or wants_bias):
                continue
            # d loss / d logits = softmax - one-hot, zero where nothing is trained; in place over the chunk's logits
            grad = logits.sub_(log_norm.unsqueeze(1)).exp_()
            grad.scatter_add_(1, target.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
            grad.mul_(trained.unsqueeze(1))
            grad = grad.to(compute_dtype)  # as autograd hands it to the projection's backward
            if grad_hidden is not None:
                grad_hidden[part] = grad @ weight.to(compute_dtype)
            if grad_weight is not None:
                grad_weight += (grad.t() @ h.to(compute_dtype)).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias) if t is not None))
        ctx.kept = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Optional[Tensor], ...]:
        # The kept gradients are scaled in place: a copy of the head's weight gradient (the vocabulary × width, fp32)
        # would be the step's largest transient. So this backward runs once per forward.
        if getattr(ctx, "consumed", False):
            raise RuntimeError("The chunked linear cross entropy cannot back-propagate twice (retain_graph=True);"
                               " compute the loss again, or pass loss_chunk=None.")
        ctx.consumed = True
        saved = iter(ctx.saved_tensors)
        grads: list[Optional[Tensor]] = []
        for kept, dtype in zip(ctx.kept, ctx.dtypes):
            grads.append(next(saved).mul_(grad_total).to(dtype) if kept else None)
        return (*grads, None, None)


def linear_cross_entropy_sum(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk_tokens: int
) -> Tensor:
    """``(N, H)`` hidden states and ``(N,)`` labels → the summed token loss (see :class:`LinearCrossEntropy`)."""
    total = LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens)
    assert isinstance(total, Tensor)
    return total


class FrozenLinearTokenLogProbs(torch.autograd.Function):
    """Each token's ``log softmax(F.linear(hidden, weight, bias) / temperature)[label]`` through a frozen head (LoRA's,
    QLoRA's, a reference's), chunk by chunk, and its entropy (measured, not differentiated).

    With the head frozen only the hidden states want a gradient, and each token's is the same vector scaled by the
    incoming gradient of that token: ``(one-hot - softmax) @ weight / temperature``, made in the forward while the
    chunk's logits exist, scaled in backward. No projection is recomputed."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk_tokens: int,
                temperature: float) -> tuple[Tensor, Tensor]:
        wants_hidden = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        logps = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps)
        for start in range(0, targets.shape[0], chunk_tokens):
            part = slice(start, start + chunk_tokens)
            logits = F.linear(hidden[part], weight, bias)
            compute_dtype = logits.dtype
            logits = logits.float()
            if temperature != 1.0:
                logits = logits / temperature
            log_softmax = logits.log_softmax(-1)
            del logits
            picked = log_softmax.gather(1, targets[part].unsqueeze(1)).squeeze(1)
            logps[part] = picked
            probs = log_softmax.exp()
            entropy[part] = -(probs * log_softmax).sum(-1)
            del log_softmax
            if grad_hidden is not None:  # d log p[y] / d logits = one-hot - softmax
                grad = probs.neg_()
                grad.scatter_add_(1, targets[part].unsqueeze(1), torch.ones_like(picked).unsqueeze(1))
                if temperature != 1.0:
                    grad.div_(temperature)
                grad_hidden[part] = grad.to(compute_dtype) @ weight.to(compute_dtype)
        if grad_hidden is not None:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(entropy)
        ctx.hidden_dtype = hidden.dtype
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor, grad_entropy: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        if not ctx.saved_tensors:
            return (None,) * 6
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_logps.unsqueeze(1).to(grad_hidden.dtype)).to(ctx.hidden_dtype), *(None,) * 5


def frozen_linear_token_log_probs(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk_tokens: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """``(N, H)`` hidden states and ``(N,)`` targets through a frozen head → ``(log p, entropy)``, each ``(N,)``."""
    logps, entropy = FrozenLinearTokenLogProbs.apply(hidden, weight, bias, targets, chunk_tokens, temperature)
    return logps, entropy
