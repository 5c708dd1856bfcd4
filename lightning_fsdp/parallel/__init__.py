"""The data-parallel layer every other module builds on: the mesh, rank agreement, the process group, grad norms.

==========================  ==========================================================================================
:mod:`.mesh`                ``MeshShape`` (replicate × shard, validated), the ``DeviceMesh`` built from it, a tensor's
                            local shard
:mod:`.collectives`         this rank, world size, object broadcast/gather, and :func:`agree`: run on every rank, raise
                            the same error on every rank if any rank failed
:mod:`.process_group`       backend and timeout choices, timeouts for every group, destroying the group at exit
:mod:`.grad_norm`           the global norm of sharded gradients (one fused reduction, one all-reduce) and clipping
==========================  ==========================================================================================
"""

from lightning_fsdp.parallel.collectives import agree, all_equal, all_gather_object, broadcast_object, rank, world_size
from lightning_fsdp.parallel.mesh import (
    MeshShape,
    SizeArg,
    build_device_mesh,
    data_parallel_rank,
    local_shard,
    resolve_mesh_shape,
)

__all__ = [
    "MeshShape",
    "SizeArg",
    "agree",
    "all_equal",
    "all_gather_object",
    "broadcast_object",
    "build_device_mesh",
    "data_parallel_rank",
    "local_shard",
    "rank",
    "resolve_mesh_shape",
    "world_size",
]
