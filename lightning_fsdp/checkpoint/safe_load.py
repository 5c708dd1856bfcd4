"""Loading without executing code from the checkpoint.

``torch.distributed.checkpoint`` stores its ``.metadata`` as a pickle and reads it (and any non-tensor entry)
with an unrestricted unpickler: a crafted file runs code. Here:

- ``.metadata`` is read by :class:`MetadataUnpickler`, which only resolves the DCP metadata dataclasses,
  ``torch.Size``, dtypes/layouts, paths and a few builtins; any other global is refused before it is imported.
- :class:`SafeFileSystemReader` uses it, and :class:`SafeLoadPlanner` reads byte entries with ``weights_only``.
- everything we ``torch.load`` goes through :func:`safe_torch_load` (``weights_only=True``), whose refusals
  become a :class:`CheckpointError` that names the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_fsdp._torch_compat import dcp_metadata_path, dcp_set_element, dcp_unpickle_allowlist
from lightning_fsdp.checkpoint.errors import CheckpointError

_ALLOWED_CLASSES: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if _ALLOWED_CLASSES:
        return _ALLOWED_CLASSES
    import builtins
    import collections
    import pathlib

    _ALLOWED_CLASSES.update(dcp_unpickle_allowlist())
    _ALLOWED_CLASSES[("torch", "Size")] = torch.Size
    _ALLOWED_CLASSES[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path):
        _ALLOWED_CLASSES[("pathlib", cls.__name__)] = cls
    for name in ("set", "frozenset", "slice", "complex"):
        _ALLOWED_CLASSES[("builtins", name)] = getattr(builtins, name)
    return _ALLOWED_CLASSES


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allowlist (it could run code)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP ``.metadata``: resolves only the globals DCP metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafePickleError(f"global {module}.{name} is not allowed in checkpoint metadata")


def load_metadata_bytes(data: bytes, where: Path | str) -> Metadata:
    """Unpickle DCP metadata safely; anything else (or a crafted pickle) is a :class:`CheckpointError`."""
    try:
        obj = MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as err:
        raise CheckpointError(
            f"Refusing to load {where}: {err}. The file may have been crafted to run code when loaded; it was not"
            " executed. Use a checkpoint from a trusted source."
        ) from None
    except Exception as err:
        raise CheckpointError(f"{where} is not readable checkpoint metadata ({type(err).__name__}: {err}).") from None
    if not isinstance(obj, Metadata):
        raise CheckpointError(f"{where} holds a {type(obj).__name__}, not checkpoint metadata.")
    return obj


def read_metadata(checkpoint_dir: Path) -> Metadata:
    path = Path(checkpoint_dir) / ".metadata"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {checkpoint_dir} is not a complete checkpoint.") from None
    return load_metadata_bytes(data, path)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :class:`MetadataUnpickler` (tensors are already
    read with ``weights_only=True`` by DCP)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(dcp_metadata_path(self, rank))
        metadata = load_metadata_bytes(path.read_bytes(), path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads byte (non-tensor) entries with ``torch.load(weights_only=True)`` instead of a plain unpickler."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = safe_torch_load(value, where=f"checkpoint entry {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_torch_load(f: str | Path | BinaryIO, *, where: Any = None, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` on CPU; refusals and corrupt files become :class:`CheckpointError`."""
    where = where if where is not None else f
    try:
        kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
        if mmap:
            kwargs["mmap"] = True
        return torch.load(f, **kwargs)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()
        detail = next(
            (line.strip() for line in first if "Unsupported" in line or "global" in line.lower()),
            first[-1] if first else "",
        )
        raise CheckpointError(
            f"Refusing to load {where}: it contains objects that need code to be executed to load"
            f" ({detail}). Nothing from it was executed. Use a checkpoint from a trusted source, or re-save it with"
            " plain data (tensors, numbers, strings, lists, dicts)."
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{where} could not be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''});"
            " the file is truncated or damaged."
        ) from None
