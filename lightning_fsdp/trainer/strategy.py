"""``FSDPCustomStrategy``: Lightning's hooks, each delegating to the package that owns the concern.

- process group, mesh, collectives, grad norms → :mod:`lightning_fsdp.parallel`
- units, activation checkpointing, ``fully_shard``, meta-device init → :mod:`lightning_fsdp.sharding`
- dtypes, loss scaling, clipping → :mod:`lightning_fsdp.precision`
- sharded/full checkpoints with an atomic commit, pretrained weights → :mod:`lightning_fsdp.checkpoint`
- agreement between ranks on failures, preemption, non-finite steps, uneven data → :mod:`lightning_fsdp.resilience`
- bytes per rank → :mod:`lightning_fsdp.memory`
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp import _lightning_compat as compat
from lightning_fsdp import memory as host_memory
from lightning_fsdp.checkpoint.checkpointer import check_state_dict_type
from lightning_fsdp.fixes import FixWording
from lightning_fsdp.parallel import mesh as mesh_utils
from lightning_fsdp.parallel import process_group
from lightning_fsdp.precision import MixedPrecisionArg
from lightning_fsdp.resilience import collective
from lightning_fsdp.runtime import RuntimeHolder, ShardedRuntime
from lightning_fsdp.sharding import WrapPolicy, parameters_on_meta
from lightning_fsdp.sharding.compile import CompileArg
from lightning_fsdp.trainer import resilience as trainer_resilience
from lightning_fsdp.trainer.averaging import refuse_unsharded_averaging
from lightning_fsdp.trainer.mesh_strategy import MeshStrategy
from lightning_fsdp.trainer.root_steps import RootForwardSteps
from lightning_fsdp.trainer.precision import FSDP2Precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

StateDictType = Literal["sharded", "full"]
#: how errors from below tell a Trainer user what to change
TRAINER_WORDING = FixWording(
    load_matching_keys="set `strict_loading = False` on the LightningModule",
    start_fresh="pass ckpt_path=None",
    clip_gradients="enable gradient clipping (`gradient_clip_val`)",
)


class FSDPCustomStrategy(RuntimeHolder, compat.ModuleAssignmentHook, RootForwardSteps, MeshStrategy):
    """Fully Sharded Data Parallel (FSDP2, ``fully_shard``) for any LightningModule, with no model changes.

    Args:
        auto_wrap_policy: which submodules become FSDP units: ``"auto"`` (the model's repeated blocks), a set of
            module classes or class names, a minimum parameter count, a callable ``fn(module) -> bool``, or
            ``None`` (the root only). See :mod:`lightning_fsdp.sharding.policy`.
        activation_checkpointing_policy: same forms; the selected modules recompute activations in backward.
        mixed_precision: overrides the policy derived from ``Trainer(precision=...)``: a
            ``MixedPrecisionPolicy`` or a dict of its fields (dtypes as strings, for YAML).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep them until
            backward (``False``, ZeRO-2-like: faster, more memory); an int reshards to that smaller group size.
        replicate_size: number of model replicas (HSDP); ``1`` is plain FSDP, ``"auto"`` means one per node.
        shard_size: data-parallel ranks a replica is sharded over; ``"auto"`` = world size / (replicate_size ×
            context_parallel).
        context_parallel: ranks that split each sequence (ring attention; each holds a head and a tail chunk of
            every row, and parameters are sharded over ``shard_size × context_parallel``). ``1``: off.
        process_group_backend: ``"nccl"``/``"gloo"``; default nccl on CUDA, gloo on CPU.
        timeout: collective timeout in seconds (or a ``timedelta``).
        state_dict_type: ``"sharded"`` writes a checkpoint directory, every rank its own shards, in parallel;
            ``"full"`` gathers to rank 0 and writes one ordinary ``.ckpt`` file.
        async_save: write sharded checkpoints in the background while training continues.
        verify_before_load: hash every file of a sharded checkpoint before any state changes (a second read of
            every byte); by default each entry is checked as it is read, once.
        pretrained_weights: loaded into the sharded model right after sharding: a Hugging Face model directory, a
            ``.gguf`` file (converted once into a cached directory) or a ``.safetensors`` file (every rank reads only
            its own shards), or a full ``.ckpt``/``.pt`` state dict (rank
            0 reads, the other ranks receive only their shards). Sharded checkpoints then leave out the frozen
            parameters that came from safetensors and refer to the files instead (LoRA: megabytes per save).
        pretrained_key_map: how model keys map to the pretrained files' keys, as ``{model prefix: file prefix}``;
            by default the layout is detected (the HF model under an attribute, with or without PEFT).
        compile: ``torch.compile`` each FSDP unit's block before sharding (``True``, or a dict of ``torch.compile``
            options such as ``{"fullgraph": True, "mode": "max-autotune"}``; ``"root": True`` compiles the root
            unit too). Parameter names, and so checkpoints, are unchanged.
        quantize_base: ``"nf4"`` holds every frozen ``nn.Linear`` weight inside the FSDP units in 4-bit NormalFloat
            (QLoRA, torchao): quantized as the pretrained weights load, sharded and all-gathered in 4 bits,
            dequantized inside the matmul. Checkpoints leave the quantized base out and re-quantize it on resume.
        skip_nonfinite_steps: if any rank sees a NaN/inf loss or gradient norm, every rank skips that optimizer
            step; after ``max_nonfinite_steps`` consecutive skips training stops with an error.
        max_nonfinite_steps: see ``skip_nonfinite_steps``.
        release_host_memory: hand the host heap's free pages back to the OS (glibc ``malloc_trim``) after an
            optimizer step once RSS has grown 256 MiB past the first step's, and, when most weights are trained, map
            host blocks of 4 MiB or more on their own (``mallopt``), so the heap does not grow. ``None`` (default):
            on when parameters live in CPU memory (a CPU run, or ``cpu_offload``).
        offload_activations: on CUDA, move the activations saved for backward to pinned host memory on a side
            stream during the training step, and back for backward (:class:`~lightning_fsdp.sharding
            .activation_offload.ActivationOffload`; composes with activation checkpointing). Inert on CPU.
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
        replicate_size: mesh_utils.SizeArg = 1,
        shard_size: mesh_utils.SizeArg = "auto",
        context_parallel: int = 1,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        state_dict_type: StateDictType = "sharded",
        async_save: bool = False,
        verify_before_load: bool = False,
        pretrained_weights: Optional[compat.PATH] = None,
        pretrained_key_map: Optional[dict[str, str]] = None,
        compile: CompileArg = False,
        quantize_base: Optional[str] = None,
        skip_nonfinite_steps: bool = False,
        max_nonfinite_steps: int = 10,
        release_host_memory: Optional[bool] = None,
        offload_activations: bool = False,
    ) -> None:
        self.mixed_precision = mixed_precision  # read by the precision_plugin setter during super().__init__
        self.offload_activations = bool(offload_activations)
        self.runtime = ShardedRuntime(process_group.as_timedelta(timeout), skip_nonfinite_steps=skip_nonfinite_steps,
                                      max_nonfinite_steps=max_nonfinite_steps, async_save=bool(async_save),
                                      verify_before_load=bool(verify_before_load), wording=TRAINER_WORDING,
                                      release_host_memory=release_host_memory)
        super().__init__(
            self.runtime,
            replicate_size=replicate_size,
            shard_size=shard_size,
            context_parallel=context_parallel,
            process_group_backend=process_group_backend,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_state_dict_type(state_dict_type, quantize_base)
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = reshard_after_forward
        self.compile = compile
        self.quantize_base = quantize_base
        self.state_dict_type: StateDictType = state_dict_type
        self.async_save = bool(async_save)
        self.verify_before_load = bool(verify_before_load)
        if pretrained_weights is not None:
            from lightning_fsdp.hf.gguf import resolve_model_source

            pretrained_weights = resolve_model_source(pretrained_weights)  # a .gguf file: its converted directory
        self.pretrained_weights = pretrained_weights
        self.pretrained_key_map = dict(pretrained_key_map) if pretrained_key_map else None
        self.skip_nonfinite_steps = bool(skip_nonfinite_steps)
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.model_options()  # invalid policies fail now, before any process starts
        self._forward_redirection = compat.RootForwardRedirection()

    # -- precision -------------------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> FSDP2Precision:
        if self._precision_plugin is None:
            self.precision_plugin = FSDP2Precision("32-true", mixed_precision=self.mixed_precision)
        assert isinstance(self._precision_plugin, FSDP2Precision)  # the setter adopts every plugin
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning hands every strategy its generic plugin for ``precision=``; ours maps it onto FSDP2."""
        adopted = FSDP2Precision.adopt(plugin, self.mixed_precision, owner=type(self).__name__)
        if adopted is not None:
            adopted.grad_norm = self.runtime.grad_norm
        self._precision_plugin = adopted

    # -- model -------------------------------------------------------------------------------------------------------
    @override
    def on_lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        """``fit(torch.compile(model))`` is refused here, before any process starts (on every rank that runs it)."""
        if module is not None and compat.uncompile(module):
            raise TypeError(
                f"{type(self).__name__} got a `torch.compile`d module. FSDP2 shards the plain module's parameters and"
                " the strategy compiles each FSDP unit's block itself, after activation checkpointing and before"
                " sharding. Pass the plain LightningModule and `compile=True` to the strategy, or the torch.compile"
                " options: `FSDPCustomStrategy(compile={'fullgraph': True, 'mode': 'max-autotune'})` (in a config:"
                " `strategy.compile`). The module you passed has its own methods back."
            )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``empty_init=True`` creates parameters on the meta device; sharding then allocates only each rank's shards."""
        with parameters_on_meta() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Parameters created in ``configure_model`` live on the meta device: no rank holds the full model."""
        with parameters_on_meta():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        self.model = self._shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # after sharding: optimizer state is sharded (DTensor) too
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        trainer_resilience.attach(self.resilience, trainer)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        assert self.lightning_module is not None
        model = self.precision_plugin.convert_module(model)
        return self.runtime.prepare(model, self.model_options(), self.precision_plugin.mp_policy, self.root_device,
                                    self.lightning_module.strict_loading, owner=type(self).__name__)

    @override
    def _fsdp_precision(self) -> FSDP2Precision:
        return self.precision_plugin

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        compat.reset_optimizers(self)  # a second fit/validate must not keep stale parameter references
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        """``fully_shard`` already placed every shard; moving the module would undo CPU offload."""

    def state_bytes(self) -> host_memory.StateBytes:
        """This rank's local bytes of parameters, gradients and optimizer state."""
        assert self.model is not None
        return host_memory.local_state_bytes(self.model, [compat.unwrap_optimizer(o) for o in self.optimizers])

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = compat.attached_trainer(self.lightning_module)
        return trainer_resilience.agreed_dataloader(self.resilience, dataloader, trainer, self.root_device)

    @override
    @collective("backward (FSDP gradient reduce-scatter)", gate=False)
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    @collective("optimizer_step (non-finite check, gradient clipping)", gate=False)
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        trainer = compat.attached_trainer(self.lightning_module)
        has_scaler = self.precision_plugin.scaler is not None
        closure = trainer_resilience.guarded_closure(
            self.resilience, closure, compat.unwrap_optimizer(optimizer), trainer, self.root_device, has_scaler
        )
        with self.runtime.grad_norm.step():
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.runtime.host_heap.step_done(self._params_on_host)
        return result

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.model is not None:
            self.runtime.host_heap.training_starts(self.model, self._params_on_host)

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded state loads into the sharded model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores optimizer shards itself

    @override
    @collective("the checkpoint's model state (a collective)")
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.checkpointer.model_state_dict(self.model, full=self.state_dict_type == "full")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        optimizer = compat.unwrap_optimizer(optimizer)
        return self.checkpointer.optimizer_state_dict(self.model, optimizer, full=self.state_dict_type == "full")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Already restored by :meth:`load_checkpoint`."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Already restored by :meth:`load_checkpoint`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: compat.PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        path = Path(self.broadcast(str(filepath)))  # one path for every rank
        self.runtime.save(checkpoint, path, self.lightning_module, self.mesh_shape, full=self.state_dict_type == "full")

    @override
    def load_checkpoint(self, checkpoint_path: compat.PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        optimizers = [compat.unwrap_optimizer(o) for o in self.optimizers]
        return self.runtime.load(path, self.model, optimizers, self.lightning_module.strict_loading,
                                 model_entries=self._model_entries())

    def _model_entries(self) -> tuple[str, ...]:
        """The checkpoint entries keyed like the model that a callback takes (``ShardedEMA``'s average)."""
        trainer = compat.attached_trainer(self.lightning_module)
        callbacks = compat.trainer_callbacks(trainer) if trainer is not None else []
        return tuple(dict.fromkeys(e for cb in callbacks if (e := getattr(cb, "checkpoint_entry", None))))

    @override
    def setup_environment(self) -> None:
        if (trainer := compat.attached_trainer(self.lightning_module)) is not None:  # before any process group:
            refuse_unsharded_averaging(compat.trainer_callbacks(trainer))  # all ranks fail alike
        super().setup_environment()

    @override
    def remove_checkpoint(self, filepath: compat.PATH) -> None:
        self.checkpointer.remove(Path(filepath))

    @override
    def teardown(self) -> None:
        self.runtime.checkpointer.finalize()  # a pending async save commits before the processes go
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_fsdp.registry import register_strategies

        register_strategies(strategy_registry)
