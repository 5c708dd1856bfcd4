"""Where a strategy's ranks sit: devices, the replicate × shard × context mesh, and how the data is split over it.

The same for the Trainer's and Fabric's front ends (:class:`~lightning_fsdp.trainer.mesh_strategy.MeshStrategy`,
:class:`~lightning_fsdp.fabric.FSDPCustomFabricStrategy`), which list this mixin first among their bases. It reads
the attributes both of Lightning's ``ParallelStrategy`` classes have (``parallel_devices``, ``local_rank``,
``global_rank``) and the front end's ``num_nodes``, ``replicate_size``, ``shard_size``, ``context_parallel``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning_utilities.core.rank_zero import rank_zero_only  # the object Lightning's rank_zero_* helpers read

from lightning_fsdp.parallel import mesh as mesh_utils

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshPlacement:
    """Devices, the mesh shape (resolved once, checked before any process group exists) and the sampler split."""

    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Any
    local_rank: int
    global_rank: int
    node_rank: int
    num_nodes: int
    replicate_size: mesh_utils.SizeArg
    shard_size: mesh_utils.SizeArg
    context_parallel: int = 1
    _mesh_shape: Optional[mesh_utils.MeshShape] = None
    _device_mesh: Optional[DeviceMesh] = None

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def mesh_shape(self) -> mesh_utils.MeshShape:
        if self._mesh_shape is None:
            self._mesh_shape = mesh_utils.resolve_mesh_shape(
                self.replicate_size, self.shard_size, self.num_nodes * self.num_processes, self.num_nodes,
                self.context_parallel,
            )
        return self._mesh_shape

    def set_world_ranks(self) -> None:
        """This process's global rank and the world size, told to the cluster environment and to Lightning's
        rank-zero helpers; the mesh sizes are checked here, before any process group exists."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        setattr(rank_zero_only, "rank", self.global_rank)  # an attribute Lightning gives the function at import
        if self.parallel_devices:
            self._mesh_shape = None
            _ = self.mesh_shape

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh is only available after the process group is set up.")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every data-parallel rank (replicas × shards) reads different data; the ranks of a context-parallel group
        read the same batch and split it along the sequence."""
        context = max(1, int(self.context_parallel))
        if self._device_mesh is None:
            return {"num_replicas": max(1, self.num_nodes * self.num_processes // context),
                    "rank": self.global_rank // context}
        rank = mesh_utils.data_parallel_rank(self._device_mesh, context)
        return {"num_replicas": self.mesh_shape.data_parallel_size, "rank": rank}
