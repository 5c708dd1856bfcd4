"""Agreement between ranks when something goes wrong, so that a sharded job ends promptly or resumes exactly.

A sharded step is a chain of collectives: when one rank stops taking part (an exception, a signal, a NaN it alone
saw, one batch fewer), the others wait in the next collective until the process-group timeout. Every mechanism
here makes the ranks *agree* first:

==========================  ==========================================================================================
:mod:`.relay`               a rank's exception reaches every rank through the rendezvous store within seconds
:mod:`.launcher`            the launch both front ends' launchers run: the relay hears of an exception first;
                            :mod:`.children` reaps spawned ranks
:mod:`.parent`              a spawned rank watches the rank that spawned it, and names it if it dies
:mod:`.preemption`          SIGTERM/SIGUSR1 → agreed save of ``last`` → exit :data:`PREEMPTED_EXIT_CODE` (requeue)
:mod:`.nonfinite`           a NaN/inf loss or gradient norm on any rank skips the step on every rank
:mod:`.batches`             ranks with different numbers of batches all fail together; mid-epoch resume
:mod:`.timeouts`            a timed-out collective names the operation, the rank and the timeout
==========================  ==========================================================================================

:class:`Resilience` is the object both front ends hold. It knows no Trainer: progress, the step number and the
device come in as plain values and callables. The Trainer's adapter (its callback, launcher and the on-exception
save) is :mod:`lightning_fsdp.trainer.resilience`; Fabric's is in :mod:`lightning_fsdp.fabric.strategy`.
:func:`collective` is the one mechanism that guards a strategy hook: the failure gate before it and named timeouts
around it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from lightning_fsdp._lightning_compat import sync_ddp_if_available
from lightning_fsdp.fixes import FixWording
from lightning_fsdp.parallel import collectives
from lightning_fsdp.parallel.collectives import is_distributed
from lightning_fsdp.parallel.grad_norm import StepGradNorm
from lightning_fsdp.parallel.process_group import apply_timeout
from lightning_fsdp.resilience.batches import AgreedLoader, check_equal_batches, uneven_batches_message
from lightning_fsdp.resilience.errors import (
    PEER_FAILED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    AgreedError,
    CollectiveTimeoutError,
    NonFiniteStepsError,
    PartialFailureError,
    Preempted,
    UnevenBatchesError,
)
from lightning_fsdp.resilience.launcher import RelayedLaunch
from lightning_fsdp.resilience.nonfinite import NonFiniteGuard
from lightning_fsdp.resilience.preemption import Preemption, preemption_requested
from lightning_fsdp.resilience.relay import FailureRelay
from lightning_fsdp.resilience.timeouts import is_timeout_error, naming_timeouts, timeout_message

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "PEER_FAILED_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "AgreedError",
    "AgreedLoader",
    "CollectiveTimeoutError",
    "GuardedCollectives",
    "NonFiniteStepsError",
    "PartialFailureError",
    "Preempted",
    "RelayedLaunch",
    "Resilience",
    "UnevenBatchesError",
    "check_equal_batches",
    "collective",
    "is_timeout_error",
    "preemption_requested",
    "timeout_message",
    "uneven_batches_message",
]

F = TypeVar("F", bound=Callable[..., Any])


class Resilience:
    """Everything a front end delegates about failures, in one object: the failure relay, preemption signals,
    non-finite steps, uneven batches and named collective timeouts."""

    def __init__(
        self,
        timeout: timedelta,
        skip_nonfinite_steps: bool,
        max_nonfinite_steps: int,
        grad_norm: Optional[StepGradNorm] = None,
        wording: Optional[FixWording] = None,
    ) -> None:
        self.timeout = timeout
        self.relay = FailureRelay()
        self.preemption = Preemption(failing=lambda: self.relay.handling is not None)
        guard = NonFiniteGuard(max_nonfinite_steps, grad_norm, wording)  # validates max_nonfinite_steps either way
        self.nonfinite = guard if skip_nonfinite_steps else None

    @property
    def failing(self) -> bool:
        """This rank is handling its own exception (collectives and group teardown could wait on peers)."""
        return self.relay.handling is not None

    @property
    def rendezvous_timeout(self) -> timedelta:
        """How long ranks may take to *join* the process group: at least PyTorch's 30-minute default, so that a
        short collective ``timeout`` (to detect hangs early) does not fail a job whose processes start slowly."""
        return max(self.timeout, timedelta(minutes=30))

    def start(self, mesh: Optional[DeviceMesh]) -> None:
        """After the process group and mesh exist: give every group the collective timeout, start watching."""
        if not is_distributed():
            return
        apply_timeout(dist.group.WORLD, mesh, self.timeout)
        self.relay.start(dist.get_rank(), dist.get_world_size())

    def teardown(self) -> None:
        self.preemption.uninstall()
        self.relay.finish()

    def process_dataloader(
        self, dataloader: Any, progress: Callable[[], tuple[int, Any]], device: torch.device, stage: str = "training"
    ) -> Any:
        """``dataloader`` whose ranks agree on its length before the first batch (see :class:`AgreedLoader`);
        ``progress()`` → (batches of this epoch already processed, the number expected)."""
        if isinstance(dataloader, AgreedLoader):
            return dataloader
        return AgreedLoader(dataloader, progress, device, stage=stage)

    @contextmanager
    def around_collective(self, operation: Callable[[], str], gate: bool = True) -> Iterator[None]:
        """The failure gate before a collective (``gate``), named timeouts around it."""
        if gate and self.relay.handling is not None:
            self.relay.gate(operation())
        with naming_timeouts(operation, self.timeout):
            yield


def collective(operation: Union[str, Callable[..., str]], *, gate: bool = True) -> Callable[[F], F]:
    """Guard a strategy hook that runs collectives (the strategy has a ``resilience`` attribute).

    ``operation`` names it in errors: a format string over the hook's arguments (``"barrier({name!r})"``) or a
    function of them. It is formatted only when a failure or timeout happens, so the hot path pays nothing for it.
    ``gate=False`` for hooks that run inside the step itself (there is no failure to gate on yet).
    """

    def decorate(method: F) -> F:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            def describe() -> str:
                if callable(operation):
                    return operation(*args, **kwargs)
                bound = signature.bind(self, *args, **kwargs)
                bound.apply_defaults()
                return operation.format(**bound.arguments)

            with self.resilience.around_collective(describe, gate=gate):
                return method(self, *args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


class GuardedCollectives:
    """The collectives both front ends run alike, guarded by :func:`collective` (a mixin listed before Lightning's
    strategy class; the strategy has ``resilience`` and ``root_device``). Each front end keeps its own
    ``all_gather``/``all_reduce`` hook, gated as its loop needs, over :meth:`_gather_tensors` and
    :meth:`_reduce_tensor`."""

    root_device: torch.device

    @collective("barrier({name!r})")
    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        collectives.barrier(self.root_device)

    @collective("broadcast (from rank {src})")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, src)

    def _gather_tensors(self, tensor: torch.Tensor, group: Optional[Any], sync_grads: bool) -> torch.Tensor:
        if sync_grads:  # gradients through the gather: only Lightning's (autograd-aware) path has them
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]
        return collectives.all_gather_stacked(tensor, group)

    @staticmethod
    def _reduce_tensor(tensor: Any, group: Optional[Any], reduce_op: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
