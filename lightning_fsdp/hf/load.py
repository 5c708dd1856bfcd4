"""Pretrained safetensors weights straight into each rank's shards: no rank reads, holds or receives a full copy.

Every rank validates the directory's headers (:class:`~lightning_fsdp.hf.directory.HFDirectory`), maps the model's
keys to the files' (:mod:`~lightning_fsdp.hf.keys`), checks names, shapes and dtypes, and only then reads: DCP's
``HuggingFaceStorageReader`` gives each rank exactly the rows of its own shards (lazy safetensors slices), copied
into the sharded parameters (converting e.g. bf16 files into fp32 master weights, with one notice). Problems are
agreed between the ranks, so every rank raises the same :class:`CheckpointError` before anything is changed.

Quantized parameters (``quantize_base``) are read one at a time into a full-precision tensor holding this rank's rows
only, and quantized from it (:func:`~lightning_fsdp.sharding.quantize.fill`): loading adds at most one tensor's
rows per rank.

Tied parameters (a head tied to the embedding: transformers writes the tensor once) are read once for every name
they have. Checkpoints that transformers renames or fuses while loading are matched under the model's own keys, and
fused tensors are built per rank from the source tensors of its rows (:mod:`~lightning_fsdp.hf.conversion`).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_fsdp._torch_compat import hf_storage_info
from lightning_fsdp.checkpoint.compatibility import check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.sharded import agreed, read_into
from lightning_fsdp.fixes import current_wording
from lightning_fsdp.formatting import short_list
from lightning_fsdp.hf.conversion import Conversion, FusedTensor, conversion_for, hf_model_in
from lightning_fsdp.hf.directory import SUFFIX, HFDirectory
from lightning_fsdp.hf.keys import KeyLayout, detect_layout, is_adapter_key
from lightning_fsdp.parallel.collectives import rank
from lightning_fsdp.parallel.mesh import local_rows, local_shard
from lightning_fsdp.sharding import tied_aliases
from lightning_fsdp.sharding.quantize import fill, is_quantized, rows_like

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES
    from torch.distributed.checkpoint.state_dict import ValueType

RESTORE_HINT = "The model may be partly loaded: do not train from this state; fix the weights and start again."


def is_safetensors_source(path: Union[str, Path]) -> bool:
    """A directory of safetensors files, or one ``.safetensors`` file: read in shards, not broadcast."""
    path = Path(path)
    return path.is_dir() or path.suffix == SUFFIX


@dataclass(frozen=True)
class LoadPlan:
    """What loading ``directory`` into a model does, decided before anything is read."""

    directory: HFDirectory
    layout: KeyLayout
    file_key_of: dict[str, str]  # model key → file key (one per group of tied model keys)
    adapters: list[str] = field(default_factory=list)  # PEFT adapter keys, initialised by PEFT instead
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    covered: list[str] = field(default_factory=list)  # every model key the files overwrite, tied aliases included
    conversion: Optional[Conversion] = None  # transformers' load-time renames and fusions, when the files need them


def plan_load(
    model_tensors: Mapping[str, torch.Tensor],
    directory: HFDirectory,
    *,
    strict: bool = True,
    key_map: Optional[Mapping[str, str]] = None,
    only: Optional[Collection[str]] = None,
    tied: Optional[Mapping[str, str]] = None,
    conversion: Optional[Conversion] = None,
) -> LoadPlan:
    """Match ``model_tensors`` (the model's state dict) against the files: a pure function of names and shapes.

    ``tied`` maps every other name of a tied parameter to its first name (:func:`~lightning_fsdp.sharding
    .tied_aliases`): transformers writes a tied tensor once (no ``lm_head.weight`` beside the embedding), so one file
    key serves every name of the group. Tensors that are the same object are grouped as well. With ``conversion``
    the files are matched under the keys transformers converts them to (:mod:`~lightning_fsdp.hf.conversion`)."""
    names = [k for k in model_tensors if only is None or k in only]
    adapters = [k for k in names if is_adapter_key(k)]
    names = [k for k in names if not is_adapter_key(k)]
    available = conversion.tensors if conversion is not None else directory.tensors
    layout = detect_layout(names, available, key_map)
    aliases: dict[str, list[str]] = {}
    first_of_tensor: dict[int, str] = {}
    for key in names:
        anchor = (tied or {}).get(key) or first_of_tensor.setdefault(id(model_tensors[key]), key)
        aliases.setdefault(anchor, []).append(key)
    file_key_of: dict[str, str] = {}
    missing: list[str] = []
    covered: list[str] = []
    used: set[str] = set()
    for group in aliases.values():  # tied weights: one file key serves every name of the tensor
        found = [(k, file_key) for k in group if (file_key := layout.file_key(k)) is not None and file_key in available]
        if found:
            file_key_of[found[0][0]] = found[0][1]
            used.update(f for _, f in found)  # a file may store each name of a tied tensor
            covered += group
        else:
            missing += group
    unexpected = sorted(k for k in available if k not in used) if only is None else []
    saved = {model_key: (available[f].dtype, available[f].shape) for model_key, f in file_key_of.items()}
    where = f"Pretrained weights {directory.root}"
    current = describe({k: model_tensors[k] for k in file_key_of})
    fix = (
        f"The keys were matched with {layout.describe()}; pass `pretrained_key_map` to match them differently, or"
        f" {current_wording().load_matching_keys} to load the keys that match."
    )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where} do not match the model: missing keys {short_list(sorted(missing))}, unexpected keys"
            f" {short_list(unexpected)}. {fix}"
        )
    fit = check_fits(where, saved, current, strict=True, source="file", dtype_mismatch="convert")
    return LoadPlan(
        directory, layout, file_key_of, adapters, sorted(missing), unexpected, fit.converted, sorted(covered), conversion
    )


class DirectoryReader(HuggingFaceStorageReader):
    """DCP's safetensors reader over exactly the validated files of an :class:`HFDirectory` (DCP's own lists every
    ``*.safetensors`` in the directory, and reads none of the index)."""

    def __init__(self, directory: HFDirectory) -> None:
        super().__init__(str(directory.root))
        self.directory = directory

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        tensors: dict[str, STORAGE_TYPES] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key, info in self.directory.tensors.items():
            zeros = torch.Size([0] * len(info.shape))
            tensors[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=info.dtype),
                size=torch.Size(info.shape),
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(info.shape))],
            )
            path = str(self.directory.root / info.file)
            storage[MetadataIndex(fqn=key, offset=zeros)] = hf_storage_info(path, info.shape, info.dtype)
        return Metadata(state_dict_metadata=tensors, storage_data=storage)


def load_safetensors(
    model: nn.Module,
    path: Union[str, Path],
    *,
    strict: bool = True,
    key_map: Optional[Mapping[str, str]] = None,
    only: Optional[Collection[str]] = None,
) -> LoadPlan:
    """Load the safetensors weights at ``path`` into the sharded ``model`` (every rank calls this).

    ``only`` restricts the load to those model keys (resuming a checkpoint that refers to its frozen base).
    Returns the plan that was carried out (which keys came from where, which were converted).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    directory = agreed(lambda: HFDirectory.open(path), f"Loading pretrained weights {path}")
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    plan = agreed(lambda: _plan(model, model_sd, directory, strict, key_map, only), f"Loading pretrained weights {path}")
    if rank() == 0:
        _notify(plan, strict)
    conversion = plan.conversion
    targets: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    fused: list[tuple[torch.Tensor, FusedTensor]] = []
    for model_key, key in plan.file_key_of.items():
        read_key = conversion.renamed[key] if conversion is not None and key not in conversion.fused else key
        if conversion is not None and key in conversion.fused:
            fused.append((model_sd[model_key], conversion.fused[key]))
        elif is_quantized(model_sd[model_key]):
            quantized[read_key] = model_sd[model_key]
        else:
            targets[read_key] = model_sd[model_key]
    reader, planner = DirectoryReader(directory), DefaultLoadPlanner(allow_partial_load=True)
    read_into(targets, reader, planner, f"Reading pretrained weights {path}", RESTORE_HINT)
    if fused:
        agreed(lambda: _read_fused(fused, directory), f"Reading pretrained weights {path}", hint=RESTORE_HINT)
    for key, param in quantized.items():  # one tensor's rows at a time, quantized as they arrive
        rows = rows_like(param)
        read_into({key: rows}, reader, DefaultLoadPlanner(allow_partial_load=True), f"Reading pretrained weights {path}",
                  RESTORE_HINT)
        with torch.no_grad():
            fill(param, local_shard(rows))
        del rows
    loaded: dict[str, ValueType] = {k: model_sd[k] for k in plan.file_key_of if not is_quantized(model_sd[k])}
    agreed(
        lambda: set_model_state_dict(model, loaded, options=StateDictOptions(strict=False)),
        f"Loading pretrained weights {path}",
        hint=RESTORE_HINT,
    )
    return plan


