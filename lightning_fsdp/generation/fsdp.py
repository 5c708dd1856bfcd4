"""Generation on a model FSDP2 has sharded: run it as the root's forward, and decide when its units are gathered.

Two ways to gather parameters for a rollout (:data:`ROLLOUT_MODES`):

- ``"gather_once"``: every unit is all-gathered once when the rollout starts and stays gathered until it ends. The
  decoding loop then runs no collective at all, so each rank stops as soon as its own rows are done. It needs the
  whole model's parameters (in the compute dtype) on each device for the rollout's duration.
- ``"stream"``: each unit is gathered in its forward and freed after it, at every decoding step, as in training;
  only one unit (and the root) is whole at a time, so a model far larger than one device generates. The ranks make
  the same calls in the same order, so they agree after each step whether any row anywhere is still running.

``"auto"`` picks ``gather_once`` when the whole model fits the budget (:func:`choose_rollout_mode`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn

from lightning_fsdp._torch_compat import hold_gathered

__all__ = ["ROLLOUT_MODES", "choose_rollout_mode", "fsdp_units", "in_root_forward", "reshard_gathered", "rollout_gathering"]

T = TypeVar("T")

#: how a rollout gathers a sharded model's parameters
ROLLOUT_MODES = ("auto", "gather_once", "stream")


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """Every FSDP2 unit in ``module`` (itself included), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_gathered(module: nn.Module) -> None:
    """Free parameters that FSDP2 left gathered after a forward without backward (the root keeps its own)."""
    for unit in fsdp_units(module):
        unit.reshard()  # type: ignore[operator]


def in_root_forward(pl_module: Any, work: Callable[[], T]) -> T:
    """``work()`` in eval mode without gradients, run as ``pl_module``'s own forward call.

    ``work`` calls into the inner model directly; run that way, FSDP2's root hooks run around it as in a training
    step (the first forward through the root initialises FSDP, and the root unit's parameters are gathered), as
    Lightning does for ``training_step``. Every unit is resharded after.
    """
    was_training = pl_module.training

    def forward() -> T:
        del pl_module.forward  # the class's own forward again
        return work()

    pl_module.eval()
    pl_module.forward = forward
    try:
        with torch.no_grad():
            return pl_module()
    finally:
        pl_module.__dict__.pop("forward", None)
        pl_module.train(was_training)
        reshard_gathered(pl_module)


def choose_rollout_mode(mode: str, full_model_bytes: int, free_bytes: Optional[int], headroom: float = 0.8) -> str:
    """``mode`` itself unless it is ``"auto"``; then ``"gather_once"`` when the whole model (``full_model_bytes``,
    in the compute dtype) fits in ``headroom`` of what the device has free, else ``"stream"``."""
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode={mode!r} is not one of {ROLLOUT_MODES}.")
    if mode != "auto":
        return mode
    if free_bytes is None:
        return "gather_once"
    return "gather_once" if full_model_bytes <= headroom * free_bytes else "stream"


@contextmanager
def rollout_gathering(module: nn.Module, mode: str) -> Iterator[bool]:
    """Inside: ``module``'s units gathered as ``mode`` says (see the module's docstring). Yields whether the ranks
    must agree after each decoding step (``stream`` on a sharded model: a forward runs collectives). Every unit is
    resharded on the way out, and each keeps its own ``reshard_after_forward``."""
    units = fsdp_units(module)
    if not units:
        yield False
        return
    if mode == "stream":
        try:
            yield True
        finally:
            reshard_gathered(module)
        return
    if mode != "gather_once":
        raise ValueError(f"rollout_gathering(mode={mode!r}): 'gather_once' or 'stream' (resolve 'auto' first).")
    with hold_gathered(units) as held:
        try:
            if held:
                for unit in units:  # one all-gather per unit, in the same order on every rank
                    unit.unshard()  # type: ignore[operator]
            yield not held
        finally:
            reshard_gathered(module)
