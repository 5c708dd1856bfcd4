"""The Trainer's precision plugin for FSDP2, over the front-end-free :class:`~lightning_fsdp.precision.PrecisionPolicy`:
the dtype policy goes into ``fully_shard``; this plugin adds loss scaling and clipping over sharded gradients."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.parallel.grad_norm import StepGradNorm, clip_grad_norm_
from lightning_fsdp.precision import MixedPrecisionArg, PolicyPlugin, PrecisionPolicy, PrecisionSpec, adopt_plugin

#: the plugins Lightning builds for ``Trainer(precision=...)``; the strategy replaces them with its own
_LIGHTNING_GENERIC_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


class FSDP2Precision(PolicyPlugin, Precision):
    """The Trainer's precision plugin for FSDP2: the dtype policy goes into ``fully_shard``; this plugin handles the rest.

    - ``*-mixed``: fp32 sharded master weights, low-precision all-gather and compute; autocast stays on so
      numerically sensitive ops (softmax, losses) run in fp32 as users expect from Lightning's mixed modes.
    - ``*-true``: the model itself is converted to the dtype before sharding.
    - ``16-mixed`` uses a ``ShardedGradScaler``: the inf/NaN check is agreed across ranks.
    """

    def __init__(self, precision: Any = "32-true", mixed_precision: MixedPrecisionArg = None, scaler: Any = None) -> None:
        self.policy = PrecisionPolicy(precision, mixed_precision)
        self.precision = self.policy.precision  # type: ignore[assignment]
        self.scaler = self.policy.make_scaler(scaler)
        #: shared with the non-finite step check, so a clipped step computes one norm (set by the strategy)
        self.grad_norm = StepGradNorm()

    @classmethod
    def adopt(cls, plugin: Optional[Precision], mixed_precision: MixedPrecisionArg, owner: str) -> Optional[FSDP2Precision]:
        """The plugin for Lightning's generic one (what ``Trainer(precision=...)`` builds), or a clear TypeError."""
        return adopt_plugin(cls, plugin, _LIGHTNING_GENERIC_PLUGINS, mixed_precision, owner, "Trainer(precision=...)")

    @property
    def device_type(self) -> str:
        return self.policy.device_type

    @device_type.setter
    def device_type(self, value: str) -> None:
        self.policy.device_type = value

    @property
    def spec(self) -> PrecisionSpec:
        return self.policy.spec

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def is_mixed(self) -> bool:
        return self.policy.is_mixed

    # -- module and tensor dtypes --------------------------------------------------------------------------------
    @override
    def tensor_init_context(self):
        return self.policy.init_context()

    @override
    def module_init_context(self):
        return self.policy.init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.policy.convert_input(data)

    @override
    def forward_context(self):
        return self.policy.forward_context()

    # -- loss scaling (16-mixed) -------------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self.scaler.unscale_(optimizer)
            self.grad_norm.invalidate()  # any norm of the scaled gradients is stale now
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output

    # -- clipping over sharded gradients -------------------------------------------------------------------------
    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(clip_val), total_norm=self.grad_norm.get(params))

