"""Lightning's ``precision=`` flag mapped onto FSDP2's ``MixedPrecisionPolicy``: the one table, and the policy both
front ends' precision plugins delegate to (``trainer/precision.py``, ``fabric/precision.py``).

FSDP2 does mixed precision itself: it keeps the sharded parameters (the optimizer's "master weights") in fp32,
all-gathers them cast to ``param_dtype`` and reduces gradients in ``reduce_dtype``. Lightning's generic plugin
would only add autocast on top of fp32 all-gathers (twice the communication), so each front end brings its own.

:data:`PRECISIONS` is the one table of what each precision stores and computes in; the memory planner reads its
byte sizes from it too.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

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
        kwargs: dict[str, Any] = {
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
    The Trainer's plugin (:mod:`lightning_fsdp.trainer.precision`) and Fabric's (:mod:`lightning_fsdp.fabric`) delegate here.
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


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class PolicyPlugin:
    """What both front ends' FSDP2 precision plugins read off their :class:`PrecisionPolicy` (mixed in before
    Lightning's or Fabric's ``Precision``)."""

    policy: PrecisionPolicy
    scaler: Any  # a gradient scaler (fp16), or None

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self.policy.mp_policy

    def state_dict(self) -> dict[str, Any]:
        """The gradient scaler's state, saved with checkpoints (empty without fp16)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.policy.convert_module(module)
