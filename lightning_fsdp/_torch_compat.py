"""Every private torch internal the package relies on (and transformers' few), in one module, checked against the
versions it was written for. Lightning's internals live beside it, in ``_lightning_compat.py``.

Outside these two modules the package uses public names only (a test greps for it). Each internal is one of:

- a **fast path**: an optimisation. If a torch upgrade moves it, behaviour stays correct but something
  is lost; :func:`warn_lost` says so once, loudly, naming what is lost and the tested versions. :func:`fast_paths`
  reports which fast paths work on the installed versions (a test asserts all of them on the pinned torch).
- a **requirement**: a feature cannot work without it; using the feature raises an ``ImportError`` that names the
  internal and the versions this package was tested with.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import Store

#: the version every internal below was checked against
TESTED_TORCH = "2.13"

__all__ = [
    "compile_errors", "compiled_graph_count", "composable_checkpoint", "dcp_metadata_path", "dcp_set_element",
    "dcp_unpickle_allowlist", "default_store", "fast_paths", "FastPathLost", "foreach_copy_", "foreach_lerp_",
    "foreach_mul_", "fsdp_default_comms", "has_forward_hooks", "hf_init_weights", "hf_storage_info", "intercept_dispatch",
    "keep_root_gathered", "load_in_place", "private_reset_parameters", "reset_sharded_params",
    "spectral_norm_vectors", "storage_holders", "swaps_on_conversion", "use_file_system", "warn_lost",
]


class FastPathLost(RuntimeWarning):
    """An internal this package optimises with is not where the tested torch had it."""


_WARNED: set[str] = set()


def warn_lost(name: str, what_is_lost: str, detail: str = "") -> None:
    """Warn once per process that the fast path ``name`` is unavailable, and what that costs."""
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(
        f"lightning_fsdp: the fast path {name!r} is unavailable with torch {torch.__version__} (written for torch"
        f" {TESTED_TORCH}): {what_is_lost}."
        f" Training stays correct.{' ' + detail if detail else ''} Please report it with these versions.",
        FastPathLost,
        stacklevel=3,
    )


def _requirement(name: str, feature: str, error: BaseException) -> ImportError:
    return ImportError(
        f"{feature} needs {name}, which torch {torch.__version__} does not provide in the form this package was"
        f" written for (torch {TESTED_TORCH}): {type(error).__name__}: {error}. Pin torch=={TESTED_TORCH}.* or report"
        " it with your versions."
    )


# -- FSDP2: keep the root gathered across a nested root forward ----------------------------------------------------
_ROOT_GATHER_LOST = (
    "the root module's parameters (embeddings, head) are all-gathered a second time in every backward when"
    " `training_step` calls `self(...)`"
)


def _fsdp_training_state() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return TrainingState


def keep_root_gathered(root: nn.Module) -> bool:
    """After a nested ``root(...)`` call returned inside the root's own forward, mark the root's still-gathered
    parameter groups as being in forward again, so the outer post-forward honours ``reshard_after_forward=False``
    instead of resharding an idle group. Returns whether it could (``False`` warns once).
    """
    try:
        state_cls = _fsdp_training_state()
        state = root._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.10: at most one group per module
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            if group._training_state == state_cls.IDLE and group.is_unsharded and not group._reshard_after_forward:
                group._training_state = state_cls.FORWARD
    except (ImportError, AttributeError) as err:
        warn_lost("root_gather", _ROOT_GATHER_LOST, f"({type(err).__name__}: {err})")
        return False
    return True


def _probe_root_gather() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        state_cls = _fsdp_training_state()
        init_source = inspect.getsource(FSDPParamGroup.__init__)
        return (
            hasattr(state_cls, "IDLE")
            and hasattr(state_cls, "FORWARD")
            and isinstance(inspect.getattr_static(FSDPParamGroup, "is_unsharded", None), property)
            and "self._training_state" in init_source
            and "self._reshard_after_forward" in init_source
            and "_fsdp_param_groups" in inspect.getsource(FSDPState.__init__)
            and callable(getattr(torch.distributed.fsdp.FSDPModule, "_get_fsdp_state", None))
        )
    except (ImportError, AttributeError, OSError, TypeError):
        return False


# -- activation checkpointing -----------------------------------------------------------------------------------------
def composable_checkpoint(module: nn.Module) -> None:
    """``torch.distributed._composable.checkpoint``: activation checkpointing that keeps parameter names."""
    try:
        from torch.distributed._composable import checkpoint
    except ImportError as err:
        raise _requirement("torch.distributed._composable.checkpoint", "activation_checkpointing_policy", err) from err
    checkpoint(module)


# -- c10d: the rendezvous store ----------------------------------------------------------------------------------------
def default_store() -> Optional[Store]:
    """The default process group's store (the rendezvous TCPStore every rank is connected to), or ``None``."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError) as err:
        warn_lost(
            "failure_relay",
            "a failing rank cannot tell the others at once; they wait until the collective timeout",
            f"({type(err).__name__}: {err})",
        )
        return None


