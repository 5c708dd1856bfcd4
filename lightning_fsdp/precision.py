"""Lightning's ``precision=`` flag mapped onto FSDP2's ``MixedPrecisionPolicy``, plus sharded gradient clipping.

FSDP2 does mixed precision itself: it keeps the sharded parameters (the optimizer's "master weights") in fp32,
all-gathers them cast to ``param_dtype`` and reduces gradients in ``reduce_dtype``. Lightning's generic plugin
would only add autocast on top of fp32 all-gathers (twice the communication), so the strategy brings this one.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}

#: Lightning precision string → (param_dtype for compute, reduce_dtype, dtype of the stored sharded params)
_PRECISIONS: dict[str, tuple[Optional[torch.dtype], Optional[torch.dtype], torch.dtype]] = {
    "32-true": (None, None, torch.float32),
    "64-true": (None, None, torch.float64),
    "bf16-mixed": (torch.bfloat16, torch.float32, torch.float32),
    "16-mixed": (torch.float16, torch.float32, torch.float32),
    "bf16-true": (None, None, torch.bfloat16),
    "16-true": (None, None, torch.float16),
}
_ALIASES = {"32": "32-true", 32: "32-true", "64": "64-true", 64: "64-true", "bf16": "bf16-mixed",
            "16": "16-mixed", 16: "16-mixed", "transformer-engine": None}

MixedPrecisionArg = Union["torch.distributed.fsdp.MixedPrecisionPolicy", dict[str, Any], None]


def normalize_precision(precision: Any) -> str:
    """Lightning's aliases ("bf16", 16, ...) to the canonical string, or a ValueError listing the choices."""
    value = _ALIASES.get(precision, precision) if not isinstance(precision, bool) else None
    if value not in _PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by the fsdp_custom strategies."
            f" Choose one of {sorted(_PRECISIONS)}."
        )
    return value  # type: ignore[return-value]


def _as_dtype(value: Any, key: str) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"mixed_precision.{key}={value!r} is not a dtype; use e.g. 'bfloat16', 'float32'.")


def mixed_precision_policy(precision: str, override_policy: MixedPrecisionArg = None):
    """The FSDP2 policy for a precision string; ``override_policy`` (a policy or a dict of its fields) wins."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(override_policy, MixedPrecisionPolicy):
        return override_policy
    if override_policy is not None:
        if not isinstance(override_policy, dict):
            raise TypeError(
                f"`mixed_precision` must be a MixedPrecisionPolicy or a dict of its fields, got {type(override_policy).__name__}."
            )
        allowed = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
        unknown = set(override_policy) - allowed
        if unknown:
            raise ValueError(f"Unknown `mixed_precision` keys {sorted(unknown)}; allowed: {sorted(allowed)}.")
        kwargs = {k: (_as_dtype(v, k) if k != "cast_forward_inputs" else bool(v)) for k, v in override_policy.items()}
        return MixedPrecisionPolicy(**kwargs)
    param_dtype, reduce_dtype, _ = _PRECISIONS[normalize_precision(precision)]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


class FSDP2Precision(Precision):
    """Precision plugin for FSDP2: the dtype policy goes into ``fully_shard``; this plugin handles the rest.

    - ``*-mixed``: fp32 sharded master weights, low-precision all-gather and compute; autocast stays on so
      numerically sensitive ops (softmax, losses) run in fp32 as users expect from Lightning's mixed modes.
    - ``*-true``: the model itself is converted to the dtype before sharding.
    - ``16-mixed`` uses a ``ShardedGradScaler``: the inf/NaN check is agreed across ranks.
    """

    def __init__(self, precision: Any = "32-true", mixed_precision: MixedPrecisionArg = None, scaler: Any = None) -> None:
        self.precision = normalize_precision(precision)  # type: ignore[assignment]
        self.mixed_precision = mixed_precision
        _, _, self._storage_dtype = _PRECISIONS[self.precision]
        if scaler is None and self.precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device="cuda" if torch.cuda.is_available() else "cpu")
        if scaler is not None and self.precision != "16-mixed":
            raise ValueError(f"precision={self.precision!r} does not use a gradient scaler; remove `scaler`.")
        self.scaler = scaler
        self.device_type = "cpu"

    @property
    def mp_policy(self):
        return mixed_precision_policy(self.precision, self.mixed_precision)

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        policy = self.mp_policy
        return policy.param_dtype or self._storage_dtype

    # -- module and tensor dtypes --------------------------------------------------------------------------------
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision.endswith("-true") and self._storage_dtype != torch.float32:
            return module.to(dtype=self._storage_dtype)
        return module

    @override
    def tensor_init_context(self):
        if self.precision.endswith("-true") and self._storage_dtype != torch.float32:
            return _default_dtype(self._storage_dtype)
        return nullcontext()

    @override
    def module_init_context(self):
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision.endswith("-true") and self._storage_dtype != torch.float32:
            from lightning.fabric.utilities.apply_func import apply_to_collection

            return apply_to_collection(data, Tensor, lambda t: t.to(self._storage_dtype) if t.is_floating_point() else t)
        return data

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        else:
            yield

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
        clip_grad_norm_sharded(params, float(clip_val))

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


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all gradients as if they were unsharded: local shard norms, reduced over each shard group.

    A sharded (DTensor) gradient contributes its local shard on every rank of its shard group, so the partial
    sums are all-reduced over that group only (for HSDP, replicas hold identical shards and are not summed).
    A plain tensor gradient is replicated and counted once.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    seen: set[int] = set()
    replicated: list[Tensor] = []
    sharded: dict[Any, list[Tensor]] = {}
    for p in parameters:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g = p.grad
        if isinstance(g, DTensor):
            shard_dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
            sharded.setdefault((g.device_mesh, shard_dims), []).append(g.to_local())
        else:
            replicated.append(g)
    if not seen:
        return torch.tensor(0.0)

    inf_norm = math.isinf(norm_type)

    def _partial(grads: list[Tensor]) -> Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).double().cpu() for g in grads])
        return norms.max() if inf_norm else norms.pow(norm_type).sum()

    total = _partial(replicated)
    for (mesh, shard_dims), grads in sharded.items():
        part = _partial(grads)
        device = mesh.device_type
        part = part.to(device)
        for dim in shard_dims:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM, group=mesh.get_group(dim))
        part = part.cpu()
        total = torch.maximum(total, part) if inf_norm else total + part
    return total if inf_norm else total.pow(1.0 / norm_type)


def clip_grad_norm_sharded(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """``clip_grad_norm_`` for FSDP2: scale every gradient by ``max_norm / global_norm`` when that is < 1."""
    params = list(parameters)
    total = total_grad_norm(params, norm_type)
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in {id(p): p.grad for p in params if p.grad is not None}.values():
                g.mul_(coef)
    return total.float()
