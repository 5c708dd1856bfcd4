"""Pretrained weights into an already sharded model: rank 0 reads the file, the other ranks receive only their shards.

Typical use is a model built on the meta device (``Trainer.init_module(empty_init=True)`` or ``configure_model``)
so that no rank ever materialises the full model::

    strategy = FSDPCustomStrategy(pretrained_weights="weights.safetensors")   # or, in Hydra:
    # strategy: {pretrained_weights: /path/to/weights.safetensors}

or, by hand, after sharding and before the optimizers are built::

    load_pretrained(model, "weights.ckpt", strict=True)

Tensors are broadcast one at a time (``set_model_state_dict(..., broadcast_from_rank0=True)``): a non-zero rank
holds its shards plus one full tensor at a time, never the whole model. Quantized parameters (``quantize_base``)
are broadcast the same way and each rank quantizes its rows (:func:`~lightning_fsdp.sharding.quantize.fill`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import torch
from torch import nn

from lightning_fsdp.checkpoint.compatibility import check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.safe_load import safe_torch_load
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.checkpoint.sharded import agreed
from lightning_fsdp.formatting import short_list
from lightning_fsdp.parallel.collectives import broadcast_object, collective_device, is_distributed, on_rank_zero, rank
from lightning_fsdp.parallel.mesh import local_rows
from lightning_fsdp.sharding.quantize import fill, is_quantized

DtypeMismatch = Literal["warn", "error"]


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did not load (only possible with ``strict=False``) or loaded with a cast."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    cast_keys: list[str]


def read_weights(path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """A full state dict from ``.safetensors``, or a ``.ckpt``/``.pt``/``.pth``/``.bin`` holding a plain state dict
    or Lightning's ``{"state_dict": ...}`` (read with ``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"Pretrained weights {path} do not exist (or are not a file). Check `pretrained_weights`."
        )
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file: {err}.") from None
    obj = safe_torch_load(path, where=path, mmap=True)
    if isinstance(obj, Mapping) and isinstance(obj.get(SCHEMA.model), Mapping):
        obj = obj[SCHEMA.model]
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise CheckpointError(
            f"{path} is not a state dict (a mapping of parameter names to tensors), nor a Lightning checkpoint holding"
            f" one under {SCHEMA.model!r}."
        )
    return dict(obj)


def load_pretrained(
    model: nn.Module,
    path: Union[str, Path],
    *,
    strict: bool = True,
    dtype_mismatch: DtypeMismatch = "warn",
    prefix: str = "",
) -> LoadReport:
    """Load full weights from ``path`` into the sharded ``model`` (every rank calls this).

    Args:
        model: the model after ``fully_shard`` and materialisation (parameters are DTensors).
        path: ``.safetensors``, or a ``torch.save`` file with a state dict or a Lightning checkpoint.
        strict: missing or unexpected keys are an error naming them; otherwise a warning.
        dtype_mismatch: a tensor stored in another dtype than the parameter is converted with an explicit
            warning naming it (``"warn"``) or refused (``"error"``). Never converted silently.
        prefix: prepended to every key of the file, e.g. ``"net."`` when it holds the weights of ``self.net``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if dtype_mismatch not in ("warn", "error"):
        raise ValueError(f"`dtype_mismatch` must be 'warn' or 'error', got {dtype_mismatch!r}.")
    current = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    holder: dict[str, Any] = {}

    def read() -> LoadReport:
        weights = {prefix + k: v for k, v in read_weights(path).items()}
        fit = check_fits(
            f"Pretrained weights {path}",
            describe(weights),
            describe(current),
            strict=strict,
            source="file",
            dtype_mismatch="convert",
            missing_fix="Pass strict=False to load the keys that match, or `prefix` if the file holds the weights of"
            " a submodule.",
        )
        if fit.converted and dtype_mismatch == "error":
            raise CheckpointError(
                f"Pretrained weights {path} are stored in other dtypes than the model: {short_list(fit.converted)}."
                " Pass dtype_mismatch='warn' to convert them, or convert the file."
            )
        for key in fit.unexpected:
            del weights[key]
        holder["weights"] = weights
        return LoadReport(fit.missing, fit.unexpected, fit.converted)

    report = broadcast_object(agreed(on_rank_zero(read), f"Loading pretrained weights {path}"))
    assert report is not None  # rank 0's report, on every rank
    if rank() == 0 and report.cast_keys:
        warnings.warn(
            f"Pretrained weights {path} are converted to the model's dtypes: {short_list(report.cast_keys)}.",
            stacklevel=2,
        )
    quantized = [k for k, v in current.items() if is_quantized(v) and k not in report.missing_keys]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_distributed(), strict=strict and not quantized)

    def load() -> None:
        weights = holder.pop("weights", {})
        quantized_weights = {k: weights.pop(k) for k in quantized if k in weights}
        set_model_state_dict(model, weights, options=options)
        holder["quantized"] = quantized_weights

    agreed(load, f"Loading pretrained weights {path}")
    _load_quantized(current, quantized, holder.pop("quantized", {}))
    return report


def _load_quantized(current: Mapping[str, torch.Tensor], keys: list[str], weights: dict[str, torch.Tensor]) -> None:
    """Rank 0's full tensors of the quantized ``keys``, broadcast one at a time; every rank quantizes its rows."""
    import torch.distributed as dist

    for key in keys:
        param = current[key]
        full = weights.pop(key, None) if rank() == 0 else None
        buffer = torch.empty(param.shape, dtype=torch.bfloat16, device=collective_device() if is_distributed() else "cpu")
        if full is not None:
            buffer.copy_(full)
        if is_distributed():
            dist.broadcast(buffer, src=0)
        start, stop = local_rows(param)
        with torch.no_grad():
            fill(param, buffer[start:stop])
