"""``ShardedRuntime``: the work both front ends share beneath their hooks, held in one object.

The Trainer's :class:`~lightning_fsdp.FSDPCustomStrategy` and Fabric's :class:`~lightning_fsdp.FSDPCustomFabricStrategy`
only translate their framework's hooks; each holds one runtime and delegates to it:

- joining the process group and building the replicate × shard mesh, with the failure relay watching
  (:meth:`ShardedRuntime.join`);
- preparing the model — auto-wrap, activation checkpointing, compile, ``fully_shard``, materialisation, the pretrained
  base, the NF4 base — and remembering what that did (:meth:`ShardedRuntime.prepare`);
- the step's one gradient norm, the failure handling (:class:`~lightning_fsdp.resilience.Resilience`), and the
  checkpointer with the pretrained base resolved on load (:meth:`ShardedRuntime.save`, :meth:`ShardedRuntime.load`).

It knows neither the Trainer nor Fabric: values and callables come in, structured errors go out.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_fsdp import _lightning_compat as compat
from lightning_fsdp.checkpoint.base_weights import BaseReference
from lightning_fsdp.checkpoint.checkpointer import Checkpointer
from lightning_fsdp.fixes import FixWording, worded_for
from lightning_fsdp.hf import resolve_base
from lightning_fsdp.hf.info import annotate_checkpoint
from lightning_fsdp.hf.ring_attention import use_ring_attention
from lightning_fsdp.host_heap import HostHeapPolicy
from lightning_fsdp.parallel import mesh as mesh_utils
from lightning_fsdp.parallel import process_group
from lightning_fsdp.parallel.grad_norm import StepGradNorm
from lightning_fsdp.parallel.sequence import SequenceLayout, SequenceSplit, split_batch
from lightning_fsdp.preparation import Preparation, Prepared, prepare_model
from lightning_fsdp.resilience import Resilience
from lightning_fsdp.sharding import ShardingPlan, WrapPolicy
from lightning_fsdp.sharding.compile import CompileArg
from lightning_fsdp.sharding.materialize import parameters_on_meta
from lightning_fsdp.sharding.quantize import QuantizedBase

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True)
class ModelOptions:
    """How the model is sharded and loaded: the constructor arguments both front ends take, checked when built."""

    auto_wrap_policy: WrapPolicy = "auto"
    activation_checkpointing_policy: WrapPolicy = None
    cpu_offload: bool = False
    reshard_after_forward: Union[bool, int] = True
    compile: CompileArg = False
    quantize_base: Optional[str] = None
    pretrained_weights: Optional[Union[str, Path]] = None
    pretrained_key_map: Optional[Mapping[str, str]] = None

    def __post_init__(self) -> None:
        self.plan()  # invalid policies fail here, before any process starts

    def plan(self, mp_policy: Optional[MixedPrecisionPolicy] = None, on_device: bool = False) -> ShardingPlan:
        """The sharding plan; ``on_device``: pinned host memory for offload (it exists only with an accelerator)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        offload = CPUOffloadPolicy(pin_memory=on_device) if self.cpu_offload else OffloadPolicy()
        return ShardingPlan(
            wrap_policy=self.auto_wrap_policy,
            activation_checkpointing=self.activation_checkpointing_policy,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            offload_policy=offload,
            reshard_after_forward=self.reshard_after_forward,
            compile=self.compile,
            quantize_base=self.quantize_base,
        )