def _probe_default_store() -> bool:
    import torch.distributed as dist

    return callable(getattr(dist.distributed_c10d, "_get_default_store", None))


# -- distributed checkpoint (DCP) -------------------------------------------------------------------------------------
def dcp_unpickle_allowlist() -> dict[tuple[str, str], Any]:
    """The globals DCP's ``.metadata`` pickle is made of, keyed ``(module, name)``."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    return allowed


def load_in_place(storage: torch.UntypedStorage, file: Any) -> Any:
    """``torch.load(weights_only=True)`` of the archive ``file`` reads, whose bytes ``storage`` holds from offset 0:
    tensors view ``storage``, as ``torch.load(mmap=True)`` views a file, instead of being copied out of it."""
    import torch.serialization as ser

    if not fast_paths()["in_place_load"]:
        warn_lost("in_place_load", "every checkpoint entry is copied once more while it loads")
        return torch.load(file, map_location="cpu", weights_only=True)
    with ser._open_zipfile_reader(file) as zip_file:
        return ser._load(zip_file, "cpu", ser._weights_only_unpickler, overall_storage=storage, encoding="utf-8")


def dcp_metadata_path(reader: Any, rank: Optional[int] = None) -> Any:
    """Where a ``FileSystemReader`` keeps ``.metadata``."""
    return reader._get_metadata_path(rank)


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` of a nested state dict, as DCP's default planner does for byte entries."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def hf_storage_info(path: str, shape: Sequence[int], dtype: torch.dtype) -> Any:
    """DCP's record of where one tensor of a safetensors file is, as ``HuggingFaceStorageReader`` reads it."""
    try:
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    except ImportError as err:
        raise _requirement("torch.distributed.checkpoint._hf_utils._HFStorageInfo", "sharded safetensors loading", err) from err
    return _HFStorageInfo(relative_path=path, shape=torch.Size(shape), dtype=dtype)


def use_file_system(writer: Any, file_system: Any) -> None:
    """Make a ``FileSystemWriter`` write through ``file_system`` (e.g. one that hashes what it writes)."""
    if not hasattr(writer, "fs"):
        raise _requirement("FileSystemWriter.fs", "sharded checkpoints", AttributeError("no attribute 'fs'"))
    writer.fs = file_system


# -- fused elementwise updates ----------------------------------------------------------------------------------------
def _fused_or_each(op: str, what_is_lost: str, tensors: Sequence[torch.Tensor], *args: Any) -> None:
    """``torch._foreach_{op}_(tensors, *args)``, or ``t.{op}_`` per tensor (list arguments zipped) where it is gone."""
    if not tensors:
        return
    fused = getattr(torch, f"_foreach_{op}_", None)
    if fused is None:
        warn_lost(f"foreach_{op}", what_is_lost)
        for i, t in enumerate(tensors):
            getattr(t, f"{op}_")(*(a[i] if isinstance(a, list) else a for a in args))
        return
    fused(list(tensors), *args)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: Union[torch.Tensor, float]) -> None:
    """Multiply every tensor in place by ``scalar`` (a 0-d tensor keeps the factor on the device: no host sync)."""
    _fused_or_each("mul", "gradient clipping scales each gradient with its own kernel", tensors, scalar)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target.copy_(source)`` for every pair, in as few kernels as possible."""
    _fused_or_each("copy", "the moving average's first value is copied with one kernel per tensor", targets, list(sources))


def foreach_lerp_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], weight: float) -> None:
    """``target += weight * (source - target)`` for every pair, in as few kernels as possible."""
    _fused_or_each("lerp", "the moving average is updated with one kernel per tensor", targets, list(sources), weight)


# -- torch.compile ----------------------------------------------------------------------------------------------------
def compile_errors() -> tuple[type[BaseException], ...]:
    """The exception types torch.compile raises when it cannot compile a function (dynamo and inductor)."""
    errors: list[type[BaseException]] = []
    for module, name in (("torch._dynamo.exc", "TorchDynamoException"), ("torch._inductor.exc", "InductorError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors) or (RuntimeError,)


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far (a growing count after warm-up is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# -- FSDP2's communication buffers ------------------------------------------------------------------------------------
def fsdp_default_comms() -> Optional[tuple[type, type]]:
    """FSDP2's default all-gather and reduce-scatter, to subclass with an ``allocate`` that reuses buffers
    (``FSDPModule.set_custom_all_gather``); ``None`` where they or :func:`storage_holders` moved (warns once)."""
    if not fast_paths()["comm_buffer_reuse"]:
        warn_lost("comm_buffer_reuse", "each FSDP unit's communication buffers are allocated afresh every time")
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors (views included) hold ``tensor``'s storage: c10's use count, less the probe's own."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)) - 1


# -- Hugging Face -----------------------------------------------------------------------------------------------------
def hf_init_weights(owner: nn.Module, module: nn.Module) -> None:
    """``PreTrainedModel._init_weights(module)``: how transformers initialises one module of ``owner``."""
    cast(Any, owner)._init_weights(module)  # nn.Module's attribute typing knows tensors and modules only


# -- meta-device initialisation ---------------------------------------------------------------------------------------
def private_reset_parameters(module: nn.Module) -> Optional[Callable[[], None]]:
    """``module._reset_parameters``: how ``nn.MultiheadAttention`` (its own weights) and ``nn.Transformer`` (every
    matrix below it) initialise, called from their ``__init__`` instead of a public ``reset_parameters()``."""
    reset = getattr(module, "_reset_parameters", None)
    if not callable(reset) or any(p.default is p.empty for p in inspect.signature(reset).parameters.values()):
        return None  # not an initialiser that runs on its own
    return reset


#: ``handler(op, args, kwargs)`` → the op's result, or ``NotImplemented`` to run the op as usual
DispatchHandler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def intercept_dispatch(handler: DispatchHandler) -> AbstractContextManager[Any]:
    """A context in which every ATen op call (below autograd, above tensor subclasses such as DTensor) is offered to
    ``handler`` first: a ``TorchDispatchMode``. A function mode would not do: ``torch.nn.init.*`` hand themselves to
    function modes whole, so the ``Tensor.uniform_`` inside them never reaches one."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as err:
        raise _requirement(
            "torch.utils._python_dispatch.TorchDispatchMode", "meta-device initialisation of a sharded model", err
        ) from err

    class Intercept(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
        ) -> Any:
            kwargs = kwargs or {}
            result = handler(func, args, kwargs)
            return func(*args, **kwargs) if result is NotImplemented else result

    return Intercept()


