"""Whole tensors out of a verified DCP checkpoint directory, one at a time, in one process (no process group).

Each chunk is located through ``.metadata`` (read with the restricted unpickler) and read with ``weights_only``;
nothing outside the checkpoint directory is ever opened.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import is_safe_name
from lightning_fsdp.checkpoint.safe_load import read_metadata, safe_torch_load


class ShardReader:
    """Reads whole tensors out of a verified DCP checkpoint directory, one at a time."""

    def __init__(self, root: Path, metadata: Optional[Any] = None) -> None:
        self.root = Path(root)
        self.metadata = metadata if metadata is not None else read_metadata(self.root)
        self._files: dict[str, Any] = {}

    def tensor_keys(self) -> list[str]:
        return [k for k, md in self.metadata.state_dict_metadata.items() if hasattr(md, "chunks")]

    def nbytes(self, key: str) -> int:
        md = self.metadata.state_dict_metadata[key]
        return int(torch.Size(md.size).numel()) * torch.empty((), dtype=md.properties.dtype).element_size()

    def read(self, key: str) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise CheckpointError(f"{self.root}: no tensor {key!r} in .metadata.")
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{self.root}: .metadata has no storage for a chunk of {key!r}.")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.root}: {key!r} was written with stream transforms, which are not supported."
                )
            data = self._slice(info.relative_path, info.offset, info.length)
            part = safe_torch_load(io.BytesIO(data), where=f"{self.root / info.relative_path} ({key})")
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                raise CheckpointError(f"{self.root}: a chunk of {key!r} does not have the shape .metadata gives.")
            region = out
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, offset, size)
            region.copy_(part)
        return out

    def _slice(self, name: str, offset: int, length: int) -> bytes:
        f = self._files.get(name)
        if f is None:
            if not is_safe_name(name):
                raise CheckpointError(f"{self.root}: .metadata names a file outside the checkpoint: {name!r}.")
            f = self._files[name] = open(self.root / name, "rb")
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{self.root / name} is truncated.")
        return data

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
