"""Preemption: SIGTERM / SIGUSR1 only set a flag; at the next optimizer-step boundary the ranks agree on it, save
``last`` through the strategy's atomic path, and exit with :data:`PREEMPTED_EXIT_CODE` (requeued on SLURM)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_fsdp.resilience.report import say

#: the instance whose handlers are installed (signal handlers are process-wide by nature)
_ACTIVE: Optional[Preemption] = None


class Preemption:
    """SIGTERM / SIGUSR1 set a flag (no collective in a signal handler); the ranks agree on it at step boundaries."""

    def __init__(self, failing: Callable[[], bool] = lambda: False) -> None:
        self.requested: int = 0
        self._previous: dict[int, Any] = {}
        self._failing = failing  # a rank already ending after an error (e.g. torchrun's SIGTERM to it) saves nothing

    def install(self, signals: Iterable[int]) -> None:
        """Take over ``signals`` (after Lightning registered its handlers, whose SIGTERM handler would run a
        broadcast on the signalled rank only). Main thread only; idempotent."""
        global _ACTIVE
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signals:
            if signum in self._previous:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        _ACTIVE = self

    def uninstall(self) -> None:
        global _ACTIVE
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if _ACTIVE is self:
            _ACTIVE = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self._failing():
            return
        if not self.requested:
            say(f"received {signal.Signals(signum).name}: saving a checkpoint after the current step, then exiting.")
        self.requested = signum

    def agree(self, device: torch.device) -> int:
        """All ranks: the largest signal number any rank received (0: none). One tiny all-reduce."""
        flag = torch.tensor([self.requested], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def preemption_requested() -> bool:
    """Whether this process received a preemption signal (SIGTERM/SIGUSR1) that training has not yet acted on.

    Long loops inside a step (e.g. generation) may poll it to return early; the save happens at the step's end.
    """
    return bool(_ACTIVE is not None and _ACTIVE.requested)


def requeue_at_exit() -> None:
    """Requeue as the process's last act: SLURM answers a requeue by sending SIGTERM to the job, which is then
    ignored, so this rank still ends with ``PREEMPTED_EXIT_CODE`` rather than "terminated"."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requeue_slurm_job()


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this job, as Lightning's own SLURM handler does."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        say("scontrol not found: the job is not requeued (requeue it from the batch script on exit code 75).")
        return
    say(f"requeued SLURM job {job_id}" if result == 0 else f"`scontrol requeue {job_id}` failed with {result}")
