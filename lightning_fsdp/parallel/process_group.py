"""The process group: which backend, how long a collective may take, and a clean end at interpreter exit."""

from __future__ import annotations

import atexit
import gc
import os
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


#: the rendezvous store rank 0 serves before it joins (see :func:`serve_rendezvous_store`)
_early_store: Optional[Any] = None


def serve_rendezvous_store(env: Optional[dict[str, str]] = None) -> bool:
    """Global rank 0, having just started the other local ranks: serve the job's TCP store at ``MASTER_ADDR``/
    ``MASTER_PORT`` now, not when this rank reaches ``init_process_group``; False where it could not.

    A rank that looks for the store before it exists retries with a growing back-off, so when the others arrive
    first (warm-started ranks, while rank 0 still imports) joining took 0.35-0.5 s after the last rank arrived, on
    2 CPU ranks. ``init_process_group``'s own store on rank 0 is multi-tenant: it shares this server. A store that
    cannot be served here (no such variables, the port taken) is left to ``init_process_group``, which reports it.
    """
    import torch.distributed as dist

    global _early_store
    env = dict(os.environ) if env is None else env
    try:
        address, port, world_size = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"])
        _early_store = dist.TCPStore(  # the arguments torch's env:// rendezvous gives rank 0's store
            address, port, world_size, True, wait_for_workers=False, multi_tenant=True,
            use_libuv=env.get("USE_LIBUV", "1") == "1",
        )
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


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

    global _early_store
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _early_store = None
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
