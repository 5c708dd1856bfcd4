"""The process group: which backend, how long a collective may take, and a clean end at interpreter exit."""

from __future__ import annotations

import atexit
import gc
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


BACKENDS = (None, "nccl", "gloo", "mpi", "cpu:gloo,cuda:nccl")


def check_backend(backend: Optional[str]) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"`process_group_backend={backend!r}`: use 'nccl', 'gloo' or None.")


def default_backend(device: torch.device) -> str:
    """nccl for CUDA devices, gloo for CPU (FSDP2 runs on CPU through gloo)."""
    return "nccl" if device.type == "cuda" else "gloo"


def as_timedelta(timeout: float | int | timedelta | None) -> timedelta:
    """Accept seconds (what a YAML file can hold) or a ``timedelta``."""
    if timeout is None:
        return timedelta(minutes=30)
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"`timeout` must be a positive number of seconds or a timedelta, got {timeout!r}.")
    return timedelta(seconds=float(timeout))


_exit_hook_registered = False
_GIL_HANDOVER_S = 0.05
_keep_at_exit: Optional[Callable[[], bool]] = None


def destroy_process_group_at_exit(keep_if: Optional[Callable[[], bool]] = None) -> None:
    """Destroy the default process group when the interpreter exits, while it is still fully alive.

    Without this, gloo's worker threads may still own work (and the tensors it holds) when the interpreter
    finalises; releasing them then aborts the process ("terminate called without an active exception", exit -6)
    after a run that succeeded. Lightning registers such a hook for nccl only. ``keep_if`` vetoes the destroy,
    e.g. while a failure is being handled: tearing a group down under peers still blocked in it could wait on them.
    Registering twice keeps one hook; the latest ``keep_if`` wins.
    """
    global _exit_hook_registered, _keep_at_exit
    _keep_at_exit = keep_if
    if not _exit_hook_registered:
        atexit.register(_destroy_at_exit)
        _exit_hook_registered = True


def release_process_group() -> None:
    """Destroy the default process group (if any), then let gloo's worker threads drop their last work.

    What still refers to a group (FSDP state, a device mesh: usually garbage cycles by then) keeps its backend alive
    past the destroy. Collecting it runs the destructors while the interpreter can still run them; sleeping briefly
    hands the GIL to worker threads waiting to release the tensors of the last collective. A thread that needs the
    GIL once the interpreter is finalising is what aborts the process.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    time.sleep(_GIL_HANDOVER_S)


def _destroy_at_exit() -> None:
    try:
        if _keep_at_exit is not None and _keep_at_exit():
            return
        release_process_group()  # also when the script destroyed the group itself: its workers may still hold work
    except Exception as err:  # noqa: BLE001 - at exit, a second traceback would only bury the first
        print(f"lightning_fsdp: could not destroy the process group at exit: {err}", file=sys.stderr)


def apply_timeout(world: Any, mesh: Optional[DeviceMesh], timeout: timedelta) -> None:
    """Give the default group and every mesh dimension's group the configured timeout. ``init_device_mesh``
    creates HSDP's sub-groups with PyTorch's 30-minute default, whatever the default group's timeout is."""
    groups = [world] + ([mesh.get_group(dim) for dim in range(mesh.ndim)] if mesh is not None else [])
    for group in groups:
        if hasattr(group, "set_timeout"):
            group.set_timeout(timeout)