def planned_keys(
    model: nn.Module, path: Union[str, Path], *, strict: bool = True, key_map: Optional[Mapping[str, str]] = None
) -> set[str]:
    """The model keys (tied aliases included) the files at ``path`` will overwrite: checked on the still-empty model,
    so a mismatch is reported on every rank before anything is allocated, and loaded keys need no initialisation."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = agreed(lambda: HFDirectory.open(path), f"Loading pretrained weights {path}")
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    plan = agreed(lambda: _plan(model, model_sd, directory, strict, key_map, None), f"Loading pretrained weights {path}")
    return set(plan.covered)


def _plan(
    model: nn.Module,
    model_sd: Mapping[str, torch.Tensor],
    directory: HFDirectory,
    strict: bool,
    key_map: Optional[Mapping[str, str]],
    only: Optional[Collection[str]],
) -> LoadPlan:
    """:func:`plan_load` with the model's ties and, for a HF model, transformers' conversion of these files."""
    conversion = conversion_for(hf_model_in(model), directory) if not key_map else None
    return plan_load(
        model_sd, directory, strict=strict, key_map=key_map, only=only, tied=tied_aliases(model), conversion=conversion
    )


def _read_fused(fused: list[tuple[torch.Tensor, FusedTensor]], directory: HFDirectory) -> None:
    """Each fused tensor's local rows, built by transformers' converter from the source tensors of those rows.
    Every source is read through its own short-lived mapping, so pages of tensors already copied are released."""
    from safetensors import safe_open

    def read(file_key: str) -> torch.Tensor:
        with safe_open(str(directory.root / directory.tensors[file_key].file), framework="pt") as f:
            return f.get_tensor(file_key)

    with torch.no_grad():
        for target, tensor in fused:
            start, stop = local_rows(target)
            if stop > start:
                local = local_shard(target)
                local.copy_(tensor.rows(start, stop, read).to(local.dtype))


def _notify(plan: LoadPlan, strict: bool) -> None:
    if plan.converted:
        warnings.warn(
            f"Pretrained weights {plan.directory.root}: {len(plan.converted)} tensor(s) are converted to the model's"
            f" dtypes while loading: {short_list(plan.converted, 3)}.",
            stacklevel=3,
        )
    if not strict and (plan.missing or plan.unexpected):
        warnings.warn(
            f"Pretrained weights {plan.directory.root} loaded non-strictly: model keys not in the files keep their"
            f" initial values {short_list(plan.missing)}; file keys not in the model are ignored"
            f" {short_list(plan.unexpected)}.",
            stacklevel=3,
        )
