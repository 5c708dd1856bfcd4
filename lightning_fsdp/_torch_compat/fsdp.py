"""FSDP2's internals: the root kept gathered across a nested forward, units held gathered for a whole rollout,
the communication buffers handed on, and the sharded parameters refreshed after their tensors were replaced."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional, cast

import torch

from lightning_fsdp._torch_compat import base
from lightning_fsdp._torch_compat.base import requirement

if TYPE_CHECKING:
    from torch import nn


def _param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one unit (raises ``AttributeError`` if it is not one)."""
    state = cast(Any, module)._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10: at most one group per module
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return list(groups)


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
        for group in _param_groups(root):
            if group._training_state == state_cls.IDLE and group.is_unsharded and not group._reshard_after_forward:
                group._training_state = state_cls.FORWARD
    except (ImportError, AttributeError) as err:
        base.warn_lost("root_gather", _ROOT_GATHER_LOST, f"({type(err).__name__}: {err})")
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
        raise requirement("torch.distributed._composable.checkpoint", "activation_checkpointing_policy", err) from err
    checkpoint(module)


# -- FSDP2's communication buffers ------------------------------------------------------------------------------------
def fsdp_default_comms() -> Optional[tuple[type, type]]:
    """FSDP2's default all-gather and reduce-scatter, to subclass with an ``allocate`` that reuses buffers
    (``FSDPModule.set_custom_all_gather``); ``None`` where they or :func:`storage_holders` moved (warns once)."""
    if not base.fast_paths()["comm_buffer_reuse"]:
        base.warn_lost("comm_buffer_reuse", "each FSDP unit's communication buffers are allocated afresh every time")
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors (views included) hold ``tensor``'s storage: c10's use count, less the probe's own."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)) - 1


def reset_sharded_params(module: nn.Module) -> None:
    """After the sharded tensors of the FSDP2 unit ``module`` were replaced, refresh FSDP's view of each of its
    parameters (the padded local shard and the reference), as ``FSDPModule._apply`` does after ``to_empty``."""
    try:
        for group in _param_groups(module):
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
    except AttributeError as err:
        raise requirement("FSDPParam.reset_sharded_param", "meta-device initialisation of a sharded model", err) from err


# -- FSDP2: every unit held gathered for a whole rollout ------------------------------------------------------------
_HOLD_GATHERED_LOST = "a gather-once rollout all-gathers every unit again at each decoding step (it streams)"


@contextmanager
def hold_gathered(units: list[nn.Module]) -> Iterator[bool]:
    """While inside, each FSDP2 unit in ``units`` keeps its parameters gathered after its forward (as with
    ``reshard_after_forward=False``), and exactly its own setting (``True``, ``False`` or a smaller mesh's size) is
    restored after. Yields whether it could; ``False`` (warned once) leaves every unit as it was."""
    saved: list[tuple[Any, Any]] = []
    try:
        if not base.fast_paths()["hold_gathered"]:
            raise AttributeError("FSDPParamGroup.post_forward_mesh_info")
        for unit in units:
            for group in _param_groups(unit):
                saved.append((group, group.post_forward_mesh_info))
    except AttributeError as err:
        base.warn_lost("hold_gathered", _HOLD_GATHERED_LOST, f"({type(err).__name__}: {err})")
        yield False
        return
    try:
        for group, _ in saved:
            group.post_forward_mesh_info = None  # what FSDP reads as "do not reshard after forward"
        yield True
    finally:
        for group, info in saved:
            group.post_forward_mesh_info = info


def _probe_hold_gathered() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        source = inspect.getsource(FSDPParamGroup)
        return "self.post_forward_mesh_info = post_forward_mesh_info" in source and (
            "return self.post_forward_mesh_info is not None" in source)
    except (ImportError, OSError, TypeError):
        return False


base.PROBES["root_gather"] = _probe_root_gather
base.PROBES["comm_buffer_reuse"] = lambda: hasattr(torch._C, "_storage_Use_Count") and base.has(
    "torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultAllGather", "DefaultReduceScatter"
) and base.has("torch.distributed.fsdp", "FSDPModule") and hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_all_gather")
base.PROBES["hold_gathered"] = _probe_hold_gathered
