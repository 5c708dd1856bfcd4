"""One way to open a committed sharded checkpoint in one process: :class:`CheckpointReader`.

Opening reads the manifest (the directory's entries checked first), verifies the state files and parses them safely
(``.metadata`` with the restricted unpickler, ``meta.pt`` with ``weights_only``), and checks every file's size.
Tensors are then read whole, by key, one at a time; each entry is read once and checked against its own checksum
before it is parsed (:func:`~lightning_fsdp.checkpoint.safe_load.read_entry`), so a consolidation or an export reads
every byte once. Files without per-entry checksums (format-1 manifests) are verified whole when opened. Nothing
outside the checkpoint directory is ever opened.

``consolidate`` and the HF and PEFT exports open checkpoints through it; the distributed load
(:mod:`~lightning_fsdp.checkpoint.sharded_load`) shares its state-file reading and entry checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import (
    META_NAME,
    Manifest,
    check_files,
    is_safe_name,
    raise_damaged,
    read_manifest,
    require_listed,
)
from lightning_fsdp.checkpoint.safe_load import EntryBuffer, load_metadata_bytes, read_entry, safe_torch_load
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath

#: read by every loader before anything else, and verified whole before they are parsed (they are small)
STATE_FILES = (".metadata", META_NAME)


def read_state_files(path: Path, manifest: Manifest) -> tuple[Any, dict[str, Any], dict[str, TensorPath]]:
    """``.metadata`` (restricted unpickler), ``meta.pt`` (weights_only) and the storage-key → tensor-path map, each
    file checked to be covered by the (verified) manifest first."""
    require_listed(path, manifest, [".metadata", META_NAME])
    metadata = load_metadata_bytes((path / ".metadata").read_bytes(), path / ".metadata")
    require_listed(path, manifest, [getattr(i, "relative_path", "") for i in metadata.storage_data.values()])
    meta = safe_torch_load(path / META_NAME, where=path / META_NAME)
    if not isinstance(meta, dict) or not isinstance(meta.get(SCHEMA.bookkeeping), dict):
        raise CheckpointError(f"{path / META_NAME} is not a lightning_fsdp checkpoint state file.")
    info = meta.pop(SCHEMA.bookkeeping)
    return metadata, meta, {k: tuple(v) for k, v in info[SCHEMA.tensor_map].items()}


def checks_before_reading(
    path: Path, manifest: Manifest, names: list[str], checksums: bool, every_byte: bool = False
) -> list[str]:
    """Problems with ``names`` before any of their bytes are parsed: every size; the checksums of the state files
    and of files without per-entry checksums (the others are checked entry by entry as they are read), or, with
    ``every_byte``, of every file."""
    as_read = [
        n for n in names if n in manifest.files and manifest.files[n].items and n not in STATE_FILES and not every_byte
    ]
    whole = [n for n in names if n in manifest.files and n not in as_read]
    try:
        return check_files(path, manifest, as_read, checksums=False) + check_files(path, manifest, whole, checksums=checksums)
    except OSError as err:
        return [f"a file could not be read ({type(err).__name__}: {err})"]


class CheckpointReader:
    """A committed sharded checkpoint, opened in one process: ``manifest``, ``metadata`` (DCP's), ``meta`` (the
    non-tensor state), ``paths`` (storage key → where the tensor sits in the checkpoint dict), tensors by key.

    Args:
        path: the checkpoint directory.
        verify: check checksums (state files now; shard entries as they are read). Sizes are always checked.
    """

    def __init__(self, path: Union[str, Path], verify: bool = True) -> None:
        self.path = Path(path)
        self.verify = bool(verify)
        self.manifest = read_manifest(self.path)
        problems = checks_before_reading(self.path, self.manifest, sorted(self.manifest.files), self.verify)
        if problems:
            raise_damaged(self.path, problems)
        self.metadata, self.meta, self.paths = read_state_files(self.path, self.manifest)
        self._files: dict[str, Any] = {}
        self._buffer = EntryBuffer()  # each entry read into it, its tensor copied out before the next

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def tensor_keys(self) -> list[str]:
        return [k for k, md in self.metadata.state_dict_metadata.items() if hasattr(md, "chunks")]

    def describe(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        md = self.metadata.state_dict_metadata[key]
        return md.properties.dtype, tuple(md.size)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor stored under ``key``, assembled from its chunks, each entry checked as it is read."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise CheckpointError(f"{self.path}: no tensor {key!r} in .metadata.")
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{self.path}: .metadata has no storage for a chunk of {key!r}.")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{self.path}: {key!r} was written with stream transforms, which are not read.")
            data = self._entry(info.relative_path, info.offset, info.length)
            part = self._buffer.load(data, where=f"{self.path / info.relative_path} ({key})")
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                raise CheckpointError(f"{self.path}: a chunk of {key!r} does not have the shape .metadata gives.")
            region = out
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, offset, size)
            region.copy_(part)
        return out

    def _entry(self, name: str, offset: int, length: int) -> memoryview:
        f = self._files.get(name)
        if f is None:
            if not is_safe_name(name):
                raise CheckpointError(f"{self.path}: .metadata names a file outside the checkpoint: {name!r}.")
            f = self._files[name] = open(self.path / name, "rb")
        return read_entry(f, self.path, name, (offset, length), self.manifest, self._buffer, checksums=self.verify)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

