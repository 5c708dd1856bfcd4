"""The parallel layer every other module builds on: the mesh, rank agreement, the process group, grad norms.

==========================  ==========================================================================================
:mod:`.mesh`                ``MeshShape`` (replicate × shard, validated), the ``DeviceMesh`` built from it, a tensor's
                            local shard
:mod:`.collectives`         this rank, world size, object broadcast/gather, and :func:`agree`: run on every rank, raise
                            the same error on every rank if any rank failed
:mod:`.process_group`       backend and timeout choices, timeouts for every group, destroying the group at exit
:mod:`.grad_norm`           the global norm of sharded gradients (one fused reduction, one all-reduce) and clipping
:mod:`.sequence`            context parallelism's layout: each rank's head and tail chunk of a row, the batch split
:mod:`.ring`                ring attention over a context-parallel group (exact, with its backward)
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
from lightning_fsdp.parallel.ring import ring_attention
from lightning_fsdp.parallel.sequence import SequenceLayout, SequenceSplit, active_split, split_batch

__all__ = [
    "MeshShape",
    "SequenceLayout",
    "SequenceSplit",
    "SizeArg",
    "active_split",
    "agree",
    "all_equal",
    "all_gather_object",
    "broadcast_object",
    "build_device_mesh",
    "data_parallel_rank",
    "local_shard",
    "rank",
    "resolve_mesh_shape",
    "ring_attention",
    "split_batch",
    "world_size",
]
