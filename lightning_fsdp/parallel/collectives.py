"""This rank, the world, and agreement between ranks: the one notion of rank every module uses.

:func:`agree` is the mechanism that keeps a multi-rank operation from hanging when it fails on some ranks only:
every rank runs its part, the ranks exchange "did it work", and if any rank failed every rank raises the same error.
Without a process group everything degrades to one process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_distributed() -> bool:
    """A default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def launch_rank() -> int:
    """The global rank, also before the process group exists (from the launcher's environment)."""
    if is_distributed():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier(device: torch.device) -> None:
    """Every rank waits here for the others (nccl needs the device this rank computes on)."""
    if not is_distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> T:
    """Rank ``src``'s value on every rank. Pickled: only for values the ranks produced themselves (the package's
    plain data, a strategy's ``broadcast``), never for bytes read from a file."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's value, in rank order. Only for this package's own plain data (it is pickled)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_stacked(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, ``(world, *tensor.shape)``, without autograd: the plain c10d
    all-gather (Lightning's ``all_gather`` goes through ``torch.distributed.nn.functional.all_gather``, deprecated,
    even when no gradient is wanted). Without a process group, ``tensor`` itself, as Lightning returns it."""
    if not is_distributed():
        return tensor
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


def collective_device() -> torch.device:
    """Where a small tensor for a collective on the default group must live: the current GPU under NCCL alone."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce of one integer (no pickling)."""
    if not is_distributed():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_equal(values: Sequence[float], device: torch.device) -> bool:
    """Whether every rank passed the same ``values``: one all-reduce of their minima and maxima."""
    if not is_distributed() or dist.get_world_size() < 2:
        return True
    local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    lowest, highest = both[: len(values)], -both[len(values) :]
    return bool(torch.equal(lowest, highest))


def describe_error(err: BaseException) -> str:
    """One line per failure, including each rank's failure inside DCP's ``CheckpointException``."""
    if isinstance(err, CheckpointException):
        parts = [f"rank {r}: {type(e).__name__}: {e}" for r, (e, _tb) in sorted(err.failures.items())]
        return "; ".join(parts) or str(err).splitlines()[0]
    return f"{type(err).__name__}: {err}"


def agree(
    fn: Callable[[], T],
    what: str,
    *,
    error_type: type[Exception] = RuntimeError,
    on_error: Optional[Callable[[], None]] = None,
    hint: str = "",
) -> T:
    """Run ``fn`` on this rank; if it failed on any rank, every rank raises the same ``error_type``.

    A failure that already is an ``error_type`` keeps its message (it names the file and the fix); any other is
    prefixed with ``what`` and followed by ``hint`` (what state things are in, what to do). ``on_error`` runs on every
    rank before raising (e.g. to delete a staging directory); its own errors are logged, not raised. DCP's
    ``CheckpointException`` derives from ``BaseException`` and is caught too. On a rank that failed, the raised
    error's ``__cause__`` is that rank's own exception, with its traceback.
    """
    result: Any = None
    error: Optional[tuple[bool, str]] = None
    local: Optional[BaseException] = None  # kept as the raised error's cause: this rank's traceback survives
    try:
        result = fn()
    except (Exception, CheckpointException) as err:
        local = err
        error = (isinstance(err, error_type), describe_error(err) if not isinstance(err, error_type) else str(err))
    if not any_rank(error is not None):  # the common case: one small all-reduce; messages only on failure
        return result
    errors = all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    if on_error is not None:
        try:
            on_error()
        except Exception as cleanup_err:  # noqa: BLE001 - best effort; the original failure is what gets raised
            log.warning("cleanup after a failed %s failed: %s", what, cleanup_err)
    messages = list(dict.fromkeys(msg for _, (_, msg) in failed))
    if len(messages) == 1:
        detail = messages[0]
        if len(failed) < len(errors):
            detail += f" (on rank {', '.join(str(r) for r, _ in failed)})"
    else:
        detail = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in failed)
    if len(messages) == 1 and all(is_ours for _, (is_ours, _) in failed):
        raise error_type(detail) from local
    raise error_type(f"{what} failed: {detail}." + (f" {hint}" if hint else "")) from local


def on_rank_zero(fn: Callable[[], T]) -> Callable[[], Optional[T]]:
    """``fn`` on rank 0, a no-op elsewhere: for :func:`agree` around work only rank 0 does."""
    return fn if rank() == 0 else _nothing


def _nothing() -> None:
    return None
