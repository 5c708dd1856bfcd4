"""``FSDPCustomStrategy``: Lightning's hooks, each delegating to one module per concern.

- process group and mesh → :mod:`lightning_fsdp.distributed`
- which modules become units, activation checkpointing, ``fully_shard`` → :mod:`lightning_fsdp.wrapping`
- dtypes, loss scaling, clipping over sharded gradients → :mod:`lightning_fsdp.precision`
- sharded/full checkpoints with an atomic commit → :mod:`lightning_fsdp.checkpoint`
- bytes per rank → :mod:`lightning_fsdp.memory`
- agreement between ranks on failures, preemption and non-finite steps → :mod:`lightning_fsdp.resilience`
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast, _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp import distributed as dist_utils
from lightning_fsdp.memory import StateBytes, local_state_bytes
from lightning_fsdp.precision import FSDP2Precision, MixedPrecisionArg
from lightning_fsdp.wrapping import (
    WrapPolicy,
    apply_activation_checkpointing,
    keep_root_gathered_after_nested_forward,
    materialize_meta_module,
    resolve_policy,
    shard_model,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

StateDictType = Literal["sharded", "full"]


class FSDPCustomStrategy(ParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2, ``fully_shard``) for any LightningModule, with no model changes.

    Args:
        auto_wrap_policy: which submodules become FSDP units: ``"auto"`` (the model's repeated blocks), a set of
            module classes or class names, a minimum parameter count, a callable ``fn(module) -> bool``, or
            ``None`` (the root only). See :mod:`lightning_fsdp.wrapping`.
        activation_checkpointing_policy: same forms; the selected modules recompute activations in backward.
        mixed_precision: overrides the policy derived from ``Trainer(precision=...)``: a
            ``MixedPrecisionPolicy`` or a dict of its fields (dtypes as strings, for YAML).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep them until
            backward (``False``, ZeRO-2-like: faster, more memory); an int reshards to that smaller group size.
        replicate_size: number of model replicas (HSDP); ``1`` is plain FSDP, ``"auto"`` means one per node.
        shard_size: ranks a replica is sharded over; ``"auto"`` = world size / replicate_size.
        process_group_backend: ``"nccl"``/``"gloo"``; default nccl on CUDA, gloo on CPU.
        timeout: collective timeout in seconds (or a ``timedelta``).
        state_dict_type: ``"sharded"`` writes a checkpoint directory, every rank its own shards, in parallel;
            ``"full"`` gathers to rank 0 and writes one ordinary ``.ckpt`` file.
        async_save: write sharded checkpoints in the background while training continues.
        pretrained_weights: a full ``.ckpt``/``.pt`` state dict or ``.safetensors`` file loaded into the sharded
            model right after sharding (rank 0 reads, the other ranks receive only their shards).
        skip_nonfinite_steps: if any rank sees a NaN/inf loss or gradient norm, every rank skips that optimizer
            step; after ``max_nonfinite_steps`` consecutive skips training stops with an error.
        max_nonfinite_steps: see ``skip_nonfinite_steps``.
    """

    strategy_name = "fsdp_custom"

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        auto_wrap_policy: WrapPolicy = "auto",
        activation_checkpointing_policy: WrapPolicy = None,
        mixed_precision: MixedPrecisionArg = None,
        cpu_offload: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        replicate_size: dist_utils.SizeArg = 1,
        shard_size: dist_utils.SizeArg = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        state_dict_type: StateDictType = "sharded",
        async_save: bool = False,
        pretrained_weights: Optional[_PATH] = None,
        skip_nonfinite_steps: bool = False,
        max_nonfinite_steps: int = 10,
    ) -> None:
        self.mixed_precision = mixed_precision  # read by the precision_plugin setter during super().__init__
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._forward_redirection = _RootForwardRedirection()
        _validate_policy_form(auto_wrap_policy, "auto_wrap_policy")
        _validate_policy_form(activation_checkpointing_policy, "activation_checkpointing_policy")
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {state_dict_type!r}.")
        if process_group_backend not in (None, "nccl", "gloo", "mpi", "cpu:gloo,cuda:nccl"):
            raise ValueError(f"`process_group_backend={process_group_backend!r}`: use 'nccl', 'gloo' or None.")
        if not isinstance(reshard_after_forward, (bool, int)):
            raise TypeError(f"`reshard_after_forward` must be a bool or an int, got {reshard_after_forward!r}.")
        if max_nonfinite_steps < 1:
            raise ValueError(f"`max_nonfinite_steps` must be >= 1, got {max_nonfinite_steps}.")
        dist_utils._check_size("replicate_size", replicate_size)
        dist_utils._check_size("shard_size", shard_size)
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = reshard_after_forward
        self.replicate_size = replicate_size
        self.shard_size = shard_size
        self.state_dict_type: StateDictType = state_dict_type
        self.async_save = bool(async_save)
        self.pretrained_weights = pretrained_weights
        self.skip_nonfinite_steps = bool(skip_nonfinite_steps)
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self._process_group_backend = process_group_backend
        self._timeout = dist_utils.as_timedelta(timeout)
        self._mesh_shape: Optional[dist_utils.MeshShape] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._checkpointer: Any = None
        self.wrapped_units: list[str] = []
        self.num_nodes = 1

    # -- sizes, ranks, mesh ------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to inject a ``DistributedSampler`` (it only knows its own strategy classes)."""
        return True

    @property
    def mesh_shape(self) -> dist_utils.MeshShape:
        if self._mesh_shape is None:
            self._mesh_shape = dist_utils.resolve_mesh_shape(
                self.replicate_size, self.shard_size, self.num_nodes * self.num_processes, self.num_nodes
            )
        return self._mesh_shape

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh is only available after the process group is set up.")
        return self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every data-parallel rank (replicas × shards) reads different data."""
        if self._device_mesh is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": self.mesh_shape.world_size, "rank": dist_utils.data_parallel_rank(self._device_mesh)}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Called by the Trainer before any process starts: the mesh sizes are validated here, early."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.parallel_devices:
            self._mesh_shape = None
            _ = self.mesh_shape

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning's script launcher (spawns nothing under torchrun/SLURM) + failure relay: see resilience.py
        self._launcher = self.resilience.make_launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or dist_utils.default_backend(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type == "cuda" else None
        _init_dist_connection(  # `timeout` applies to every group once all ranks have joined (resilience.start)
            self.cluster_environment,
            self._process_group_backend,
            timeout=self.resilience.rendezvous_timeout,
            device_id=device_id,
        )
        strategy = weakref.ref(self)  # the hook must not keep the model (and its process groups) alive until exit
        dist_utils.destroy_process_group_at_exit(keep_if=lambda: (s := strategy()) is not None and s.resilience.failing)
        self._device_mesh = dist_utils.build_device_mesh(self.mesh_shape, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # `configure_model` may use it
        self.resilience.start(self._device_mesh)

    # -- precision -------------------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:  # type: ignore[override]
        if self._precision_plugin is None:
            self._precision_plugin = FSDP2Precision("32-true", mixed_precision=self.mixed_precision)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning hands every strategy its generic plugin for ``precision=``; ours maps it onto FSDP2."""
        if plugin is None or isinstance(plugin, FSDP2Precision):
            self._precision_plugin = plugin
            return
        if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"):
            raise TypeError(
                f"{type(self).__name__} does not support the precision plugin {type(plugin).__name__}."
                " Use Trainer(precision=...) with one of '32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'."
            )
        precision = getattr(plugin, "precision", "32-true")
        self._precision_plugin = FSDP2Precision(precision, mixed_precision=self.mixed_precision)

    # -- model -------------------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device; sharding then allocates only each rank's shards."""
        device = torch.device("meta") if empty_init else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules built in ``configure_model`` are created on the meta device: no rank holds the full model."""
        with torch.device("meta"):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if isinstance(self.precision_plugin, FSDP2Precision):
            self.precision_plugin.device_type = self.root_device.type
        self.model = self._shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # after sharding: optimizer state is sharded (DTensor) too
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.resilience.attach(trainer)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

        if isinstance(model, FSDPModule):
            return model
        model = self.precision_plugin.convert_module(model)
        precision = self.precision_plugin
        mp_policy = precision.mp_policy if isinstance(precision, FSDP2Precision) else None
        apply_activation_checkpointing(model, self.activation_checkpointing_policy)
        self.wrapped_units = shard_model(
            model,
            self.device_mesh,
            self.auto_wrap_policy,
            mp_policy=mp_policy,
            # pinned host memory speeds host↔device copies, and only exists with an accelerator
            offload_policy=CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy(),
            reshard_after_forward=self.reshard_after_forward,
        )
        materialize_meta_module(model, torch.device("cpu") if self.cpu_offload else self.root_device, self.device_mesh)
        if self.pretrained_weights is not None:
            from lightning_fsdp.checkpoint import load_pretrained

            load_pretrained(model, self.pretrained_weights, strict=self.lightning_module.strict_loading)
        rank_zero_info(f"{type(self).__name__}: {len(self.wrapped_units)} FSDP units on mesh {self.mesh_shape}")
        return model

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # a second fit/validate must not keep stale parameter references
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        """``fully_shard`` already placed every shard; moving the module would undo CPU offload."""

    def state_bytes(self) -> StateBytes:
        """This rank's local bytes of parameters, gradients and optimizer state."""
        assert self.model is not None
        return local_state_bytes(self.model, [_unwrap(o) for o in self.optimizers])

    # -- steps ---------------------------------------------------------------------------------------------------------
    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``LightningModule.<method>`` through the root's ``__call__`` so FSDP2's root hooks fire.

        The root's forward pre-hook gathers its own parameters (embeddings, heads) and casts inputs; Lightning
        would otherwise call ``training_step`` directly and bypass it.
        """
        assert self.lightning_module is not None
        with self.resilience.named(f"{method} (FSDP parameter all-gathers in forward, or a collective in the step)"):
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally: no reduce-scatter until the last micro-batch (FSDP2 has no ``no_sync``)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # -- failures, preemption, non-finite steps, uneven data: see lightning_fsdp/resilience.py ------------------------
    @property
    def resilience(self) -> Any:
        if getattr(self, "_resilience", None) is None:
            from lightning_fsdp.resilience import Resilience

            self._resilience = Resilience(self._timeout, self.skip_nonfinite_steps, self.max_nonfinite_steps)
        return self._resilience

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        return self.resilience.process_dataloader(dataloader, trainer, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        with self.resilience.named("backward (FSDP gradient reduce-scatter)"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        has_scaler = getattr(self.precision_plugin, "scaler", None) is not None
        closure = self.resilience.wrap_closure(closure, _unwrap(optimizer), trainer, has_scaler)
        with self.resilience.named("optimizer_step (non-finite check, gradient clipping)"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self.resilience.gate("all_gather")
        with self.resilience.named("all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # -- collectives ---------------------------------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        self.resilience.gate(f"barrier({name!r})")
        with self.resilience.named(f"barrier({name!r})"):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        self.resilience.gate("broadcast")
        with self.resilience.named(f"broadcast (from rank {src})"):
            torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            self.resilience.gate("reduce")
            with self.resilience.named(f"all_reduce ({reduce_op})"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded state loads into the sharded model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores optimizer shards itself

    @property
    def checkpointer(self) -> Any:
        if self._checkpointer is None:
            from lightning_fsdp.checkpoint import Checkpointer

            self._checkpointer = Checkpointer(async_save=self.async_save)
        return self._checkpointer

    def _state_dict_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        full = self.state_dict_type == "full"
        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        self.resilience.gate("the checkpoint's model state (a collective)")
        return get_model_state_dict(self.model, options=self._state_dict_options())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        return get_optimizer_state_dict(self.model, _unwrap(optimizer), options=self._state_dict_options())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Already restored by :meth:`load_checkpoint`."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Already restored by :meth:`load_checkpoint`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        path = Path(self.broadcast(str(filepath)))  # one path for every rank
        if self.state_dict_type == "sharded":
            self.checkpointer.save_sharded(checkpoint, path, mesh_shape=self.mesh_shape)
        else:
            self.checkpointer.save_full(checkpoint, path, mesh_shape=self.mesh_shape)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        return self.checkpointer.load(
            path,
            model=self.model,
            optimizers=[_unwrap(o) for o in self.optimizers],
            strict=self.lightning_module.strict_loading,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.checkpointer.remove(Path(filepath))

    @override
    def teardown(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.finalize()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.resilience.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_fsdp.registry import register_strategies

        register_strategies(strategy_registry)


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _validate_policy_form(policy: WrapPolicy, arg_name: str) -> None:
    """Reject malformed policies in the constructor, before any process starts (the model is not known yet)."""
    if isinstance(policy, str) and policy != "auto":
        resolve_policy(policy, torch.nn.Module(), arg_name=arg_name)
    if isinstance(policy, bool) and policy:
        resolve_policy(policy, torch.nn.Module(), arg_name=arg_name)
    if isinstance(policy, int) and not isinstance(policy, bool) and policy < 1:
        resolve_policy(policy, torch.nn.Module(), arg_name=arg_name)


class _RootForwardRedirection(_ForwardRedirection):
    """Lightning's step redirection through the root's ``__call__``, without the second all-gather of the root's
    parameters that a ``self(x)`` inside the step would otherwise cost (see ``keep_root_gathered_after_nested_forward``)."""

    @override
    def on_after_inner_forward(self, wrapper_module: torch.nn.Module, original_module: pl.LightningModule) -> None:
        keep_root_gathered_after_nested_forward(wrapper_module)
