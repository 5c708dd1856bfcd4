"""Process group and device mesh: validated sizes and errors that show the arithmetic.

Everything here is a plain function of its arguments so it can be tested without a Trainer.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SizeArg = Union[int, Literal["auto"]]

REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"


@dataclass(frozen=True)
class MeshShape:
    """The data-parallel mesh: ``replicate`` copies of the model, each sharded over ``shard`` ranks.

    ``replicate == 1`` is plain FSDP (a 1-D mesh); ``replicate > 1`` is HSDP (a 2-D mesh, gradients are
    reduce-scattered within a shard group and all-reduced across replicas).
    """

    replicate: int
    shard: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def is_hybrid(self) -> bool:
        return self.replicate > 1

    @property
    def dim_names(self) -> tuple[str, ...]:
        return (REPLICATE_DIM, SHARD_DIM) if self.is_hybrid else (SHARD_DIM,)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.replicate, self.shard) if self.is_hybrid else (self.shard,)


def _check_size(name: str, value: SizeArg) -> None:
    if value == "auto" or value == -1:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, -1 or 'auto', got {value!r}.")


def resolve_mesh_shape(
    replicate_size: SizeArg, shard_size: SizeArg, world_size: int, num_nodes: int = 1
) -> MeshShape:
    """Turn the user's mesh sizes into concrete ones, or raise showing ``replicate × shard`` against the world size.

    ``"auto"`` (or ``-1``) for ``replicate_size`` means one replica per node (HSDP across nodes); for
    ``shard_size`` it means "whatever is left": ``world_size // replicate``.
    """
    _check_size("replicate_size", replicate_size)
    _check_size("shard_size", shard_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    replicate_auto = replicate_size in ("auto", -1)
    shard_auto = shard_size in ("auto", -1)
    replicate = max(num_nodes, 1) if replicate_auto else int(replicate_size)
    if shard_auto:
        if world_size % replicate != 0:
            raise ValueError(
                f"replicate_size={replicate} does not divide the world size {world_size}"
                f" ({num_nodes} node(s)); choose a replicate_size that divides {world_size},"
                " or set shard_size explicitly."
            )
        shard = world_size // replicate
    else:
        shard = int(shard_size)
        if replicate_auto and replicate * shard != world_size:
            if world_size % shard != 0:
                raise ValueError(
                    f"shard_size={shard} does not divide the world size {world_size};"
                    f" choose shard_size from the divisors of {world_size}."
                )
            replicate = world_size // shard
    if replicate * shard != world_size:
        raise ValueError(
            f"The data-parallel mesh does not fit the world: replicate_size × shard_size = {replicate} × {shard}"
            f" = {replicate * shard}, but WORLD_SIZE = {world_size} (num_nodes × devices)."
            " Make the product equal the number of processes, e.g. set shard_size='auto'."
        )
    return MeshShape(replicate=replicate, shard=shard)


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


def build_device_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """Create the mesh over the already-initialised default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.dim_names)


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This rank's position among all data-parallel ranks (replica-major), for the DistributedSampler."""
    if mesh.ndim == 1:
        return mesh.get_local_rank()
    return mesh.get_local_rank(REPLICATE_DIM) * mesh.size(1) + mesh.get_local_rank(SHARD_DIM)
