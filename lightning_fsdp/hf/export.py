"""A sharded checkpoint of a Hugging Face model → a HF model directory or a PEFT adapter, in one process.

``--format hf`` writes what ``AutoModelForCausalLM.from_pretrained(DST)`` loads: safetensors shards of at most
``max_shard_size`` plus their index, ``config.json`` (and the generation and tokenizer files of the pretrained
directory, or of ``--hf-config``), keys without the LightningModule's attribute prefix. A PEFT model is merged
into its base: each LoRA layer is materialised alone, filled with its base and adapter weights and merged by PEFT's
own ``merge`` (DoRA and ``fan_in_fan_out`` included), so memory stays near one output shard. ``--format peft``
writes the adapter alone through ``PeftModel.save_pretrained`` (``PeftModel.from_pretrained`` loads it).
:func:`lightning_fsdp.hf.checkpoint_model.load_hf_model` builds the model ``--format hf`` writes in memory instead.

The base weights of a LoRA checkpoint come from the pretrained directory it recorded (checked against its identity
first) or from ``--base DIR``. A QLoRA checkpoint (``quantize_base``) is merged into that original full-precision
base by default — what is served — or, with ``merge_into="quantized"``, into the base as training saw it: each
quantized weight quantized and dequantized again before the merge. The model's skeleton is rebuilt on the meta device from the checkpoint's own
description of the HF model (:mod:`lightning_fsdp.hf.info`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union, overload

import torch
from torch import nn

from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint.base_weights import BaseReference, pop_quantized, pop_reference
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.reader import CheckpointReader
from lightning_fsdp.checkpoint.safetensors_file import Entry, write_tensors
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.checkpoint.state import weight_paths
from lightning_fsdp.formatting import parse_bytes, short_list
from lightning_fsdp.hf.conversion import revert_tensor
from lightning_fsdp.hf.directory import INDEX_NAME, HFDirectory, identity_differences, side_files
from lightning_fsdp.hf.keys import KeyLayout, detect_layout, is_adapter_key
from lightning_fsdp.precision import parse_dtype
from lightning_fsdp.sharding import parameters_on_meta, tied_aliases

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Source = Callable[[], torch.Tensor]
#: what a QLoRA checkpoint's adapters are merged into: the original base files, or the base as training saw it
MERGE_TARGETS = ("original", "quantized")


class CheckpointTensors:
    """Every model tensor of a sharded checkpoint of a HF model, by LightningModule key, read on demand; the frozen
    base weights it refers to come from their (verified) safetensors files."""

    def __init__(
        self,
        src: Path,
        base_dir: Optional[Union[str, Path]] = None,
        verify: bool = True,
        with_base: bool = True,
        weights: str = "model",
        merge_into: str = "original",
    ) -> None:
        self.reader = CheckpointReader(src, verify)  # each entry checked as it is read
        meta = self.reader.meta
        self.src = src
        self.info: Optional[dict[str, Any]] = meta.get(SCHEMA.hf_model)
        self.meta = meta
        self.sources: dict[str, Source] = {}
        self.shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, key in weight_paths(self.reader.paths, weights, src).items():
            self.sources[name] = partial(self.reader.read, key)
            self.shapes[name] = self.reader.describe(key)
        reference = pop_reference(meta, src)
        quantized = pop_quantized(meta, src)
        self.base_root: Optional[Path] = None
        if merge_into not in MERGE_TARGETS:
            raise ValueError(f"merge_into must be one of {MERGE_TARGETS}, got {merge_into!r}.")
        if merge_into == "quantized" and quantized is None:
            raise CheckpointError(f"{src} was not trained on a quantized base; --merge-into quantized does not apply.")
        if reference is not None and with_base:
            self._add_base(reference, base_dir)
        if quantized is not None and with_base:
            self._check_quantized_base(quantized.names, quantized.from_model, merge_into == "quantized")

    def _check_quantized_base(self, names: tuple[str, ...], from_model: tuple[str, ...], roundtrip: bool) -> None:
        """The quantized weights come from the base files; with ``roundtrip`` each is read as training saw it."""
        if from_model:
            raise CheckpointError(
                f"{self.src}: its quantized base was quantized from the model as it was built, not read from"
                f" pretrained files, so it cannot be rebuilt here ({short_list(list(from_model))}). Train with"
                " `pretrained_weights=` to export, or export the weights from the run."
            )
        if roundtrip:
            for key in names:
                self.sources[key] = _roundtripped(self.sources[key])

    def _add_base(self, reference: BaseReference, base_dir: Optional[Union[str, Path]]) -> None:
        root = Path(base_dir) if base_dir is not None else Path(reference.path)
        for key, (dtype, shape, read) in base_entries(reference, root, self.src).items():
            self.sources[key], self.shapes[key] = read, (dtype, shape)
        self.base_root = root

    def require_info(self, hf_config: Optional[Path]) -> dict[str, Any]:
        if self.info is None:
            raise CheckpointError(
                f"{self.src} holds no description of a Hugging Face model (it was not saved from a LightningModule"
                " holding a transformers model). Export it with --format ckpt or safetensors."
            )
        info = dict(self.info)
        if hf_config is not None:
            config_file = hf_config if hf_config.is_file() else hf_config / "config.json"
            info["config"] = json.loads(config_file.read_text())
        return info

    def close(self) -> None:
        self.reader.close()


def base_entries(reference: BaseReference, root: Path, src: Path) -> dict[str, Entry]:
    """The base weights ``reference`` names, read from ``root`` (checked to be the same files first), by model key."""
    from safetensors import safe_open

    try:
        directory = HFDirectory.open(root)
    except CheckpointError as err:
        raise CheckpointError(
            f"{src} stores only its trainable weights; its base weights come from {root}: {err} Pass `--base DIR`"
            " with a copy of the pretrained directory it was trained on."
        ) from None
    changed = identity_differences(reference.identity, directory.identity(directory.hash_all()))
    if changed:
        raise CheckpointError(
            f"The base weights at {root} are not the ones {src} was trained on: {short_list(changed)}. Pass"
            " `--base DIR` with the original pretrained directory."
        )
    layout = detect_layout(reference.keys, directory.tensors, reference.key_map or None)
    entries: dict[str, Entry] = {}
    for key in reference.keys:
        file_key = layout.file_key(key)
        if file_key is None or file_key not in directory.tensors:
            raise CheckpointError(f"{root} has no tensor for the checkpoint's base key {key!r}.")
        info = directory.tensors[file_key]

        def read(file: Path = root / info.file, name: str = file_key) -> torch.Tensor:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)

        entries[key] = (info.dtype, info.shape, read)
    return entries


@overload
def build_skeleton(
    info: dict[str, Any], with_adapters: Literal[False], *, real_buffers: bool = False
) -> PreTrainedModel: ...
@overload
def build_skeleton(info: dict[str, Any], with_adapters: bool, *, real_buffers: bool = False) -> nn.Module: ...
def build_skeleton(info: dict[str, Any], with_adapters: bool, *, real_buffers: bool = False) -> nn.Module:
    """The HF model (wrapped by PEFT with the checkpoint's adapters, if asked) on the meta device; with
    ``real_buffers`` only its parameters are, so buffers no checkpoint stores (rotary ``inv_freq``) keep their values
    and the model can run once its parameters are assigned."""
    import transformers

    config_dict = dict(info["config"])
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    cls = getattr(transformers, str(info["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"transformers has no model class {info['class']!r}; upgrade transformers.")
    with parameters_on_meta() if real_buffers else torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # inside PEFT
        model = cls(config)
        if with_adapters and info.get("adapters"):
            from lightning_fsdp.sharding import nf4

            nf4.import_quietly()  # PEFT imports torchao when it is installed; without its CPU-only log lines
            from peft import PeftConfig, get_peft_model

            adapters = dict(info["adapters"])
            first, *rest = adapters
            peft_model = get_peft_model(model, PeftConfig.from_peft_type(**adapters[first]), adapter_name=first)
            for name in rest:
                peft_model.add_adapter(name, PeftConfig.from_peft_type(**adapters[name]))
            return peft_model
    return model


def _roundtripped(read: Source) -> Source:
    """``read``'s weight as training saw it: quantized to NF4 and back."""
    from lightning_fsdp.sharding import nf4

    return lambda: nf4.roundtrip(read())


def merged_sources(tensors: CheckpointTensors, info: dict[str, Any]) -> dict[str, Source]:
    """Base weight of every LoRA layer, merged with its adapters by PEFT (one layer materialised at a time)."""
    from peft.tuners.lora.layer import LoraLayer

    peft_model = build_skeleton(info, with_adapters=True)
    peft_prefix = info.get("peft_prefix") or ""
    out: dict[str, Source] = {}
    layer: nn.Module
    for name, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base_keys = [f"{peft_prefix}{name}.base_layer.{p}" for p, _ in layer.get_base_layer().named_parameters()]

        def merge(layer: nn.Module = layer, name: str = name) -> dict[str, torch.Tensor]:
            assert isinstance(layer, LoraLayer)
            layer.to_empty(device="cpu")
            with torch.no_grad():
                for param_name, param in layer.named_parameters():
                    param.copy_(tensors.sources[f"{peft_prefix}{name}.{param_name}"]())
                layer.merge(adapter_names=list(layer.active_adapters))
                merged = {p: t.detach().clone() for p, t in layer.get_base_layer().named_parameters()}
            layer.to_empty(device="meta")
            return merged

        cache: dict[str, dict[str, torch.Tensor]] = {}

        def merged(param: str, merge: Callable[[], dict[str, torch.Tensor]] = merge, cache: dict = cache) -> torch.Tensor:
            if "layer" not in cache:
                cache["layer"] = merge()
            return cache["layer"].pop(param)

        for key in base_keys:
            out[key] = partial(merged, key.rpartition(".")[2])
    return out


def plain_model_sources(
    tensors: CheckpointTensors, info: dict[str, Any], skeleton: nn.Module, merge: bool = True
) -> tuple[dict[str, str], dict[str, Source]]:
    """What the plain HF model ``skeleton`` holds: its state-dict key → the checkpoint key (a tied tensor once, as
    ``save_pretrained`` stores it), and a reader per checkpoint key with LoRA layers merged into their base weights."""
    layout = KeyLayout(prefix=info["prefix"])
    sources = dict(tensors.sources)
    if info.get("adapters"):
        if not merge:
            raise CheckpointError("A PEFT checkpoint is exported merged (--format hf) or as an adapter (--format peft).")
        sources.update(merged_sources(tensors, info))
    names: dict[str, str] = {}
    for key in sorted(sources):
        file_key = None if is_adapter_key(key) else layout.file_key(key)
        if file_key is not None:
            names[file_key] = key
    for alias in tied_aliases(skeleton):
        names.pop(alias, None)
    return names, sources


def export_hf(
    src: Union[str, Path],
    dst: Union[str, Path],
    *,
    hf_config: Optional[Union[str, Path]] = None,
    base: Optional[Union[str, Path]] = None,
    dtype: Optional[str] = None,
    max_shard_size: str = "5GB",
    merge: bool = True,
    verify: bool = True,
    weights: str = "model",
    merge_into: str = "original",
) -> Path:
    """Write the HF model directory ``dst`` from the sharded checkpoint ``src`` (see the module docstring);
    ``weights="ema"``: ``ShardedEMA``'s average instead of the trained weights; ``merge_into="quantized"``: a QLoRA
    checkpoint's adapters merged into the dequantized NF4 base instead of the original one."""
    src, dst = Path(src), Path(dst)
    limit = parse_bytes(max_shard_size)
    out_dtype = parse_dtype(dtype, "--dtype") if dtype else None
    tensors = CheckpointTensors(src, base, verify, weights=weights, merge_into=merge_into)
    try:
        info = tensors.require_info(Path(hf_config) if hf_config else None)
        skeleton = build_skeleton(info, with_adapters=False)
        names, sources = plain_model_sources(tensors, info, skeleton, merge)
        target = out_dtype or checkpoint_dtype(tensors)
        shards = _plan_shards(names, tensors.shapes, target, limit)
        with commit_ops.staged(dst, directory=True) as staging:
            weight_map: dict[str, str] = {}
            total = 0
            for i, shard in enumerate(shards, start=1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
                data = {}
                for model_key in shard:
                    tensor = sources[names[model_key]]().to(target)
                    # back to the file layout: fused MoE experts split per expert, renamed blocks renamed back
                    for file_key, part in revert_tensor(skeleton, model_key, tensor).items():
                        data[file_key] = part.contiguous()
                        total += part.numel() * part.element_size()
                        weight_map[file_key] = file
                write_tensors(staging / file, data, {"format": "pt"})
                del data
            if len(shards) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
            side_dir = Path(hf_config) if hf_config else tensors.base_root or existing_path(info.get("source"))
            _write_side_files(staging, info, side_dir, target)
    finally:
        tensors.close()
    return dst


def export_peft(src: Union[str, Path], dst: Union[str, Path], *, verify: bool = True, weights: str = "model") -> Path:
    """Write the checkpoint's PEFT adapter(s) with ``PeftModel.save_pretrained``; no base weights are read."""
    src, dst = Path(src), Path(dst)
    tensors = CheckpointTensors(src, verify=verify, with_base=False, weights=weights)  # adapters only: no base weights are read
    try:
        info = tensors.require_info(None)
        if not info.get("adapters"):
            raise CheckpointError(f"{src} holds no PEFT adapter; export the model with --format hf.")
        peft_prefix = info.get("peft_prefix") or ""
        adapter = {key[len(peft_prefix):]: read() for key, read in tensors.sources.items() if is_adapter_key(key)}
        model = build_skeleton(info, with_adapters=True)  # imports PEFT (quietly)
        from peft import PeftModel

        assert isinstance(model, PeftModel)  # the checkpoint has adapters, so the skeleton is wrapped
        unknown = model.load_state_dict(adapter, strict=False, assign=True).unexpected_keys
        if unknown:
            raise CheckpointError(f"{src}: adapter tensors the rebuilt PEFT model does not have: {short_list(unknown)}.")
        with commit_ops.staged(dst, directory=True) as staging:
            model.save_pretrained(str(staging), safe_serialization=True)
    finally:
        tensors.close()
    return dst


def _plan_shards(
    names: dict[str, str], shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], dtype: torch.dtype, limit: int
) -> list[list[str]]:
    """Output keys grouped in order into shards of at most ``limit`` bytes (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for file_key in sorted(names, key=_natural):
        _, shape = shapes[names[file_key]]
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(file_key)
        size += nbytes
    return [s for s in shards if s]


def existing_path(path: Optional[str]) -> Optional[Path]:
    return Path(path) if path and Path(path).is_dir() else None


def _natural(key: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def checkpoint_dtype(tensors: CheckpointTensors) -> torch.dtype:
    floats = [dtype for dtype, _ in tensors.shapes.values() if dtype.is_floating_point]
    return max(set(floats), key=floats.count) if floats else torch.float32


def _write_side_files(staging: Path, info: dict[str, Any], from_dir: Optional[Path], dtype: torch.dtype) -> None:
    """Config, generation and tokenizer files; ``config.json`` says the exported dtype."""
    if from_dir is not None and from_dir.is_dir():
        for file in side_files(from_dir):
            shutil.copyfile(file, staging / file.name)
    config = dict(info["config"])
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
