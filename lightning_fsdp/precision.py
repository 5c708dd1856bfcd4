"""Lightning's ``precision=`` flag mapped onto FSDP2's ``MixedPrecisionPolicy``, loss scaling, and sharded clipping.

FSDP2 does mixed precision itself: it keeps the sharded parameters (the optimizer's "master weights") in fp32,
all-gathers them cast to ``param_dtype`` and reduces gradients in ``reduce_dtype``. Lightning's generic plugin
would only add autocast on top of fp32 all-gathers (twice the communication), so the strategy brings this one.

:data:`PRECISIONS` is the one table of what each precision stores and computes in; the memory planner reads its
byte sizes from it too.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.parallel.grad_norm import StepGradNorm, clip_grad_norm_

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True)
class PrecisionSpec:
    """What one precision flag means for a sharded model.

    ``param_dtype``/``reduce_dtype`` go into FSDP2's policy (``None``: the stored dtype); ``storage_dtype`` is the
    dtype of the sharded parameters, gradients and optimizer state.
    """

    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    storage_dtype: torch.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.storage_dtype

    @property
    def stored_bytes(self) -> int:
        """Bytes per element of the sharded state (parameters, gradients, optimizer state)."""
        return self.storage_dtype.itemsize

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of gathered parameters and activations."""
        return self.compute_dtype.itemsize


PRECISIONS: dict[str, PrecisionSpec] = {
    "32-true": PrecisionSpec(None, None, torch.float32),
    "64-true": PrecisionSpec(None, None, torch.float64),
    "bf16-mixed": PrecisionSpec(torch.bfloat16, torch.float32, torch.float32),
    "16-mixed": PrecisionSpec(torch.float16, torch.float32, torch.float32),
    "bf16-true": PrecisionSpec(None, None, torch.bfloat16),
    "16-true": PrecisionSpec(None, None, torch.float16),
}
#: Lightning's short forms
ALIASES: dict[Any, str] = {"32": "32-true", 32: "32-true", "64": "64-true", 64: "64-true", "bf16": "bf16-mixed",
                           "16": "16-mixed", 16: "16-mixed"}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
#: the plugins Lightning builds for ``Trainer(precision=...)``; the strategy replaces them with its own
_LIGHTNING_GENERIC_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)

MixedPrecisionArg = Union["MixedPrecisionPolicy", dict[str, Any], None]


def normalize_precision(precision: Any) -> str:
    """Lightning's aliases ("bf16", 16, ...) to the canonical string, or a ValueError listing the choices."""
    value = None if isinstance(precision, bool) else ALIASES.get(precision, precision)
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by the fsdp_custom strategies. Choose one of {sorted(PRECISIONS)}."
        )
    return value


def parse_dtype(value: Any, what: str = "dtype") -> Optional[torch.dtype]:
    """``"bfloat16"``, ``"torch.float32"``, ``"bf16"`` or a ``torch.dtype`` (or None) → the dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}={value!r} is not a dtype; use e.g. 'bfloat16', 'float32'.")


def mixed_precision_policy(precision: str, override_policy: MixedPrecisionArg = None) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a precision string; ``override_policy`` (a policy or a dict of its fields) wins."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(override_policy, MixedPrecisionPolicy):
        return override_policy
    if override_policy is not None:
        if not isinstance(override_policy, dict):
            raise TypeError(
                "`mixed_precision` must be a MixedPrecisionPolicy or a dict of its fields, got"
                f" {type(override_policy).__name__}."
            )
        allowed = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
        unknown = set(override_policy) - allowed
        if unknown:
            raise ValueError(f"Unknown `mixed_precision` keys {sorted(unknown)}; allowed: {sorted(allowed)}.")
        kwargs = {
            k: (parse_dtype(v, f"mixed_precision.{k}") if k != "cast_forward_inputs" else bool(v))
            for k, v in override_policy.items()
        }
        return MixedPrecisionPolicy(**kwargs)
    spec = PRECISIONS[normalize_precision(precision)]
    return MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)


def adopt_plugin(
    ours: type, plugin: Any, generic: tuple[type, ...], mixed_precision: MixedPrecisionArg, owner: str, flag: str
) -> Any:
    """A front end's precision plugin in place of the ``generic`` one its framework built for ``flag`` (same
    precision string), ``plugin`` itself if it is ours already, or a TypeError naming what to use instead."""
    if plugin is None or isinstance(plugin, ours):
        return plugin
    if type(plugin) not in generic:
        raise TypeError(
            f"{owner} does not support the precision plugin {type(plugin).__name__}. Use {flag} with one of"
            f" {sorted(PRECISIONS)}, or pass {ours.__module__}.{ours.__name__}(...) as the plugin."
        )
    return ours(getattr(plugin, "precision", "32-true"), mixed_precision=mixed_precision)


class PrecisionPolicy:
    """One precision flag's behaviour, independent of the front end: FSDP2's dtype policy, what the model is
    converted to before sharding, the init dtype, the forward's autocast, input casts and the loss scaler.
    The Trainer's :class:`FSDP2Precision` and Fabric's plugin (:mod:`lightning_fsdp.fabric`) both delegate here.
    """

    def __init__(self, precision: Any = "32-true", mixed_precision: MixedPrecisionArg = None) -> None:
        self.precision = normalize_precision(precision)
        self.mixed_precision = mixed_precision
        self.spec = PRECISIONS[self.precision]
        self.device_type = "cpu"

    @cached_property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return mixed_precision_policy(self.precision, self.mixed_precision)

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @cached_property
    def compute_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self.spec.storage_dtype

    @property
    def converts_storage(self) -> bool:
        return self.precision.endswith("-true") and self.spec.storage_dtype != torch.float32

    def make_scaler(self, scaler: Any = None) -> Any:
        """``16-mixed``: a ``ShardedGradScaler`` (its inf/NaN check is agreed across ranks); no other flag takes one."""
        if scaler is None and self.precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device="cuda" if torch.cuda.is_available() else "cpu")
        if scaler is not None and self.precision != "16-mixed":
            raise ValueError(f"precision={self.precision!r} does not use a gradient scaler; remove `scaler`.")
        return scaler

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.spec.storage_dtype) if self.converts_storage else module

    def init_context(self) -> Any:
        return _default_dtype(self.spec.storage_dtype) if self.converts_storage else nullcontext()

    def convert_input(self, data: Any) -> Any:
        if not self.converts_storage:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        dtype = self.spec.storage_dtype
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``*-mixed``: autocast stays on so numerically sensitive ops (softmax, losses) run in fp32."""
        if self.is_mixed:
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        else:
            yield


class FSDP2Precision(Precision):
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
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self.policy.mp_policy

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def is_mixed(self) -> bool:
        return self.policy.is_mixed

    # -- module and tensor dtypes --------------------------------------------------------------------------------
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.policy.convert_module(module)

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
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
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

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
