"""The per-token mean of a global batch, at any split into ranks and accumulated micro-batches.

Averaging each micro-batch's loss and then averaging those means (over accumulation steps, over ranks) weighs a
token in a short micro-batch more than one in a long one: ``Σᵢ(Lᵢ/nᵢ)/k ≠ ΣLᵢ/Σnᵢ``, so ``accumulate_grad_batches=4``
trains another model than a 4× larger batch. The step's gradient here is always

    ∇ (Σ over every micro-batch on every rank of the summed token losses) / (Σ of their target tokens)

How: each micro-batch back-propagates its *summed* token loss; the data-parallel reduction divides the gradients by
the data-parallel size, and Lightning divides each micro-batch's loss by ``accumulate_grad_batches``. When the
window is complete (before clipping, so clipping sees the normalised gradient), one all-reduce of (Σ loss, Σ count)
gives the global count ``N`` and the gradients are multiplied by ``divisor / N``. Nothing is prefetched, and the
count is exact whatever the lengths, padding or packing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_fsdp.parallel.grad_norm import scale_gradients_

__all__ = ["IGNORE_INDEX", "TokenWeightedLoss", "causal_lm_token_loss", "gradient_divisor"]

#: the label of a position that is not trained (transformers' and PyTorch's convention)
IGNORE_INDEX = -100


def causal_lm_token_loss(logits: Tensor, labels: Tensor, *, shift: bool = True) -> tuple[Tensor, Tensor]:
    """``(Σ token cross entropies, number of target tokens)`` of a batch, in fp32 (fp64 logits stay fp64).

    ``shift=True``: ``labels`` are aligned with the inputs (transformers' convention), so position ``t`` predicts
    ``labels[t + 1]``. ``shift=False``: ``labels`` are already the next-token targets. ``-100`` is never a target.
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    labels = labels.reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    flat = flat if flat.dtype == torch.float64 else flat.float()
    total = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (labels != IGNORE_INDEX).sum()


def gradient_divisor(trainer: Any) -> int:
    """What a Lightning Trainer has divided each gradient by when a window's backward passes are done: its
    ``accumulate_grad_batches`` × the ranks its strategy's gradient reduction averages over (every rank that holds
    different tokens: replicas × shards for HSDP, × the context-parallel ranks that split each sequence)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    replicas = int(kwargs.get("num_replicas", trainer.world_size if getattr(trainer.strategy, "is_distributed", False) else 1))
    context = int(getattr(trainer.strategy, "context_parallel", 1) or 1)
    return int(trainer.accumulate_grad_batches) * replicas * context


class TokenWeightedLoss:
    """Collects each micro-batch's summed token loss and target count, and at the step normalises the gradients by
    the global count.

    With the Trainer (``HFCausalLM`` does exactly this)::

        def training_step(self, batch, batch_idx):
            total, count = causal_lm_token_loss(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])
            return self.token_loss.add(total, count)

        def on_before_optimizer_step(self, optimizer):
            mean = self.token_loss.finish_step(self.parameters(), gradient_divisor(self.trainer))
            self.log("train_loss", mean)

    In a Fabric loop: ``fabric.backward(token_loss.add(total, count))`` for each micro-batch, then
    ``token_loss.finish_step(model.parameters(), fabric.world_size)`` before clipping and ``optimizer.step()``.

    :meth:`add` returns a tensor whose *gradient* is that of ``total`` and whose *value* is the micro-batch's own
    per-token mean, so progress bars and ``outputs["loss"]`` read as a mean loss.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group
        self._window: Optional[Tensor] = None  # (Σ loss, Σ count) of this rank's micro-batches since the last step

    def add(self, total: Tensor, count: Tensor) -> Tensor:
        """Record one micro-batch (``total``: its summed token loss; ``count``: its target tokens); returns what to
        back-propagate."""
        count = torch.as_tensor(count, device=total.device)
        pair = torch.stack([total.detach().float(), count.float()])
        self._window = pair if self._window is None else self._window + pair
        mean = total.detach() / count.clamp(min=1)
        return total + (mean - total.detach())  # value: the micro-batch mean; gradient: ∇ total

    @property
    def pending(self) -> bool:
        """Micro-batches were added since the last :meth:`finish_step`."""
        return self._window is not None

    def finish_step(self, parameters: Iterable[Tensor], divisor: float) -> Tensor:
        """Agree the window's (Σ loss, Σ count) over the ranks, multiply the gradients by ``divisor / Σ count``
        (``divisor``: what backward and the data-parallel reduction already divided by, see
        :func:`gradient_divisor`) and return the window's global per-token mean loss. A window without a target
        token leaves the gradients at zero."""
        if self._window is None:
            raise RuntimeError("TokenWeightedLoss.finish_step() before any add(): call add() in every training step.")
        pair, self._window = self._window, None
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(pair, group=self.process_group)
        total, count = pair[0], pair[1].clamp(min=1.0)
        scale_gradients_(parameters, divisor / count)
        return total / count
