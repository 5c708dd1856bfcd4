"""A sharded checkpoint's Hugging Face model built in memory: what ``consolidate --format hf`` would write, without
writing it (``lightning-fsdp chat CKPT`` talks to a LoRA checkpoint this way). The key mapping, LoRA merge and tied
weights are :mod:`.export`'s own, so the model equals the export's tensor for tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.formatting import short_list
from lightning_fsdp.hf.export import (
    CheckpointTensors,
    build_skeleton,
    checkpoint_dtype,
    existing_path,
    plain_model_sources,
)
from lightning_fsdp.precision import parse_dtype
from lightning_fsdp.sharding import tied_aliases

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["load_hf_model"]


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
    if side_dir is not None and (side_dir / "generation_config.json").is_file():  # as from_pretrained(export) reads
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(side_dir))
    model.eval()
    return model, side_dir
