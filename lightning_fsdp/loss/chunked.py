"""The causal-LM loss without the whole logits: the output projection and the cross entropy run one chunk of tokens
at a time.

At 8192 tokens Llama-3's logits (vocabulary 128k) are 4.2 GB in fp32, and their gradient as much again: more than a
4-bit 8B base. Here at most one chunk's logits (``chunk_tokens × vocab``) exist at a time, in forward and in
backward. It is plain torch: it runs on CPU and GPU, keeps autocast (each chunk's logits are upcast to fp32 before
the softmax, as ``F.cross_entropy(logits.float(), ...)`` is) and composes with ``torch.compile``. Two paths:

- a plain ``nn.Linear`` head (transformers' ``lm_head``, tied or not, trainable or frozen):
  :mod:`~lightning_fsdp.loss.linear_cross_entropy` computes each chunk's gradients in the forward pass, so no
  chunk is recomputed and the step costs what the whole logits' does;
- any other head (LoRA-wrapped, quantized, a callable) is called as it is, each chunk under non-reentrant
  :func:`torch.utils.checkpoint.checkpoint`, its logits recomputed in backward.

Under FSDP2 the head lives in the root unit, whose parameters stay gathered from the root's forward through backward:
the chunks re-use one all-gather.

The result is ``(Σ token losses, target tokens)``: what :class:`~lightning_fsdp.loss.TokenWeightedLoss` divides.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp.loss.linear_cross_entropy import (
    frozen_linear_token_log_probs,
    linear_cross_entropy_sum,
    plain_linear,
)
from lightning_fsdp.loss.token_mean import IGNORE_INDEX

__all__ = ["DEFAULT_CHUNK_TOKENS", "check_chunk_tokens", "chunked_causal_lm_eval", "chunked_causal_lm_loss",
           "sequence_log_probs", "token_log_probs"]

#: tokens per chunk unless told otherwise: measured at real vocabularies (benchmarks/loss_chunk.py, 2048 tokens,
#: fused path): 512 takes 0.83x the whole logits' forward + backward at SmolLM2's 49,152 and 0.94x at Llama 3's 128,256
#: (256: 0.95x and 1.19x; 1024: 0.73x and 0.95x at twice the memory), with a quarter of their transient memory
DEFAULT_CHUNK_TOKENS = 512

Head = Union[nn.Module, Callable[[Tensor], Tensor]]


def check_chunk_tokens(chunk_tokens: int) -> int:
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise ValueError(f"loss_chunk={chunk_tokens!r}: the tokens per loss chunk must be a positive integer (e.g. 256).")
    return chunk_tokens


def _chunk_loss(head: Head, hidden: Tensor, labels: Tensor) -> Tensor:
    logits = head(hidden)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(
    hidden: Tensor, head: Head, labels: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, shift: bool = True
) -> tuple[Tensor, Tensor]:
    """``(Σ token cross entropies, number of target tokens)`` of ``head(hidden)`` against ``labels``.

    ``hidden``: ``(..., T, H)`` final hidden states (after the final norm); ``head``: the output projection (the
    model's ``get_output_embeddings()``); ``labels``: ``(..., T)``, ``-100`` where nothing is trained. ``shift``
    as in :func:`~lightning_fsdp.loss.causal_lm_token_loss`. Equal to it over the whole logits, to fp32 tolerance.
    """
    check_chunk_tokens(chunk_tokens)
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    keep = labels != IGNORE_INDEX
    count = keep.sum()
    if not torch.compiler.is_compiling():  # drop untrained positions first: their logits are never needed
        hidden, labels = hidden[keep], labels[keep]
    linear = plain_linear(head) if torch.is_grad_enabled() else None
    if linear is not None:  # a plain projection: gradients made in the same pass, nothing recomputed
        return linear_cross_entropy_sum(hidden, *linear, labels, chunk_tokens), count
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, labels.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, hidden[part], labels[part], use_reentrant=False)
        else:
            total = total + _chunk_loss(head, hidden[part], labels[part])
    return total, count


@torch.no_grad()
def chunked_causal_lm_eval(
    hidden: Tensor, head: Head, labels: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, shift: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Σ token losses, target tokens, targets the argmax predicts)`` for evaluation, one chunk at a time."""
    check_chunk_tokens(chunk_tokens)
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    labels = labels.reshape(-1)
    keep = labels != IGNORE_INDEX
    hidden, labels = hidden.reshape(-1, hidden.shape[-1])[keep], labels[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, labels.shape[0], chunk_tokens):
        logits = head(hidden[start:start + chunk_tokens]).float()
        part = labels[start:start + chunk_tokens]
        total = total + F.cross_entropy(logits, part, reduction="sum")
        correct = correct + (logits.argmax(-1) == part).sum()
    return total, keep.sum(), correct


def _chunk_token_log_probs(head: Head, hidden: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = -F.cross_entropy(logits, targets, reduction="none")
    with torch.no_grad():  # the entropy is only measured
        log_softmax = logits.log_softmax(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return logps, entropy


def token_log_probs(
    hidden: Tensor, head: Head, labels: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(log p, entropy)`` of every labelled token, both ``(rows, T)`` aligned with ``labels`` and 0 where the label
    is ``-100``: what policy-gradient and preference losses are made of. Position ``t`` of the result is the
    probability of ``labels[t]`` given the tokens before it (``hidden`` at ``t - 1``); the logits are divided by
    ``temperature`` first, as the sampler did. The projection runs one chunk of labelled tokens at a time (each
    chunk recomputed in backward), so the whole logits never exist; the log-probabilities carry the gradient, the
    entropies do not."""
    check_chunk_tokens(chunk_tokens)
    rows, width = labels.shape
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    flat_hidden, targets = hidden[:, :-1][keep], shifted[keep]
    place = torch.cat([torch.zeros_like(keep[:, :1]), keep], dim=1)
    dense = torch.zeros(rows, width, dtype=torch.float32, device=labels.device)
    linear = plain_linear(head)
    if linear is not None and not any(t is not None and t.requires_grad for t in linear):  # a frozen plain head
        flat_logps, flat_entropy = frozen_linear_token_log_probs(flat_hidden, *linear, targets, chunk_tokens,
                                                                 temperature)
        return dense.masked_scatter(place, flat_logps), dense.masked_scatter(place, flat_entropy)
    logps, entropies = [], []
    for start in range(0, targets.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk_token_log_probs, head, flat_hidden[part], targets[part], temperature,
                                       use_reentrant=False)
        else:
            logp, entropy = _chunk_token_log_probs(head, flat_hidden[part], targets[part], temperature)
        logps.append(logp)
        entropies.append(entropy)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    flat_logps = torch.cat(logps) if logps else empty
    flat_entropy = torch.cat(entropies) if entropies else empty
    return dense.masked_scatter(place, flat_logps), dense.masked_scatter(place, flat_entropy.detach())


def sequence_log_probs(
    hidden: Tensor, head: Head, labels: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> tuple[Tensor, Tensor]:
    """``(Σ log p of each row's labelled tokens, labelled token count)``, both of shape ``(rows,)``: a completion's
    log-probability, as preference losses and reference models score it (:func:`token_log_probs`, summed per row).

    ``hidden``: ``(rows, T, H)`` final hidden states; ``labels``: ``(rows, T)`` aligned with the inputs (position
    ``t`` predicts ``labels[t + 1]``), ``-100`` on the prompt and padding."""
    logps, _ = token_log_probs(hidden, head, labels, chunk_tokens=chunk_tokens)
    return logps.sum(dim=1), (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
