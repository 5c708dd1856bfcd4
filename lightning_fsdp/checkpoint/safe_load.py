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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_fsdp._torch_compat import dcp_metadata_path, dcp_set_element, dcp_unpickle_allowlist, load_in_place
from lightning_fsdp.checkpoint.checksums import digest
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
        storage_meta: Optional[StorageMeta] = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def read_entry(
    f: Any, root: Path, name: str, where: tuple[int, int], manifest: Any, into: EntryBuffer, checksums: bool = True
) -> memoryview:
    """The bytes of one entry of ``root/name`` (open as ``f``), read once into the reused buffer ``into`` (a view of
    it is returned), never past the size the manifest gives, and checked against the entry's own checksum before
    anything parses them (when the manifest has one)."""
    offset, length = where
    end = offset + length
    entry = manifest.files.get(name)
    if entry is None:
        raise CheckpointError(f"Checkpoint {root}: {name} is read but not listed in its manifest.")
    if end > entry.size:
        raise CheckpointError(
            f"Checkpoint {root} is inconsistent: .metadata places an entry at bytes {offset}..{end} of {name}, which"
            f" has {entry.size} bytes in the manifest."
        )
    f.seek(offset)
    data = into.view(length)
    if f.readinto(data) != length:
        raise CheckpointError(f"Checkpoint {root} is damaged: {name} ends inside bytes {offset}..{end}.")
    if checksums and entry.items:
        expected = entry.item_checksums.get(where)
        if expected is None:
            raise CheckpointError(
                f"Checkpoint {root} is inconsistent: bytes {offset}..{end} of {name} are not an entry its manifest"
                " checksummed."
            )
        if digest(data, manifest.hash_algorithm) != expected:
            raise CheckpointError(
                f"Checkpoint {root} is damaged: {name} fails its {manifest.hash_algorithm} checksum in bytes"
                f" {offset}..{end} (the file was modified or damaged). The entries read before it are already"
                " restored: do not continue from this state; load an earlier checkpoint."
            )
    return data


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview, without copying it (``io.BytesIO`` would)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self.view) - self.position))
        b[:n] = self.view[self.position : self.position + n]
        self.position += n
        return n


class EntryBuffer:
    """One reused buffer for checkpoint entries: each entry is read into it once (no fresh pages per entry),
    checked, then loaded with its tensors viewing the buffer rather than copied out of it. A loaded tensor is valid
    until the next entry is read, so it must be copied into its target first (DCP's readers do that)."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def view(self, length: int) -> memoryview:
        if self._bytes.numel() < length:
            self._bytes = torch.empty(length, dtype=torch.uint8)
        return self._bytes.numpy().data[:length]

    def load(self, data: memoryview, where: Any) -> Any:
        """``torch.load(weights_only=True)`` of the entry ``data`` (a view this buffer returned)."""
        with _refusals(where):
            return load_in_place(self._bytes.untyped_storage(), _MemoryFile(data))


class VerifyingFileSystemReader(SafeFileSystemReader):
    """DCP's reader, reading each entry of a file once and checking it before it is parsed or copied anywhere.

    Each file is opened once; the entries this rank needs are read in file order, each into memory exactly once,
    checked against its checksum in the manifest (``FileEntry.items``), then unpickled with ``weights_only`` from
    memory. A file whose manifest entry has no per-entry checksums must have been verified before the load. A
    mismatch raises a :class:`CheckpointError` naming the file and the bytes; tensors read before it may already be in
    the model (the caller raises on every rank, so nothing continues from that state).
    """

    def __init__(self, path: Path | str, manifest: Any) -> None:
        super().__init__(path)
        self.root = Path(path)
        self.manifest = manifest

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        per_file: dict[str, list[Any]] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        for name, requests in per_file.items():
            self._read_file(name, sorted(requests, key=lambda r: self.storage_data[r.storage_index].offset), planner)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, requests: list[Any], planner: Any) -> None:
        from torch.distributed.checkpoint.planner import LoadItemType

        last: tuple[Any, Any] = (None, b"")
        buffer = EntryBuffer()
        with open(self.root / name, "rb") as f:
            for request in requests:
                info = self.storage_data[request.storage_index]
                where = (info.offset, info.length)
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(f"{self.root / name}: entries written with stream transforms are not read.")
                if last[0] != where:  # an entry several requests need is read and checked once
                    last = (where, read_entry(f, self.root, name, where, self.manifest, buffer))
                data = last[1]
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(bytes(data)))
                    continue
                tensor = buffer.load(data, where=f"{self.root / name} (bytes {info.offset}..)")
                for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                    if length < tensor.size(dim):
                        tensor = tensor.narrow(dim, offset, length)
                target = planner.resolve_tensor(request).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(
                        f"{self.root / name}: an entry holds shape {tuple(tensor.size())} where .metadata says"
                        f" {tuple(target.size())}; the checkpoint is inconsistent."
                    )
                target.copy_(tensor)
                planner.commit_tensor(request, target)


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
    with _refusals(where if where is not None else f):
        kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
        if mmap:
            kwargs["mmap"] = True
        return torch.load(f, **kwargs)


@contextmanager
def _refusals(where: Any) -> Iterator[None]:
    """``torch.load``'s refusals (a global the restricted unpickler will not resolve) and read errors, as a
    :class:`CheckpointError` naming ``where``."""
    try:
        yield
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
