"""``FSDPCustomFabricStrategy``: ``Fabric(strategy="fsdp_custom")`` for hand-written loops.

The Fabric front end over the same lower layers as the Trainer's :class:`~lightning_fsdp.FSDPCustomStrategy`:
the replicate × shard mesh (:mod:`lightning_fsdp.parallel`), model preparation — auto-wrap, activation
checkpointing, compile, meta-device materialisation, pretrained weights read straight into the shards, the NF4 base
(:func:`~lightning_fsdp.preparation.prepare_model`) — sharded clipping, the precision table, and the verified,
atomic, resharding checkpoint directory (:class:`~lightning_fsdp.checkpoint.Checkpointer`). Fabric's state dict is
mapped onto that directory by :mod:`lightning_fsdp.fabric.checkpoint`, so the ``lightning-fsdp`` commands read
Fabric checkpoints as they read the Trainer's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
import atexit
import signal
from typing import Any, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp import _lightning_compat as compat
from lightning_fsdp.fabric.checkpoint import FabricState, restore_entries, to_checkpoint
from lightning_fsdp.fabric.precision import FSDP2FabricPrecision
from lightning_fsdp.fixes import FixWording
from lightning_fsdp.parallel import mesh as mesh_utils
from lightning_fsdp.parallel import process_group
from lightning_fsdp.parallel.grad_norm import clip_grad_norm_
from lightning_fsdp.parallel.placement import MeshPlacement
from lightning_fsdp.parallel.sequence import splitting
from lightning_fsdp.precision import MixedPrecisionArg
from lightning_fsdp.resilience import GuardedCollectives, RelayedLaunch, collective
from lightning_fsdp.resilience.report import on_uncaught
from lightning_fsdp.runtime import RuntimeHolder, ShardedRuntime
from lightning_fsdp.sharding import WrapPolicy, parameters_on_meta
from lightning_fsdp.sharding.compile import CompileArg


#: how errors from below tell a Fabric user what to change
FABRIC_WORDING = FixWording(
    load_matching_keys="pass `strict=False` to `fabric.load` or `fabric.load_raw`",
    start_fresh="do not call `fabric.load`",
    clip_gradients="clip them (`fabric.clip_gradients`)",
)


class _RelayedFabricLauncher(RelayedLaunch, compat.FabricSubprocessScriptLauncher):
    """Fabric's script launcher, with the failure relay watching the ranks it starts (see :class:`RelayedLaunch`)."""


