"""What a checkpoint holds, read from its metadata only: no tensor data is loaded.

A sharded directory is described from ``manifest.json`` (files, sizes, world size, mesh, versions), ``.metadata``
(restricted unpickler: every tensor's shape and dtype) and ``meta.pt`` (``weights_only``: epoch, step, loops,
callbacks, the pretrained base it refers to, the HF model it holds). A ``.ckpt`` file is opened with ``mmap`` and
its tensors mapped to the meta device, so only its pickled structure is read.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_fsdp.checkpoint.checksums import HASH_ALGORITHM
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME, META_NAME, Manifest, read_manifest
from lightning_fsdp.checkpoint.safe_load import read_metadata, safe_torch_load
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath
from lightning_fsdp.formatting import format_bytes, format_count


def _group(path: TensorPath) -> str:
    if SCHEMA.is_optimizer_path(path):
        return f"optimizer {path[1]}"
    names = {SCHEMA.model: "model", **{k: k.replace("_state_dict", "") for k in SCHEMA.model_like}}
    return names.get(str(path[0]), str(path[0]))


def _tensor_groups(shapes: Mapping[TensorPath, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for path, (dtype, shape) in shapes.items():
        g = groups.setdefault(_group(path), {"tensors": 0, "elements": 0, "bytes": 0, "dtypes": set()})
        numel = int(torch.Size(shape).numel())
        g["tensors"] += 1
        g["elements"] += numel
        g["bytes"] += numel * dtype.itemsize
        g["dtypes"].add(str(dtype).removeprefix("torch."))
    for g in groups.values():
        g["dtypes"] = sorted(g["dtypes"])
    return groups


def _not_optimized(shapes: Mapping[TensorPath, Any]) -> Optional[list[str]]:
    """Model tensors without optimizer state: frozen parameters, buffers, tied aliases (``None``: no
    name-keyed optimizer state to tell)."""
    model = {SCHEMA.model_key(p) for p in shapes if SCHEMA.is_model_tensor(p)}
    optimized = {SCHEMA.optimizer_param(p) for p in shapes if SCHEMA.is_optimizer_state(p)}
    return sorted(model - optimized) if optimized else None


def _lightning_state(meta: Mapping[str, Any]) -> dict[str, Any]:
    reference = meta.get(SCHEMA.pretrained_base)
    hf = meta.get(SCHEMA.hf_model)
    quantized = meta.get(SCHEMA.quantized_base)
    return {
        "epoch": meta.get("epoch"),
        "global_step": meta.get("global_step"),
        "lightning_version": meta.get("pytorch-lightning_version"),
        "callbacks": sorted(str(k) for k in (meta.get("callbacks") or {})),
        "hyper_parameters": sorted(str(k) for k in (meta.get("hyper_parameters") or {})),
        "referenced_base": None if not reference else {
            "path": reference["identity"].get("path"), "frozen_keys": len(reference.get("keys", [])),
        },
        "quantized_base": None if not quantized else {
            "method": quantized.get("method"), "weights": len(quantized.get("keys", [])),
            "from_model": len(quantized.get("from_model", [])), "unquantized": list(quantized.get("unquantized", [])),
            "block_size": quantized.get("block_size"), "scaler_block_size": quantized.get("scaler_block_size"),
        },
        "hf_model": None if not hf else {
            "class": hf.get("class"), "prefix": hf.get("prefix"), "adapters": sorted(hf.get("adapters") or {}),
        },
    }


def describe_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """A plain-data description of the checkpoint at ``path`` (a directory or a ``.ckpt``)."""
    path = Path(path)
    if path.is_dir():
        return _describe_directory(path)
    if path.is_file():
        return _describe_file(path)
    raise CheckpointError(f"Checkpoint {path} does not exist.")


def _describe_directory(path: Path) -> dict[str, Any]:
    sealed = (path / MANIFEST_NAME).exists()
    manifest: Manifest | None = read_manifest(path) if sealed else None
    metadata = read_metadata(path)
    meta: dict[str, Any] = {}
    if (path / META_NAME).is_file():
        loaded = safe_torch_load(path / META_NAME, where=path / META_NAME)
        meta = loaded if isinstance(loaded, dict) else {}
    tensor_map = (meta.get(SCHEMA.bookkeeping) or {}).get(SCHEMA.tensor_map) if sealed else None
    shapes: dict[TensorPath, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            place = tuple(tensor_map[key]) if tensor_map and key in tensor_map else tuple(key.split(".", 1))
            shapes[place] = (md.properties.dtype, tuple(md.size))
    out: dict[str, Any] = {
        "path": str(path),
        "kind": "sharded directory" if sealed else "DCP directory without a manifest (not sealed)",
        "sealed": sealed,
        "tensors": _tensor_groups(shapes),
        "not_optimized": _not_optimized(shapes),
        **_lightning_state(meta),
    }
    if manifest is not None:
        out.update(
            world_size=manifest.world_size, mesh=list(manifest.mesh), state_dict_type=manifest.state_dict_type,
            files=len(manifest.files), bytes=manifest.total_bytes, checksum=manifest.hash_algorithm,
            versions=manifest.versions, created=manifest.created, target=manifest.target, extra=manifest.extra,
        )
    else:
        out["fix"] = f"lightning-fsdp seal {path}"
    return out


def _describe_file(path: Path) -> dict[str, Any]:
    from lightning_fsdp.checkpoint.full import check_zip

    check_zip(path, checksums=False)
    obj = torch.load(path, map_location="meta", weights_only=True, mmap=zipfile.is_zipfile(path))
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a Lightning checkpoint.")
    shapes: dict[TensorPath, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, t in (obj.get(SCHEMA.model) or {}).items():
        shapes[SCHEMA.model_path(name)] = (t.dtype, tuple(t.shape))
    for i, state in enumerate(obj.get(SCHEMA.optimizers) or []):
        prefix = SCHEMA.optimizer_state_prefix(i)
        for pid, values in (state.get(SCHEMA.optimizer_state) or {}).items():
            for key, t in values.items():
                if isinstance(t, torch.Tensor):
                    shapes[prefix + (pid, key)] = (t.dtype, tuple(t.shape))
    for key in SCHEMA.model_like:
        for name, t in (obj.get(key) or {}).items():
            shapes[(key, name)] = (t.dtype, tuple(t.shape))
    return {"path": str(path), "kind": "full file", "bytes": path.stat().st_size, "tensors": _tensor_groups(shapes),
            **_lightning_state(obj)}


def format_description(d: Mapping[str, Any]) -> str:
    """The human-readable summary ``lightning-fsdp inspect`` prints."""
    lines = [f"{d['path']}: {d['kind']}"]
    if d.get("world_size") is not None:
        lines.append(
            f"  saved on {d['world_size']} rank(s), mesh {d['mesh']}, {d['files']} files, {format_bytes(d['bytes'])},"
            f" checksums {d.get('checksum', HASH_ALGORITHM)}"
        )
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(d.get("versions", {}).items())))
    elif d.get("bytes") is not None:
        lines.append(f"  {format_bytes(d['bytes'])}")
    lines.append(f"  epoch {d.get('epoch')}, global step {d.get('global_step')}, lightning {d.get('lightning_version')}")
    for name, g in d["tensors"].items():
        lines.append(
            f"  {name}: {g['tensors']} tensors, {format_count(g['elements'])} elements, {format_bytes(g['bytes'])}"
            f" ({', '.join(g['dtypes'])})"
        )
    if d.get("not_optimized"):
        names = d["not_optimized"]
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        lines.append(f"  model tensors without optimizer state (frozen, buffers or tied): {shown}")
    if d.get("referenced_base"):
        base = d["referenced_base"]
        lines.append(f"  frozen base not stored: {base['frozen_keys']} tensors from {base['path']}")
    if d.get("quantized_base"):
        q = d["quantized_base"]
        kept = f"; left unquantized: {', '.join(q['unquantized'])}" if q["unquantized"] else ""
        lines.append(
            f"  base held quantized in training ({q['method']}, blocks of {q['block_size']}, scaler blocks of"
            f" {q['scaler_block_size']}): {q['weights']} weights, not stored, re-quantized on resume{kept}"
        )
    if d.get("hf_model"):
        hf = d["hf_model"]
        adapters = f", PEFT adapters {hf['adapters']}" if hf["adapters"] else ""
        lines.append(f"  Hugging Face model: {hf['class']} at attribute {hf['prefix']!r}{adapters}")
    if d.get("callbacks"):
        lines.append(f"  callback state: {', '.join(d['callbacks'])}")
    if d.get("fix"):
        lines.append(f"  not loadable by fsdp_custom until sealed: `{d['fix']}`")
    return "\n".join(lines)
