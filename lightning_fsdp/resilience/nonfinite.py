"""Non-finite steps: a NaN/inf loss on any rank, or a non-finite global gradient norm, skips the optimizer step on
every rank together (and too many in a row stop training with an error that says what to change)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_fsdp.fixes import FixWording, current_wording
from lightning_fsdp.parallel.collectives import is_distributed, rank
from lightning_fsdp.parallel.grad_norm import StepGradNorm
from lightning_fsdp.resilience.errors import NonFiniteStepsError
from lightning_fsdp.resilience.report import say


def nonfinite_message(consecutive: int, limit: int, step: int, detail: str, clip_gradients: str) -> str:
    return (
        f"{consecutive} consecutive optimizer steps had a non-finite loss or gradient norm (limit"
        f" max_nonfinite_steps={limit}; last at global step {step}: {detail}); every rank skipped them, and training"
        f" is stopped now rather than continuing without progress. Lower the learning rate,"
        f" {clip_gradients}, use bf16 rather than fp16, check the data for NaN/inf, or raise"
        " `max_nonfinite_steps`."
    )


class NonFiniteGuard:
    """Skip an optimizer step on every rank when any rank's loss, or the global gradient norm, is NaN/inf.

    The gradient norm comes from ``grad_norm``, the step's shared norm: with gradient clipping on as well, the norm
    is computed once per step. The check costs one small all-reduce and one host transfer (the agreed flags).
    """

    def __init__(
        self, max_consecutive: int, grad_norm: Optional[StepGradNorm] = None, wording: Optional[FixWording] = None
    ) -> None:
        if max_consecutive < 1:
            raise ValueError(f"`max_nonfinite_steps` must be >= 1, got {max_consecutive}.")
        self.max_consecutive = max_consecutive
        self.grad_norm = grad_norm or StepGradNorm()
        self.wording = wording or current_wording()  # the front end's: the check runs inside its step
        self.skipped = 0
        self.consecutive = 0

    def wrap(
        self,
        closure: Callable[[], Any],
        optimizer: torch.optim.Optimizer,
        step: Callable[[], int],
        device: torch.device,
        check_grads: bool,
    ) -> Callable[[], Any]:
        """The closure a front end passes to ``optimizer.step``: forward+backward, then the agreed check (``step``
        names the optimizer step in messages; ``device`` is the communication device).

        Grads are set to ``None`` on a skip: torch optimizers then leave those parameters (and their state, e.g.
        Adam's step count and moments) untouched, unlike zero gradients, which still decay and move momentum.
        """

        def guarded() -> Any:
            loss = closure()
            self.check(loss, optimizer, step(), device, check_grads)
            return loss

        return guarded

    def check(
        self, loss: Any, optimizer: torch.optim.Optimizer, step: int, device: torch.device, check_grads: bool
    ) -> bool:
        """Returns True if the step was skipped. Collective: every rank calls it at the same step. ``device``: the
        communication device (parameters may be CPU-offloaded while the backend is nccl)."""
        loss_bad = (
            ~torch.isfinite(loss.detach()).all() if isinstance(loss, torch.Tensor) else torch.tensor(False)
        ).to(device=device, dtype=torch.float32)
        norm = torch.tensor(0.0)
        if check_grads:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = self.grad_norm.get(params)
        norm_bad = (~torch.isfinite(norm)).to(device=device, dtype=torch.float32)
        flags = torch.stack([loss_bad.reshape(()), norm_bad.reshape(())])
        if is_distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_agreed_bad, norm_agreed_bad = (value > 0 for value in flags.tolist())  # the one host transfer
        if not (loss_agreed_bad or norm_agreed_bad):
            self.consecutive = 0
            return False
        optimizer.zero_grad(set_to_none=True)
        self.grad_norm.invalidate()
        self.skipped += 1
        self.consecutive += 1
        parts = (("loss is NaN/inf on at least one rank", loss_agreed_bad), (f"grad norm = {float(norm)}", norm_agreed_bad))
        detail = ", ".join(part for part, bad in parts if bad)
        if rank() == 0:
            say(f"skipped optimizer step at global step {step} on every rank: {detail} (so far: {self.skipped})")
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepsError(
                nonfinite_message(self.consecutive, self.max_consecutive, step, detail, self.wording.clip_gradients)
            )
        return True
