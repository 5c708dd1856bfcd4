"""``MeshStrategy``: Lightning's process, rank and collective hooks for a data-parallel ``DeviceMesh``.

The half of the strategy that has nothing to do with sharding a model: it starts the processes (through the
failure-relaying launcher), joins the process group, builds the replicate × shard mesh, tells Lightning how to split
the data, and runs the collectives every LightningModule may call, each guarded by
:func:`~lightning_fsdp.resilience.collective`. :class:`~lightning_fsdp.trainer.strategy.FSDPCustomStrategy` adds the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_fsdp import _lightning_compat as compat
from lightning_fsdp.parallel import mesh as mesh_utils
from lightning_fsdp.parallel import process_group
from lightning_fsdp.parallel.placement import MeshPlacement
from lightning_fsdp.resilience import GuardedCollectives, collective
from lightning_fsdp.runtime import ShardedRuntime
from lightning_fsdp.trainer.resilience import ResilientLauncher

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshStrategy(GuardedCollectives, MeshPlacement, ParallelStrategy):
    """Processes, ranks, the data-parallel mesh and collectives. ``resilience`` handles failures between ranks."""

    def __init__(
        self,
        runtime: ShardedRuntime,
        replicate_size: mesh_utils.SizeArg = 1,
        shard_size: mesh_utils.SizeArg = "auto",
        process_group_backend: Optional[str] = None,
        context_parallel: int = 1,
        **kwargs: Any,
    ) -> None:
        mesh_utils.check_size("replicate_size", replicate_size)
        mesh_utils.check_size("shard_size", shard_size)
        mesh_utils.check_context_parallel(context_parallel)
        process_group.check_backend(process_group_backend)
        self.runtime = runtime
        self.resilience = runtime.resilience
        super().__init__(**kwargs)
        self.replicate_size = replicate_size
        self.shard_size = shard_size
        self.context_parallel = context_parallel
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._mesh_shape: Optional[mesh_utils.MeshShape] = None
        self._device_mesh: Optional[DeviceMesh] = None

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to inject a ``DistributedSampler`` (it only knows its own strategy classes)."""
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = ResilientLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self.resilience.relay)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or process_group.default_backend(self.root_device)
        assert self.cluster_environment is not None
        self._device_mesh = self.runtime.join(
            self.cluster_environment, self._process_group_backend, self.root_device, self.mesh_shape
        )
        compat.give_module_device_mesh(self.lightning_module, self._device_mesh)  # `configure_model` may use it

    # -- collectives ---------------------------------------------------------------------------------------------------
    @override
    @collective("all_gather")
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self._gather_tensors(tensor, group, sync_grads)

    @override
    @collective("all_reduce ({reduce_op})")
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        return self._reduce_tensor(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.resilience.teardown()
