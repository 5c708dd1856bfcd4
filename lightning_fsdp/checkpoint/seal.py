"""Sealing a sharded checkpoint another tool wrote (Lightning's ``ModelParallelStrategy``, plain DCP): an explicit,
logged decision to trust it, after which ``fsdp_custom`` loads it like its own.

:func:`seal` checks that the directory is a complete DCP checkpoint (``.metadata`` read with the restricted
unpickler; every file it names present, regular and long enough for the byte ranges it lists), reads the
non-tensor state without running code (Lightning's ``meta.pt`` with ``weights_only``, DCP's byte entries such as
optimizer ``param_groups`` through the restricted planner), writes this package's ``meta.pt`` (the original is kept
as ``meta.pt.orig``), hashes every file and writes the manifest last. Loading still goes through the restricted
unpickler: a sealed directory holding a crafted pickle runs no code.

DCP's own flattening map (``planner_data``) gives every tensor's place in the Lightning checkpoint: ``state_dict.*``
is the model, ``optimizer_<i>.*`` the i-th optimizer (``ModelParallelStrategy``'s layout). A plain DCP checkpoint
without Lightning state is sealed as model weights only.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Union

import torch

from lightning_fsdp.checkpoint.checksums import FileEntry, hash_entries, hash_file
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import (
    MANIFEST_NAME,
    META_NAME,
    build_manifest,
    check_entries,
    is_safe_name,
    shard_rank,
    write_manifest,
)
from lightning_fsdp.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata, safe_torch_load
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath
from lightning_fsdp.checkpoint.state import (
    META_FORMAT_VERSION,
    insert_tensors,
    plain_checkpoint_meta,
    stamp_lightning_version,
)

log = logging.getLogger(__name__)

ORIGINAL_META = META_NAME + ".orig"
_OPTIMIZER = re.compile(r"^optimizer_(\d+)$")


def _lightning_path(flat_path: tuple[Any, ...]) -> TensorPath:
    """DCP's nested path of a tensor → its path in a Lightning checkpoint dict."""
    head, *rest = flat_path
    match = _OPTIMIZER.match(str(head))
    if match:
        return (SCHEMA.optimizers, int(match.group(1)), *rest)
    if head in (SCHEMA.model, "model"):  # the Trainer's entry, or Fabric's usual name for the model
        return SCHEMA.model_path(".".join(str(p) for p in rest))
    return SCHEMA.model_path(".".join(str(p) for p in flat_path))  # a plain DCP checkpoint: model keys at the top


def _check_storage(path: Path, metadata: Any) -> list[str]:
    files: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not is_safe_name(name):
            raise CheckpointError(f"{path}: .metadata names a file outside the checkpoint: {name!r}.")
        files[name] = max(files.get(name, 0), int(info.offset) + int(info.length))
    problems = []
    for name, needed in sorted(files.items()):
        file = path / name
        if not file.exists():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < needed:
            problems.append(f"{name} has {file.stat().st_size} bytes, .metadata needs {needed}")
    return problems