class _NoGradientSync(compat.FabricBackwardSyncControl):
    """``fabric.no_backward_sync``: accumulate locally, no reduce-scatter until the last micro-batch."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> Any:
        return _without_gradient_sync(module) if enabled else nullcontext()


@contextmanager
def _without_gradient_sync(module: Module) -> Generator[None, None, None]:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


class FSDPCustomFabricStrategy(RuntimeHolder, GuardedCollectives, MeshPlacement, ParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2) for Fabric loops: ``Fabric(strategy="fsdp_custom")``.

    Takes the Trainer strategy's model arguments (``auto_wrap_policy``, ``activation_checkpointing_policy``,
    ``mixed_precision``, ``cpu_offload``, ``reshard_after_forward``, ``replicate_size``/``shard_size`` for HSDP,
    ``context_parallel`` (with :meth:`sequence_split` around each step),
    ``pretrained_weights``/``pretrained_key_map``, ``compile``, ``quantize_base``, ``release_host_memory``; see
    :class:`~lightning_fsdp.FSDPCustomStrategy`). Checkpoints are always sharded directories.
    """

    strategy_name = "fsdp_custom"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        auto_wrap_policy: WrapPolicy = "auto",
        activation_checkpointing_policy: WrapPolicy = None,
        mixed_precision: MixedPrecisionArg = None,
        cpu_offload: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        replicate_size: mesh_utils.SizeArg = 1,
        shard_size: mesh_utils.SizeArg = "auto",
        context_parallel: int = 1,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        pretrained_weights: Optional[compat.PATH] = None,
        pretrained_key_map: Optional[dict[str, str]] = None,
        compile: CompileArg = False,
        quantize_base: Optional[str] = None,
        release_host_memory: Optional[bool] = None,
    ) -> None:
        mesh_utils.check_size("replicate_size", replicate_size)
        mesh_utils.check_size("shard_size", shard_size)
        mesh_utils.check_context_parallel(context_parallel)
        process_group.check_backend(process_group_backend)
        self.mixed_precision = mixed_precision  # read by the precision setter during super().__init__
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = reshard_after_forward
        self.replicate_size = replicate_size
        self.shard_size = shard_size
        self.context_parallel = context_parallel
        self.compile = compile
        self.quantize_base = quantize_base
        if pretrained_weights is not None:
            from lightning_fsdp.hf.gguf import resolve_model_source

            pretrained_weights = resolve_model_source(pretrained_weights)  # a .gguf file: its converted directory
        self.pretrained_weights = pretrained_weights
        self.pretrained_key_map = dict(pretrained_key_map) if pretrained_key_map else None
        self.model_options()  # invalid policies fail now, before any process starts
        self.num_nodes = 1
        self.runtime = ShardedRuntime(process_group.as_timedelta(timeout), wording=FABRIC_WORDING,
                                      release_host_memory=release_host_memory)
        #: failures between ranks, as under the Trainer: the relay, preemption signals, named collective timeouts
        self.resilience = self.runtime.resilience
        self._process_group_backend = process_group_backend
        self._mesh_shape: Optional[mesh_utils.MeshShape] = None
        self._device_mesh: Any = None
        self._backward_sync_control = _NoGradientSync()

    # -- precision ---------------------------------------------------------------------------------------------------
    @property
    def precision(self) -> FSDP2FabricPrecision:
        if self._precision is None:
            self._precision = FSDP2FabricPrecision("32-true", mixed_precision=self.mixed_precision)
        return self._precision  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        """Fabric hands unknown strategies its generic plugin for ``precision=``; ours maps it onto FSDP2."""
        self._precision = FSDP2FabricPrecision.adopt(precision, self.mixed_precision, owner=type(self).__name__)

    @override
    def _fsdp_precision(self) -> FSDP2FabricPrecision:
        return self.precision

    # -- processes and mesh --------------------------------------------------------------------------------------------
    def _set_world_ranks(self) -> None:
        """Fabric's connector calls this (the Trainer's calls ``set_world_ranks``) when ``L.Fabric(...)`` is built:
        mesh sizes that do not fit the world fail there, before any process starts."""
        self.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _RelayedFabricLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, self.resilience.relay
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.set_world_ranks()
        backend = self._process_group_backend or process_group.default_backend(self.root_device)
        self._process_group_backend = backend
        self._device_mesh = self.runtime.join(self.cluster_environment, backend, self.root_device, self.mesh_shape)
        on_uncaught(self.resilience.relay.on_exception)  # a Fabric loop's exception ends every rank promptly
        atexit.register(self.resilience.teardown)  # runs before the group is destroyed (registered earlier)
        self.precision.policy.device_type = self.root_device.type
        self.resilience.preemption.install([s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s])

    def stop_requested(self) -> bool:
        """Whether any rank received SIGTERM/SIGUSR1 (a scheduler's preemption notice); every rank gets the same
        answer (one tiny all-reduce). Poll it between steps: ``if fabric.strategy.stop_requested(): fabric.save(...)``."""
        return self.resilience.preemption.agree(self.root_device) != 0

    @contextmanager
    def sequence_split(self, batch: Any) -> Generator[Any, None, None]:
        """Under ``context_parallel``: this rank's part of ``batch`` along the sequence (labels shifted first, as
        ``shift_labels``; ``position_ids`` of the tokens in the whole row), and attention across the group's ranks
        for the forward *and* backward inside the block. Without it: the batch as it is.

        ``with fabric.strategy.sequence_split(batch) as part: ... fabric.backward(...)``"""
        part, split = self.runtime.split_sequence(batch)
        with splitting(split):
            yield part

    # -- model -------------------------------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> Any:
        """``fabric.init_module(empty_init=True)``: parameters on the meta device; ``setup`` allocates only shards."""
        stack = ExitStack()
        stack.enter_context(parameters_on_meta() if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module(self, module: Module) -> Module:
        # Fabric has converted the module's dtype already (`precision.convert_module`, before every setup)
        module = self.runtime.prepare(module, self.model_options(), self.precision.mp_policy, self.root_device,
                                      strict=True, owner=type(self).__name__)
        self.runtime.host_heap.training_starts(module, self._params_on_host)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
        """``fabric.setup(model, optimizer)``: sharding replaces the parameters, so optimizers built on the model
        before (even on the meta device) are pointed at the sharded ones, by parameter name."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        current = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            _repoint(optimizer, names, current)
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: Module) -> None:
        """``fully_shard`` placed every shard already; moving the module would undo CPU offload."""

    # -- steps -------------------------------------------------------------------------------------------------------
    @override
    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The norm over every rank's gradient shards (one all-reduce), as one process would compute it."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = clip_grad_norm_(params, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite ({total.item()}), so it"
                " cannot be clipped. Pass error_if_nonfinite=False to clip anyway."
            )
        return total

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, **kwargs)
        self.runtime.host_heap.step_done(self._params_on_host)
        return result

    # -- collectives -------------------------------------------------------------------------------------------------
    @override
    @collective("all_reduce", gate=False)
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        return self._reduce_tensor(tensor, group, reduce_op)

    @override
    @collective("all_gather", gate=False)
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self._gather_tensors(tensor, group, sync_grads)

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, path: compat.PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save(path, {"model": m, "optimizer": o, ...})``: a verified, atomic checkpoint directory."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither `storage_options` nor `filter`.")
        path = Path(self.broadcast(str(path)))
        fabric_state = FabricState.of(state, "fabric.save")
        model = fabric_state.model
        checkpoint = to_checkpoint(
            fabric_state, self.checkpointer.model_state_dict(model, full=False),
            [self.checkpointer.optimizer_state_dict(model, o, full=False) for o in fabric_state.optimizers.values()],
        )
        self.runtime.save(checkpoint, path, model, self.mesh_shape)

    @override
    def load_checkpoint(
        self, path: compat.PATH, state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None, strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: verified, resharded to this world size; returns what ``state`` did not ask
        for. ``fabric.load_raw(path, model)``: a full state-dict file, a safetensors file or HF directory, or one of
        our checkpoint directories, into the sharded model."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, Module):
            self.runtime.load_raw(path, state, strict, self.pretrained_key_map)
            return {}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs the objects to restore: fabric.load(path,"
                ' {"model": model, "optimizer": optimizer, ...}) (a sharded checkpoint cannot be returned whole).'
            )
        fabric_state = FabricState.of(state, "fabric.load")
        model = fabric_state.model
        optimizers = list(fabric_state.optimizers.values())
        rest = self.runtime.load(path, model, optimizers, strict)
        return restore_entries(fabric_state, state, rest, path, strict)

    @override
    def teardown(self) -> None:
        self.runtime.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_fsdp.registry import register_fabric_strategies

        register_fabric_strategies(strategy_registry)


def _repoint(optimizer: Optimizer, names: Mapping[int, str], current: Mapping[str, Tensor]) -> None:
    """Replace each parameter an optimizer holds by the sharded parameter of the same name."""
    if optimizer.state:
        raise RuntimeError(
            "The optimizer already has state; set it up before its first step, or create it after"
            " `fabric.setup_module(model)` and pass it to `fabric.setup_optimizers(optimizer)`."
        )
    for group in optimizer.param_groups:
        replaced = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                raise ValueError(
                    "The optimizer holds a parameter that is not the model's; build it from model.parameters()."
                )
            replaced.append(current[name])
        group["params"] = replaced
