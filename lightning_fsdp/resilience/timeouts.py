"""Named timeouts: a collective that timed out is re-raised as :class:`CollectiveTimeoutError` naming the
operation, the rank, the configured timeout and what to check; every other error passes unchanged."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from lightning_fsdp.parallel.collectives import launch_rank
from lightning_fsdp.resilience.errors import AgreedError, CollectiveTimeoutError, PartialFailureError


def is_timeout_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective timeout: a ``torch.distributed`` error saying so, gloo's "Timed out
    waiting 1800000ms for recv operation" or the nccl watchdog's "collective operation timeout" (not any error
    that mentions a timeout, e.g. a user's HTTP request in a step)."""
    text = str(error)
    dist_error = getattr(dist, "DistError", ())
    if isinstance(error, dist_error) and re.search(r"timed out|timeout", text, flags=re.IGNORECASE):
        return True
    return bool(re.search(r"Timed out waiting \d+ ?ms|collective operation timeout|gloo.*timed out", text, re.I | re.S))


def timeout_message(operation: str, rank: int, timeout: timedelta, original: BaseException) -> str:
    """The error a timed-out collective becomes: what hung, where, after how long, and what to do."""
    seconds = timeout.total_seconds()
    return (
        f"Collective timed out on rank {rank}: {operation} did not complete within timeout={seconds:g} s.\n"
        "Another rank is not taking part: it is stuck or slow (a long data load, a rank-dependent code path), it"
        " failed without reaching the store, or the ranks ran different numbers of batches."
        " Check the other ranks' output. If the operation is merely slow, raise the strategy's `timeout=`"
        f" (seconds).\nOriginal error: {type(original).__name__}: {str(original).strip()[:500]}"
    )


@contextmanager
def naming_timeouts(operation: Callable[[], str], timeout: timedelta) -> Iterator[None]:
    """Translate a collective timeout inside the block into :class:`CollectiveTimeoutError` for ``operation()``
    (only evaluated when one happens)."""
    try:
        yield
    except (CollectiveTimeoutError, PartialFailureError, AgreedError):
        raise
    except Exception as err:  # noqa: BLE001 - only timeouts are translated; everything else passes unchanged
        if is_timeout_error(err):
            raise CollectiveTimeoutError(timeout_message(operation(), launch_rank(), timeout, err)) from err
        raise
