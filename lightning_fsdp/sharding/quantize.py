"""A frozen base held in 4 bits (QLoRA): a sharding-time transformation of frozen ``nn.Linear`` weights.

:func:`quantize_units` runs after the units are chosen and before ``fully_shard``: every frozen ``nn.Linear`` weight
inside an FSDP unit (attention and MLP projections, PEFT's ``base_layer`` included) becomes an NF4 parameter, which
FSDP2 then shards on dim 0 and all-gathers in 4 bits. Embeddings, norms, the output head (it is in the root) and
every trainable parameter keep their dtype. A weight whose shards would not hold whole scaler blocks stays as it is,
named in one notice.

Where the values come from:

- a model built with its weights (eagerly): each weight is quantized whole, on every rank alike;
- a model on the meta device: empty NF4 parameters, filled by :func:`fill` from each rank's rows alone — pretrained
  rows read straight from the files (:mod:`lightning_fsdp.hf.load`), or rows a library initialiser wrote into a
  stand-in (:func:`standins`). The block statistics are agreed over the shard group, so every rank holds exactly
  its part of ``to_nf4(whole weight)`` and no rank ever holds the whole weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_fsdp.formatting import short_list
from lightning_fsdp.parallel.collectives import rank
from lightning_fsdp.parallel.mesh import gather_over_shards, local_shard
from lightning_fsdp.sharding import nf4
from lightning_fsdp.sharding.units import tied_aliases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: ``quantize_base=`` values and what they hold the frozen base in
METHODS = {"nf4": "torchao NF4 (4-bit NormalFloat, blocks of 64, double-quantized scalers in blocks of 256)"}
#: how the base is quantized, recorded in checkpoints: a resume must quantize it the same way
SETTINGS = {"block_size": nf4.BLOCK_SIZE, "scaler_block_size": nf4.SCALER_BLOCK_SIZE}


def check_method(method: Optional[str]) -> Optional[str]:
    """Validate ``quantize_base`` before any process starts: a known name, and torchao importable."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"`quantize_base` must be one of {sorted(METHODS)} or None, got {method!r}.")
    nf4.require()
    return method


@dataclass(frozen=True)
class QuantizedBase:
    """Which parameters a run holds quantized (``names``, by fully qualified name), those quantized from the values
    the model was built with (``from_model``; the rest are filled from pretrained files or initialisers), and the
    frozen ``nn.Linear`` weights left unquantized because their shards would split a scaler block."""

    method: str
    names: tuple[str, ...]
    from_model: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = ()
    settings: dict[str, int] = field(default_factory=lambda: dict(SETTINGS))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "keys": list(self.names), "from_model": list(self.from_model),
                "unquantized": list(self.unquantized), **self.settings}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizedBase:
        settings = {k: int(data[k]) for k in SETTINGS if k in data}
        return cls(str(data["method"]), tuple(map(str, data["keys"])), tuple(map(str, data.get("from_model", ()))),
                   tuple(map(str, data.get("unquantized", ()))), settings)


def frozen_linear_weights(model: nn.Module, units: Sequence[str]) -> dict[str, nn.Linear]:
    """Frozen ``nn.Linear`` weights inside the units (not the root), by parameter name; output embeddings and
    tied weights excluded (they belong to the root and keep their dtype)."""
    heads = {id(head) for m in model.modules() if isinstance(head := _output_embeddings(m), nn.Module)}
    tied = {name for pair in tied_aliases(model).items() for name in pair}
    found: dict[str, nn.Linear] = {}
    for unit in (u for u in units if u):
        for name, module in model.get_submodule(unit).named_modules(prefix=unit):
            weight = getattr(module, "weight", None)
            if (isinstance(module, nn.Linear) and id(module) not in heads and isinstance(weight, nn.Parameter)
                    and not weight.requires_grad and f"{name}.weight" not in tied):
                found[f"{name}.weight"] = module
    return found


def _output_embeddings(module: nn.Module) -> Any:
    """A Hugging Face model's output head (``get_output_embeddings()``), or ``None``."""
    get = getattr(module, "get_output_embeddings", None)
    if not callable(get):
        return None
    try:
        return get()
    except (AttributeError, NotImplementedError, TypeError):
        return None


