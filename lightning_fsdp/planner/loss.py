"""What the causal-LM loss holds at its peak, for the activation estimates of every model family."""

from __future__ import annotations

from typing import Optional


def loss_bytes(vocab: int, d_model: int, compute_bytes: int, tokens: int, loss_chunk: Optional[int]) -> int:
    """Bytes the loss holds at its peak: the logits (compute dtype, an fp32 copy, log-softmax and its gradient) for
    every token, or for one chunk of ``loss_chunk`` tokens plus the hidden states the chunked loss keeps."""
    p = compute_bytes
    per_token = vocab * (p + (4 if p < 4 else 0) + 4 + 4)
    if loss_chunk is None:
        return tokens * per_token
    return min(tokens, loss_chunk) * per_token + tokens * d_model * p
