"""Fused elementwise kernels, torch.compile's bookkeeping and module hooks."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from lightning_fsdp._torch_compat import base

if TYPE_CHECKING:
    from torch import nn


# -- fused elementwise updates ----------------------------------------------------------------------------------------
def _fused_or_each(op: str, what_is_lost: str, tensors: Sequence[torch.Tensor], *args: Any) -> None:
    """``torch._foreach_{op}_(tensors, *args)``, or ``t.{op}_`` per tensor (list arguments zipped) where it is gone."""
    if not tensors:
        return
    fused = getattr(torch, f"_foreach_{op}_", None)
    if fused is None:
        base.warn_lost(f"foreach_{op}", what_is_lost)
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


# -- attention blocks -------------------------------------------------------------------------------------------------
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def flash_attention_blocks() -> Optional[tuple[Callable[..., Any], Callable[..., Any]]]:
    """torch's CPU flash-attention forward and backward as ``(q, k, v, causal, mask, scale) -> (out, lse)`` and
    ``(dout, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv)``: ring attention's blocks with their
    log-sum-exp, in the memory of one block. ``None`` (and a loud notice) where torch no longer has them."""
    forward_op: Any = getattr(torch.ops.aten, _CPU_FLASH, None)
    backward_op: Any = getattr(torch.ops.aten, f"{_CPU_FLASH}_backward", None)
    if forward_op is None or backward_op is None:
        base.warn_lost("cpu_flash_attention", "ring attention computes each block with explicit scores (more memory)")
        return None

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor],
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = forward_op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse

    def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, mask: Optional[torch.Tensor], scale: float) -> Any:
        return backward_op(dout, q, k, v, out.to(q.dtype), lse, 0.0, causal, attn_mask=mask, scale=scale)

    return forward, backward


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``tensor`` is a view of (``None`` if it is not a view): tells a transposed weight that autograd
    saved for backward from an activation."""
    return tensor._base


# -- module hooks -----------------------------------------------------------------------------------------------------
def has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward hook: its own, or one registered for every module."""
    every = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks
                or every._global_forward_hooks or every._global_forward_pre_hooks)


base.PROBES["foreach_mul"] = lambda: callable(getattr(torch, "_foreach_mul_", None))
base.PROBES["foreach_lerp"] = lambda: callable(getattr(torch, "_foreach_lerp_", None))
base.PROBES["foreach_copy"] = lambda: callable(getattr(torch, "_foreach_copy_", None))
base.PROBES["cpu_flash_attention"] = lambda: all(
    hasattr(torch.ops.aten, name) for name in (_CPU_FLASH, f"{_CPU_FLASH}_backward"))