class ShardedRuntime:
    """One front end's sharded-training state (see the module docstring)."""

    def __init__(
        self,
        timeout: timedelta,
        *,
        skip_nonfinite_steps: bool = False,
        max_nonfinite_steps: int = 10,
        async_save: bool = False,
        verify_before_load: bool = False,
        wording: FixWording = FixWording(),
        release_host_memory: Optional[bool] = None,
    ) -> None:
        #: how the front end's users are told what to change (its settings' names), in every error from below
        self.wording = wording
        #: one norm per step, shared by clipping and the non-finite check
        self.grad_norm = StepGradNorm()
        self.resilience = Resilience(
            timeout, bool(skip_nonfinite_steps), int(max_nonfinite_steps), self.grad_norm, wording
        )
        self.checkpointer = Checkpointer(async_save=async_save, verify_before_load=verify_before_load)
        self.device_mesh: Optional[DeviceMesh] = None
        self.mesh_shape: Optional[mesh_utils.MeshShape] = None
        #: this rank's context-parallel group (``None`` without context parallelism)
        self.context_mesh: Optional[DeviceMesh] = None
        #: what the last :meth:`prepare` did: FSDP units, the safetensors base it loaded, the weights held in NF4
        self.prepared = Prepared()
        #: the host heap handed back after a step once it grew, large blocks mapped on their own
        self.host_heap = HostHeapPolicy(release_host_memory)

    # -- processes -----------------------------------------------------------------------------------------------------
    def join(
        self,
        cluster_environment: ClusterEnvironment,
        backend: str,
        root_device: torch.device,
        mesh_shape: mesh_utils.MeshShape,
    ) -> DeviceMesh:
        """Join the process group (the long rendezvous timeout; ``timeout`` applies to every group once all ranks
        have joined), build the mesh, and start watching for failures."""
        compat.init_dist_connection(
            cluster_environment,
            backend,
            timeout=self.resilience.rendezvous_timeout,
            device_id=root_device if root_device.type == "cuda" else None,
        )
        # gloo's worker threads must be released while the interpreter is alive; not while a failure is handled
        # (peers may still block in the group: the relay ends them). A weak reference: the hook must not keep the
        # model and its groups alive until exit.
        runtime = weakref.ref(self)
        process_group.destroy_process_group_at_exit(
            keep_if=lambda: hasattr(sys, "last_value") or ((r := runtime()) is not None and r.resilience.failing)
        )
        self.mesh_shape = mesh_shape
        self.device_mesh = mesh_utils.build_device_mesh(mesh_shape, root_device.type)
        self.context_mesh = mesh_utils.context_group(mesh_shape, root_device.type)
        self.resilience.start(self.device_mesh)
        return self.device_mesh

    def split_sequence(self, batch: Any) -> tuple[Any, Optional[SequenceSplit]]:
        """This rank's part of ``batch`` along the sequence and the split its attention needs, under context
        parallelism; ``(batch, None)`` otherwise."""
        if self.context_mesh is None:
            return batch, None
        layout = SequenceLayout(self.context_mesh.size(), self.context_mesh.get_local_rank())
        return split_batch(batch, layout, self.context_mesh.get_group())

    # -- the model -----------------------------------------------------------------------------------------------------
    def prepare(
        self,
        module: nn.Module,
        options: ModelOptions,
        mp_policy: MixedPrecisionPolicy,
        root_device: torch.device,
        strict: bool,
        owner: str,
    ) -> nn.Module:
        """Shard ``module`` in place (see :func:`~lightning_fsdp.preparation.prepare_model`); ``owner`` names the
        front end in the one-line summary."""
        assert self.device_mesh is not None, "join() the process group before preparing a model"
        plan = options.plan(mp_policy, on_device=root_device.type == "cuda")
        device = torch.device("cpu") if options.cpu_offload else root_device
        preparation = Preparation(plan, device, options.pretrained_weights, strict, options.pretrained_key_map)
        if self.context_mesh is not None:
            use_ring_attention(module)  # a Hugging Face model's attention attends across the context-parallel ranks
        with worded_for(self.wording):
            prepared = prepare_model(module, self.device_mesh, preparation)
        if prepared.units:
            self.prepared = prepared
        rank_zero_info(f"{owner}: {len(self.prepared.units)} FSDP units on mesh {self.mesh_shape}")
        return module

    def prepare_frozen(
        self,
        module: nn.Module,
        options: ModelOptions,
        mp_policy: MixedPrecisionPolicy,
        root_device: torch.device,
        pretrained_weights: Union[str, Path],
    ) -> nn.Module:
        """Shard a frozen model that runs beside the trained one (DPO's reference, a distillation teacher) as the
        model is sharded: the same mesh, units, precision and offload, its weights read straight into each rank's
        shards, so each rank holds 1/N of it. Nothing is recorded: checkpoints neither store nor refer to it."""
        assert self.device_mesh is not None, "join() the process group before preparing a model"
        module.requires_grad_(False)
        frozen = replace(options, activation_checkpointing_policy=None, compile=False, quantize_base=None,
                         pretrained_weights=pretrained_weights, pretrained_key_map=None)
        plan = frozen.plan(mp_policy, on_device=root_device.type == "cuda")
        device = torch.device("cpu") if options.cpu_offload else root_device
        with worded_for(self.wording):
            prepare_model(module, self.device_mesh, Preparation(plan, device, pretrained_weights, True, None))
        return module

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def save(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        model: Optional[nn.Module],
        mesh_shape: Optional[mesh_utils.MeshShape],
        full: bool = False,
    ) -> None:
        """Describe the HF model, leave out the frozen base (recording where it comes from), then save."""
        annotate_checkpoint(checkpoint, model, self.prepared.base, not full, self.prepared.quantized)
        with worded_for(self.wording):
            self.checkpointer.save(checkpoint, path, mesh_shape=mesh_shape, full=full)

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        strict: bool,
        model_entries: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Load into the sharded ``model`` and ``optimizers``, reading the frozen base from the files the
        checkpoint names when this run did not load them; returns the rest of the checkpoint."""
        with worded_for(self.wording):
            return self.checkpointer.load(
                path,
                model=model,
                optimizers=optimizers,
                strict=strict,
                resolve_base=lambda reference: resolve_base(model, reference, self.prepared.base),
                model_entries=model_entries,
            )

    def load_raw(self, path: Path, module: nn.Module, strict: bool, key_map: Optional[Mapping[str, str]]) -> None:
        """Weights only, into the sharded ``module``: one of our checkpoint directories, a safetensors file or HF
        directory (each rank reads its rows), or a full state-dict file."""
        from lightning_fsdp.checkpoint import load_pretrained
        from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME
        from lightning_fsdp.hf.load import is_safetensors_source, load_safetensors

        with worded_for(self.wording):
            if path.is_dir() and (path / MANIFEST_NAME).exists():
                self.checkpointer.load(path, model=module, optimizers=(), strict=strict)
            elif is_safetensors_source(path):
                load_safetensors(module, path, strict=strict, key_map=key_map)
            else:
                load_pretrained(module, path, strict=strict)

    def teardown(self) -> None:
        self.checkpointer.finalize()
        self.resilience.teardown()


class RuntimeHolder:
    """What both front ends expose over their runtime (users, examples and tests read these off the strategy), and
    their shared model arguments as one :class:`ModelOptions`."""

    runtime: ShardedRuntime
    auto_wrap_policy: WrapPolicy
    activation_checkpointing_policy: WrapPolicy
    cpu_offload: bool
    reshard_after_forward: Union[bool, int]
    compile: CompileArg
    quantize_base: Optional[str]
    pretrained_weights: Optional[Union[str, Path]]
    pretrained_key_map: Optional[dict[str, str]]

    def model_options(self) -> ModelOptions:
        return ModelOptions(
            self.auto_wrap_policy, self.activation_checkpointing_policy, self.cpu_offload, self.reshard_after_forward,
            self.compile, self.quantize_base, self.pretrained_weights, self.pretrained_key_map,
        )

    @property
    def wrapped_units(self) -> list[str]:
        """The FSDP units setup created (module names), in the order they were sharded."""
        return self.runtime.prepared.units

    @property
    def pretrained_base(self) -> Optional[BaseReference]:
        """The safetensors base setup loaded, if any: sharded checkpoints refer to it instead of storing it."""
        return self.runtime.prepared.base

    @property
    def quantized_base(self) -> Optional[QuantizedBase]:
        """The frozen weights setup holds in NF4, if any."""
        return self.runtime.prepared.quantized

    @property
    def checkpointer(self) -> Checkpointer:
        return self.runtime.checkpointer

    @property
    def release_host_memory(self) -> Optional[bool]:
        """The ``release_host_memory`` argument as given (``None``: on where parameters live in host memory)."""
        return self.runtime.host_heap.requested

    @property
    def releases_host_memory(self) -> bool:
        """Whether each optimizer step ends by returning the host heap's free pages (``release_host_memory``)."""
        return self.runtime.host_heap.applies(self._params_on_host)

    @property
    def _params_on_host(self) -> bool:
        return self.cpu_offload or self.root_device.type == "cpu"  # type: ignore[attr-defined]

    def _fsdp_precision(self) -> Any:
        """The front end's FSDP2 precision plugin (``convert_module``, ``mp_policy``)."""
        raise NotImplementedError

    def prepare_frozen_model(self, build: Callable[[], nn.Module], pretrained_weights: Union[str, Path]) -> nn.Module:
        """A frozen model beside the trained one (a DPO or GRPO reference): ``build()`` runs on the meta device, and
        the module is sharded like the trained one, 1/N per rank, loaded from ``pretrained_weights`` straight into
        each rank's shards (every rank calls this, after setup)."""
        with parameters_on_meta():
            module = build()
        precision = self._fsdp_precision()
        module = precision.convert_module(module)
        return self.runtime.prepare_frozen(module, self.model_options(), precision.mp_policy, self.root_device,  # type: ignore[attr-defined]
                                           pretrained_weights)