def quantize_units(
    model: nn.Module, units: Sequence[str], mesh: DeviceMesh, method: str, compute_device: torch.device
) -> QuantizedBase:
    """Replace the frozen linear weights inside ``units`` with ``method`` parameters (before ``fully_shard``)."""
    candidates = frozen_linear_weights(model, units)
    if not candidates:
        raise ValueError(
            f"quantize_base={method!r} quantizes the frozen base of a fine-tune, but no FSDP unit of"
            f" {type(model).__name__} holds a frozen nn.Linear weight (units: {short_list([u for u in units if u])})."
            " Freeze the base (e.g. LoRA with PEFT's get_peft_model) or drop quantize_base."
        )
    shards = mesh.size(mesh.ndim - 1)
    names, from_model, skipped = [], [], []
    for name, module in candidates.items():
        weight = module.weight
        if not nf4.shard_fits(tuple(weight.shape), shards):
            skipped.append(f"{name} {tuple(weight.shape)}")
            continue
        if weight.is_meta:
            value = nf4.empty(weight.shape, torch.device("meta"), compute_device)
        else:
            value = nf4.quantize_whole(weight.to(compute_device))
            from_model.append(name)
        module.register_parameter("weight", nn.Parameter(value, requires_grad=False))
        names.append(name)
    if skipped and rank() == 0:
        warnings.warn(
            f"quantize_base={method!r}: {len(skipped)} frozen weight(s) stay unquantized because their shards over"
            f" {shards} rank(s) would split a block of {nf4.SHARD_ALIGNMENT} elements (rows must divide by {shards}"
            f" and rows/{shards} × columns by {nf4.SHARD_ALIGNMENT}): {short_list(skipped, 4)}."
            + (" Nothing was quantized." if not names else ""),
            stacklevel=3,
        )
    return QuantizedBase(method, tuple(names), tuple(from_model), tuple(s.split(" ")[0] for s in skipped))


def is_quantized(tensor: Any) -> bool:
    """``tensor`` (a parameter or DTensor) is held quantized."""
    return nf4.is_nf4(local_shard(tensor)) if isinstance(tensor, torch.Tensor) else False


def quantized_names(model: nn.Module) -> list[str]:
    """The parameters of ``model`` held quantized."""
    return [name for name, p in model.named_parameters() if is_quantized(p)]


def rows_like(param: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """An empty full-precision (bf16) tensor sharded like the quantized ``param``: a DTensor over the same mesh and
    placements whose local part is this rank's rows. Pretrained rows are read into it, initialisers write it."""
    from torch.distributed.tensor import DTensor

    local = local_shard(param)
    empty = torch.empty(local.shape, dtype=nf4.DTYPE, device=device or nf4.data_device(local))
    if not isinstance(param, DTensor):
        return empty
    return DTensor.from_local(empty, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)


def fill(param: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize this rank's ``rows`` of ``param`` into it, exactly as the whole weight would be (every rank of the
    shard group calls this for the same parameters in the same order: the block statistics are all-gathered)."""
    target = local_shard(param)
    device = nf4.compute_device(target)
    rows = rows.detach().to(device=device, dtype=nf4.DTYPE)
    absmax = nf4.block_absmax(rows)
    mean = gather_over_shards(absmax, param).mean()
    nf4.write(target, nf4.quantize_rows(rows, mean))


@contextmanager
def standins(model: nn.Module, modules: Collection[str], loaded: Collection[str]) -> Iterator[None]:
    """While an initialiser of ``modules`` runs, their quantized weights are full-precision stand-ins sharded the same
    way; afterwards the stand-ins of weights no pretrained file overwrites (``loaded``) are quantized into place.
    Stand-ins exist for one initialiser's modules at a time, so their memory is one layer's, never the base's."""
    swaps: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter, bool]] = []
    for module_name in modules:
        module = model.get_submodule(module_name)
        for param_name, param in list(module.named_parameters(recurse=False)):
            if is_quantized(param):
                full_name = f"{module_name}.{param_name}" if module_name else param_name
                standin = nn.Parameter(rows_like(param), requires_grad=False)
                module.register_parameter(param_name, standin)
                swaps.append((module, param_name, param, standin, full_name not in loaded))
    try:
        yield
    finally:
        for module, param_name, original, _, _ in swaps:
            module.register_parameter(param_name, original)
    with torch.no_grad():
        for _, _, original, standin, keep in swaps:
            if keep:
                fill(original, local_shard(standin))


def shard_bytes(tensor: torch.Tensor) -> Optional[int]:
    """Bytes this rank stores for a quantized ``tensor`` (``None`` if it is not quantized)."""
    local = local_shard(tensor)
    return nf4.nbytes(local) if nf4.is_nf4(local) else None


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's ranks compute on (the current GPU for CUDA meshes)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
