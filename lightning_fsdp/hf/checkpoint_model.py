"""A sharded checkpoint's Hugging Face model built in memory: what ``consolidate --format hf`` would write, without
writing it. :func:`load_hf_model` builds it whole in one process (``lightning-fsdp chat CKPT`` talks to a LoRA
checkpoint this way); :class:`CheckpointModel` fills a model already sharded over the ranks, each rank keeping only
its rows (``lightning-fsdp eval CKPT``). The key mapping, LoRA merge and tied weights are :mod:`.export`'s own, so
either model equals the export's tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from lightning_fsdp.checkpoint.compatibility import check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.sharded import agreed
from lightning_fsdp.formatting import short_list
from lightning_fsdp.hf.export import (
    CheckpointTensors,
    build_skeleton,
    checkpoint_dtype,
    existing_path,
    plain_model_sources,
)
from lightning_fsdp.parallel.collectives import is_distributed, on_rank_zero
from lightning_fsdp.precision import parse_dtype
from lightning_fsdp.sharding import tied_aliases

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckpointModel", "load_hf_model"]

#: full tensors rank 0 reads before they are broadcast: a sharded fill never holds more than this (or the one tensor
#: that is larger) beside its shards
FILL_BATCH_BYTES = 256 << 20


def load_hf_model(
    src: Union[str, Path],
    *,
    base: Optional[Union[str, Path]] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    verify: bool = True,
    weights: str = "model",
    merge_into: str = "original",
) -> tuple[PreTrainedModel, Optional[Path]]:
    """The checkpoint's HF model on the CPU in memory, the model :func:`export_hf` would write (LoRA merged, in
    ``dtype``, by default the trained one), so it can be used without an export on disk; and the directory its
    tokenizer and generation files come from (``None`` when the checkpoint names none)."""
    src = Path(src)
    target_dtype = parse_dtype(dtype, "--dtype")
    tensors = CheckpointTensors(src, base, verify, weights=weights, merge_into=merge_into)
    try:
        info = tensors.require_info(None)
        model = build_skeleton(info, with_adapters=False, real_buffers=True)
        ties = tied_aliases(model)
        names, sources = plain_model_sources(tensors, info, model)
        target = target_dtype or checkpoint_dtype(tensors)
        state = {model_key: sources[key]().to(target) for model_key, key in names.items()}
        unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
        del state
        for alias, canonical in ties.items():  # assigning replaced the shared Parameter on one side only
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(canonical))
        missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if unexpected or missing:
            raise CheckpointError(
                f"{src} does not fit the {info['class']} it describes: "
                + "; ".join(f"{what} {short_list(keys)}" for what, keys in
                            (("unexpected", unexpected), ("missing", missing)) if keys)
            )
        side_dir = tensors.base_root or existing_path(info.get("source"))
    finally:
        tensors.close()
    _read_generation_config(model, side_dir)
    model.eval()
    return model, side_dir


class CheckpointModel:
    """A sharded checkpoint of a HF model, opened on every rank: its skeleton on the meta device, then, once the
    skeleton is sharded, each rank's rows filled from the checkpoint (LoRA merged, a QLoRA base from its original
    files), so that no rank ever holds the whole model. Close it (or use ``with``) when the fill is done."""

    def __init__(self, src: Union[str, Path], base: Optional[Union[str, Path]] = None, verify: bool = True) -> None:
        self.src = Path(src)
        self.tensors = CheckpointTensors(self.src, base, verify)
        try:
            self.info = self.tensors.require_info(None)
        except CheckpointError:
            self.tensors.close()
            raise
        #: the tokenizer's and generation config's directory: ``base`` or the pretrained directory recorded
        recorded = self.tensors.base_root or existing_path(self.info.get("source"))
        self.side_dir = Path(base) if base is not None else recorded

    def __enter__(self) -> CheckpointModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.tensors.close()

    def skeleton(self) -> PreTrainedModel:
        """The plain HF model with its parameters on the meta device (buffers real), ready to shard; its generation
        config is the pretrained directory's, as ``from_pretrained`` of the export reads it."""
        model = build_skeleton(self.info, with_adapters=False, real_buffers=True)
        _read_generation_config(model, self.side_dir)
        return model

    def fill(self, model: nn.Module, batch_bytes: int = FILL_BATCH_BYTES) -> None:
        """Rank 0 reads the checkpoint's tensors a batch at a time (failures agreed on every rank) and torch's
        ``set_model_state_dict`` broadcasts them, each rank keeping its rows, in the dtypes of the sharded ``model``,
        as :func:`~lightning_fsdp.checkpoint.pretrained.load_pretrained` does; a tied weight is filled once, through
        its first name. A checkpoint that does not fit the model is refused on every rank, naming the keys."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        names, sources = plain_model_sources(self.tensors, self.info, model)
        ties = tied_aliases(model)
        current = {k: v for k, v in get_model_state_dict(model).items()
                   if isinstance(v, torch.Tensor) and k not in ties}
        saved = {model_key: self.tensors.shapes[key] for model_key, key in names.items()}
        check_fits(self.src, saved, describe(current), strict=True, dtype_mismatch="convert",
                   missing_fix=f"It was saved from another model than the {self.info['class']} it describes.")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_distributed(), strict=False)

        def read(keys: list[str]) -> dict[str, Any]:
            return {k: sources[names[k]]().to(current[k].dtype) for k in keys}

        for keys in _batches(names, {k: current[k].numel() * current[k].element_size() for k in names}, batch_bytes):
            batch = agreed(on_rank_zero(partial(read, keys)), f"Reading {self.src}") or {}
            set_model_state_dict(model, batch, options=options)


def _batches(keys: Iterable[str], nbytes: dict[str, int], limit: int) -> Iterator[list[str]]:
    """``keys`` in order, cut after the first key that brings a batch to ``limit`` bytes (the same cuts on every
    rank: they come from the model's shapes, not from what was read)."""
    batch: list[str] = []
    held = 0
    for key in keys:
        batch.append(key)
        held += nbytes[key]
        if held >= limit:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def _read_generation_config(model: PreTrainedModel, side_dir: Optional[Path]) -> None:
    """``side_dir``'s ``generation_config.json`` on ``model``, as ``from_pretrained`` of the export reads it."""
    if side_dir is not None and (side_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(side_dir))
