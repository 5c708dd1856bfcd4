"""``Fabric(precision=...)`` for FSDP2: the same :class:`~lightning_fsdp.precision.PrecisionPolicy` as the Trainer's
plugin, under Fabric's precision interface.

FSDP2 does mixed precision itself (fp32 sharded master weights, gathers cast to ``param_dtype``, gradients reduced
in ``reduce_dtype``); Fabric's generic ``MixedPrecision`` would add autocast on top of fp32 gathers, so the strategy
replaces it with this plugin. Outputs of ``*-mixed`` and ``*-true`` modules come back in the default dtype, as
Fabric's own plugins return them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.precision import MixedPrecisionArg, PolicyPlugin, PrecisionPolicy, adopt_plugin

#: the plugins Fabric builds for ``Fabric(precision=...)`` with a strategy it does not know; replaced by ours
_FABRIC_GENERIC_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


class FSDP2FabricPrecision(PolicyPlugin, Precision):
    """Fabric's precision plugin for the ``fsdp_custom`` strategies (``16-mixed``: a ``ShardedGradScaler``)."""

    def __init__(self, precision: Any = "32-true", mixed_precision: MixedPrecisionArg = None, scaler: Any = None) -> None:
        self.policy = PrecisionPolicy(precision, mixed_precision)
        self.precision = self.policy.precision  # type: ignore[assignment]
        self.scaler = self.policy.make_scaler(scaler)

    @classmethod
    def adopt(cls, plugin: Optional[Precision], mixed_precision: MixedPrecisionArg, owner: str) -> Optional[FSDP2FabricPrecision]:
        """Ours for Fabric's generic plugin (what ``Fabric(precision=...)`` builds), or a clear TypeError."""
        return adopt_plugin(cls, plugin, _FABRIC_GENERIC_PLUGINS, mixed_precision, owner, "Fabric(precision=...)")


    @override
    def tensor_init_context(self) -> Any:
        return self.policy.init_context()

    @override
    def module_init_context(self) -> Any:
        return self.policy.init_context()

    @override
    def forward_context(self) -> Any:
        return self.policy.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.policy.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        default = torch.get_default_dtype()
        return apply_to_collection(data, Tensor, lambda t: t.to(default) if t.is_floating_point() else t)

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        output = self.scaler.step(optimizer, **kwargs)  # skipped when a rank saw inf/NaN (agreed by the scaler)
        self.scaler.update()
        return output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