def swaps_on_conversion(tensor: torch.Tensor) -> bool:
    """Whether ``Module._apply`` (``to_empty``, ``.to``) swaps a parameter's contents in place rather than replacing
    it: for tensor subclasses that wrap others (DTensor, torchao's NF4) or when torch's future flag asks for it."""
    try:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:  # what it checks: a subclass that flattens into inner tensors
        return bool(torch.__future__.get_swap_module_params_on_conversion() or hasattr(tensor, "__tensor_flatten__"))
    return bool(torch.__future__.get_swap_module_params_on_conversion() or is_traceable_wrapper_subclass(tensor))


def reset_sharded_params(module: nn.Module) -> None:
    """After the sharded tensors of the FSDP2 unit ``module`` were replaced, refresh FSDP's view of each of its
    parameters (the padded local shard and the reference), as ``FSDPModule._apply`` does after ``to_empty``."""
    try:
        state = cast(Any, module)._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.10: at most one group per module
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
    except AttributeError as err:
        raise _requirement("FSDPParam.reset_sharded_param", "meta-device initialisation of a sharded model", err) from err


def spectral_norm_vectors(parametrization: nn.Module, weight: torch.Tensor) -> bool:
    """Re-derive ``spectral_norm``'s power-iteration vectors ``_u``/``_v`` (buffers) from ``weight`` as its
    ``__init__`` does: random unit vectors, then 15 power iterations. ``False`` if it is not torch's spectral norm."""
    import torch.nn.functional as F

    try:
        from torch.nn.utils.parametrizations import _SpectralNorm
    except ImportError:  # then its buffers count as not re-derived, and materialisation says so
        return False
    if not isinstance(parametrization, _SpectralNorm):
        return False
    if weight.ndim > 1:
        mat = parametrization._reshape_weight_to_matrix(weight)
        u = mat.new_empty(mat.shape[0]).normal_(0, 1)
        v = mat.new_empty(mat.shape[1]).normal_(0, 1)
        parametrization._u.copy_(F.normalize(u, dim=0, eps=parametrization.eps))
        parametrization._v.copy_(F.normalize(v, dim=0, eps=parametrization.eps))
        parametrization._power_method(mat, 15)
    return True


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward hook: its own, or one registered for every module."""
    every = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks
                or every._global_forward_hooks or every._global_forward_pre_hooks)


def _has(module: str, *names: str) -> bool:
    try:
        return all(hasattr(importlib.import_module(module), n) for n in names)
    except ImportError:
        return False


# -- what works on this installation ------------------------------------------------------------------------------------
_PROBES: dict[str, Callable[[], bool]] = {
    "root_gather": _probe_root_gather,
    "failure_relay": _probe_default_store,
    "foreach_mul": lambda: callable(getattr(torch, "_foreach_mul_", None)),
    "foreach_lerp": lambda: callable(getattr(torch, "_foreach_lerp_", None)),
    "foreach_copy": lambda: callable(getattr(torch, "_foreach_copy_", None)),
    "comm_buffer_reuse": lambda: hasattr(torch._C, "_storage_Use_Count") and _has(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultAllGather", "DefaultReduceScatter")
    and _has("torch.distributed.fsdp", "FSDPModule") and hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_all_gather"),
    "in_place_load": lambda: _has("torch.serialization", "_open_zipfile_reader", "_load", "_weights_only_unpickler"),
}


@functools.lru_cache(maxsize=1)
def fast_paths() -> dict[str, bool]:
    """Each fast path by name → whether the installed torch provides it as this module expects."""
    return {name: bool(probe()) for name, probe in _PROBES.items()}