def _byte_entries(path: Path, metadata: Any) -> dict[str, Any]:
    """DCP's non-tensor entries (e.g. optimizer ``param_groups``), unpickled with ``weights_only``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    keys = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
    if not keys:
        return {}
    target: dict[str, Any] = {k: io.BytesIO() for k in keys}
    dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(allow_partial_load=True),
             no_dist=True)
    return target


def seal(path: Union[str, Path]) -> dict[str, Any]:
    """Seal the DCP checkpoint directory ``path`` (one process). Returns what was recorded (for the log)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; only sharded (DCP) checkpoint directories are sealed.")
    if (path / MANIFEST_NAME).exists():
        raise CheckpointError(f"{path} already has a {MANIFEST_NAME}: it is a lightning_fsdp checkpoint already.")
    check_entries(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} has no .metadata: it is not a complete DCP checkpoint (the save did not finish).")
    metadata = read_metadata(path)
    problems = _check_storage(path, metadata)
    if problems:
        raise CheckpointError(f"{path} is not a complete DCP checkpoint: {'; '.join(problems)}. Nothing was written.")
    lightning_meta: dict[str, Any] = {}
    if (path / META_NAME).is_file():
        loaded = safe_torch_load(path / META_NAME, where=path / META_NAME)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path / META_NAME} holds a {type(loaded).__name__}, not Lightning's checkpoint state.")
        lightning_meta = loaded
    planner_data = getattr(metadata, "planner_data", None) or {}
    tensor_paths: dict[str, TensorPath] = {}
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            tensor_paths[key] = _lightning_path(tuple(planner_data.get(key, (key,))))
    # DCP flattens plain values too (each param group's lr, betas, params, ... is its own entry): put them back
    plain = {_lightning_path(tuple(planner_data.get(k, (k,)))): v for k, v in _byte_entries(path, metadata).items()}
    tree: dict[str, Any] = insert_tensors({SCHEMA.model: {}}, plain)
    meta: dict[str, Any] = {k: v for k, v in lightning_meta.items() if k not in (SCHEMA.model, SCHEMA.optimizers)}
    meta[SCHEMA.model] = tree[SCHEMA.model]
    count = 1 + max([int(p[1]) for p in (*tensor_paths.values(), *plain) if SCHEMA.is_optimizer_path(p)], default=-1)
    found = list(tree.get(SCHEMA.optimizers) or [])
    optimizers = found[:count] + [None] * (count - len(found))
    optimizers = [{SCHEMA.optimizer_state: {}, SCHEMA.param_groups: [], **(o or {})} for o in optimizers]
    if optimizers:
        meta[SCHEMA.optimizers] = optimizers
    resume_mid_epoch(meta)
    stamp_lightning_version(meta)
    meta = plain_checkpoint_meta(meta)
    meta[SCHEMA.bookkeeping] = {"format_version": META_FORMAT_VERSION, SCHEMA.tensor_map: tensor_paths, "sealed": True}
    if (path / META_NAME).exists():
        os.replace(path / META_NAME, path / ORIGINAL_META)
    tmp = path / (META_NAME + ".tmp")
    torch.save(meta, tmp)
    os.replace(tmp, path / META_NAME)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():  # each entry its own checksum, so loads check what they read
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    files: dict[str, FileEntry] = {
        p.name: hash_entries(p, ranges[p.name]) if p.name in ranges else hash_file(p)
        for p in sorted(path.iterdir()) if p.name != MANIFEST_NAME
    }
    ranks = {r for n in files if (r := shard_rank(n)) is not None}
    world = max(ranks) + 1 if ranks else 1
    manifest = build_manifest(
        files, world_size=world, mesh=(world,), state_dict_type="sharded", target=path.name, save_id="sealed",
        extra={"sealed_at": time.time(), "sealed_from": "lightning" if lightning_meta else "dcp",
               **{k: lightning_meta[k] for k in SCHEMA.progress if type(lightning_meta.get(k)) is int}},
    )
    write_manifest(path, manifest)
    summary = {"path": str(path), "tensors": len(tensor_paths), "files": len(files), "world_size": world,
               "optimizers": len(optimizers), "lightning_state": bool(lightning_meta)}
    log.warning("sealed %s as a lightning_fsdp checkpoint: %s", path, summary)
    return summary


def resume_mid_epoch(meta: dict[str, Any]) -> None:
    """Record where in the epoch a checkpoint saved mid-epoch stopped, in the form ``fsdp_custom``'s loader wrapper
    restores (``batches_done``), so the resumed run continues with the next batch. Lightning's other strategies
    restart the epoch's data from its first batch; a loader that saved its own state keeps it."""
    fit_loop = (meta.get("loops") or {}).get("fit_loop")
    if not isinstance(fit_loop, dict):
        return
    progress = fit_loop.get("epoch_loop.batch_progress") or {}
    done = int((progress.get("current") or {}).get("processed", 0))
    state = fit_loop.setdefault("state_dict", {})
    if done > 0 and not progress.get("is_last_batch") and isinstance(state, dict) and "combined_loader" not in state:
        state["combined_loader"] = [{"batches_done": done}]
