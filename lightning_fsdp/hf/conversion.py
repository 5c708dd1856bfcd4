"""Checkpoints that transformers converts while loading, read straight into the shards with its own mapping.

transformers 5 renames and fuses many architectures' tensors at load time (``get_model_conversion_mapping``): Mixtral's
``block_sparse_moe.experts.<e>.w1/w3`` become one ``mlp.experts.gate_up_proj`` of shape ``(experts, 2·ffn, hidden)``,
Qwen2/3-MoE, DeepSeek, GLM-4-MoE and others likewise. :func:`conversion_for` applies that mapping to the *names* of
a directory's tensors (and, on the meta device, to their shapes), so keys are matched and checked in the model's own
key space before a byte is read.

Reading stays per rank. A renamed tensor is an ordinary read of its rows. A fused tensor whose conversion starts by
stacking a list of per-expert tensors on dim 0 (``MergeModulelist(dim=0)``, then at most ``Concatenate`` on a later
dim) has row ``e`` made only of the sources' entry ``e``: each rank reads the source tensors of its own rows and runs
transformers' converter on them. Any other conversion reads its sources whole, converts, and keeps the rank's rows.

Export runs the mapping backwards (:func:`revert_tensor`), so ``--format hf`` writes what ``save_pretrained`` writes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_fsdp.hf.directory import HFDirectory, TensorInfo
from lightning_fsdp.hf.init_rules import pretrained_model_class

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Read = Callable[[str], torch.Tensor]  # file key → the whole tensor


@dataclass(frozen=True)
class FusedTensor:
    """One model tensor that transformers builds from several file tensors."""

    key: str  # in the model's key space, e.g. ``model.layers.0.mlp.experts.gate_up_proj``
    sources: tuple[tuple[str, tuple[str, ...]], ...]  # (source pattern, its file keys in natural order)
    converter: Any  # transformers' ``WeightConverter`` (a private copy)
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_local: bool  # row e of dim 0 comes from entry e of every source list

    @property
    def file_keys(self) -> list[str]:
        return [key for _, keys in self.sources for key in keys]

    def rows(self, start: int, stop: int, read: Read) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0, reading only the source tensors they are made of when row-local."""
        if self.row_local:
            picked = [(pattern, keys[start:stop]) for pattern, keys in self.sources]
            return self.convert_sources(picked, read)
        return self.convert_sources(self.sources, read)[start:stop]

    def convert_sources(self, sources: Sequence[tuple[str, Sequence[str]]], read: Read) -> torch.Tensor:
        converter = copy.deepcopy(self.converter)
        for pattern, keys in sources:
            for file_key in keys:
                converter.add_tensor(self.key, file_key, pattern, lambda file_key=file_key: read(file_key))
        out = converter.convert(self.key)
        if set(out) != {self.key}:
            raise RuntimeError(f"transformers' conversion of {self.key} produced {sorted(out)}, not {self.key}.")
        tensor = out[self.key]
        return tensor[0] if isinstance(tensor, list) else tensor


@dataclass(frozen=True)
class Conversion:
    """A directory seen through transformers' conversion mapping: every tensor under the model's key for it."""

    tensors: dict[str, TensorInfo]  # model-space key → dtype and shape (``file`` empty for fused tensors)
    renamed: dict[str, str]  # model-space key → the file key it is read from
    fused: dict[str, FusedTensor]


def hf_model_in(module: nn.Module) -> Optional[PreTrainedModel]:
    """The outermost ``transformers.PreTrainedModel`` inside ``module`` (``None`` without transformers)."""
    pretrained = pretrained_model_class()
    if pretrained is None:
        return None
    return next((m for m in module.modules() if isinstance(m, pretrained)), None)


def _loading_api() -> Optional[ModuleType]:
    """transformers' loading-time conversion module (transformers ≥ 5), or ``None`` before it existed."""
    try:
        from transformers import core_model_loading
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
    except ImportError:
        return None
    return core_model_loading


def _transforms(hf_model: PreTrainedModel) -> Optional[tuple[list[Any], list[Any]]]:
    api = _loading_api()
    if api is None:
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, api.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, api.WeightConverter)]
    return renamings, converters


def conversion_for(hf_model: Optional[PreTrainedModel], directory: HFDirectory) -> Optional[Conversion]:
    """The directory's tensors under the keys ``hf_model`` has for them; ``None`` when no key changes (dense Llama,
    Mistral, Qwen2 and every checkpoint already in the model's layout)."""
    if hf_model is None:
        return None
    found = _transforms(hf_model)
    if found is None:
        return None
    renamings, converters = found
    if not renamings and not converters:
        return None
    api = _loading_api()
    assert api is not None  # ``_transforms`` found it
    renamed: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for file_key in sorted(directory.tensors, key=api.dot_natural_key):
        key, pattern = api.rename_source_key(file_key, renamings, converters)
        if pattern is None:
            renamed[key] = file_key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        _, by_pattern = groups.setdefault(key, (converter, {}))
        by_pattern.setdefault(pattern, []).append(file_key)
    if not groups and all(k == v for k, v in renamed.items()):
        return None
    tensors = {key: directory.tensors[file_key] for key, file_key in renamed.items()}
    fused: dict[str, FusedTensor] = {}
    for key, (converter, by_pattern) in groups.items():
        sources = tuple((p, tuple(by_pattern[p])) for p in converter.source_patterns if p in by_pattern)
        dtype, shape = _converted_shape(key, converter, sources, directory)
        fused[key] = FusedTensor(key, sources, converter, dtype, shape, _row_local(converter, sources, api))
        tensors[key] = TensorInfo("", dtype, shape)
    return Conversion(tensors, renamed, fused)


def _converted_shape(
    key: str, converter: Any, sources: tuple[tuple[str, tuple[str, ...]], ...], directory: HFDirectory
) -> tuple[torch.dtype, tuple[int, ...]]:
    """Run the conversion on meta tensors: the result's dtype and shape, with nothing read."""

    def meta(file_key: str) -> torch.Tensor:
        info = directory.tensors[file_key]
        return torch.empty(info.shape, dtype=info.dtype, device="meta")

    probe = FusedTensor(key, sources, converter, torch.float32, (), row_local=False)
    tensor = probe.convert_sources(sources, meta)
    return tensor.dtype, tuple(tensor.shape)


def _row_local(converter: Any, sources: tuple[tuple[str, tuple[str, ...]], ...], api: Any) -> bool:
    """Rows of dim 0 are made of the same-index entries of the sources: stacked on dim 0 first, then at most
    concatenated along a later dim, with as many entries in every source list."""
    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], api.MergeModulelist) or ops[0].dim != 0:
        return False
    if any(not (isinstance(op, api.Concatenate) and op.dim >= 1) for op in ops[1:]):
        return False
    return len({len(keys) for _, keys in sources}) == 1


def revert_tensor(hf_model: PreTrainedModel, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``key`` of ``hf_model``'s state dict as ``save_pretrained`` writes it: transformers' own reverse mapping
    (``mlp.experts.gate_up_proj`` → every expert's ``w1`` and ``w3``); a key without a conversion is unchanged."""
    if _loading_api() is None:
        return {key: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(hf_model, {key: tensor}))
