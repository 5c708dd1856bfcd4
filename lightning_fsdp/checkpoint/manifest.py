"""The manifest that makes a directory a checkpoint: every file with its size and checksum, plus provenance.

A sharded checkpoint is committed only after ``manifest.json`` is written, and a directory without a valid one is
not a checkpoint. Checksums are computed while the files are written (:class:`HashingWriter`), so a save does not
read its shards back; verification on load splits the files over the ranks (:func:`assign_files`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_fsdp.checkpoint.errors import CheckpointError

MANIFEST_NAME = "manifest.json"
META_NAME = "meta.pt"
FORMAT_NAME = "lightning_fsdp.sharded"
FORMAT_VERSION = 1
HASH_ALGORITHM = "sha256"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and its checksum (hex)."""

    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """What a committed sharded checkpoint contains and how it was written."""

    files: dict[str, FileEntry]
    world_size: int
    mesh: tuple[int, ...]
    state_dict_type: str
    target: str
    save_id: str
    format_version: int = FORMAT_VERSION
    hash_algorithm: str = HASH_ALGORITHM
    versions: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": self.format_version,
                "target": self.target,
                "save_id": self.save_id,
                "created": self.created,
                "world_size": self.world_size,
                "mesh": list(self.mesh),
                "state_dict_type": self.state_dict_type,
                "hash_algorithm": self.hash_algorithm,
                "versions": self.versions,
                "extra": self.extra,
                "files": {name: {"size": e.size, "checksum": e.checksum} for name, e in sorted(self.files.items())},
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path | str = "manifest.json") -> Manifest:
        """Parse and validate; any problem is a :class:`CheckpointError` naming ``where``."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(
                f"{where} is not valid JSON ({err}); the checkpoint is damaged or incomplete."
            ) from None
        try:
            if data.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT_NAME!r}")
            version = int(data["format_version"])
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version} is newer than this lightning_fsdp understands ({FORMAT_VERSION});"
                    " upgrade lightning_fsdp"
                )
            algorithm = str(data["hash_algorithm"])
            if algorithm not in hashlib.algorithms_guaranteed:
                raise ValueError(f"unknown hash_algorithm {algorithm!r}")
            files = {}
            for name, entry in data["files"].items():
                if not _is_safe_name(name):
                    raise ValueError(f"file name {name!r} is not a plain file name")
                files[name] = FileEntry(int(entry["size"]), str(entry["checksum"]))
            return cls(
                files=files,
                world_size=int(data["world_size"]),
                mesh=tuple(int(x) for x in data["mesh"]),
                state_dict_type=str(data["state_dict_type"]),
                target=str(data["target"]),
                save_id=str(data["save_id"]),
                format_version=version,
                hash_algorithm=algorithm,
                versions={str(k): str(v) for k, v in data.get("versions", {}).items()},
                created=float(data.get("created", 0.0)),
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{where} is not a valid checkpoint manifest: {err}.") from None


def _is_safe_name(name: str) -> bool:
    """Manifest entries are plain names inside the checkpoint directory (no paths that escape it)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\x00" not in name


def versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__}
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover
        pass
    from lightning_fsdp._version import __version__

    out["lightning_fsdp"] = __version__
    return out


def build_manifest(
    files: Mapping[str, FileEntry],
    *,
    world_size: int,
    mesh: Iterable[int],
    state_dict_type: str,
    target: str,
    save_id: str,
    extra: Optional[dict[str, Any]] = None,
) -> Manifest:
    return Manifest(
        files=dict(files),
        world_size=world_size,
        mesh=tuple(mesh),
        state_dict_type=state_dict_type,
        target=target,
        save_id=save_id,
        versions=versions(),
        created=time.time(),
        extra=dict(extra or {}),
    )


# -- checksums ----------------------------------------------------------------------------------------------------------
def new_hash(algorithm: str = HASH_ALGORITHM) -> Any:
    return hashlib.new(algorithm)


def hash_file(path: Path, algorithm: str = HASH_ALGORITHM) -> FileEntry:
    """Size and checksum of a file, read in 8 MiB chunks (``hashlib`` releases the GIL on large updates)."""
    h = new_hash(algorithm)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return FileEntry(size, h.hexdigest())


class HashingWriter(io.RawIOBase):
    """A binary file that hashes what is written to it; the entry is recorded when it closes cleanly."""

    def __init__(self, path: Path, on_close: Any = None, algorithm: str = HASH_ALGORITHM) -> None:
        super().__init__()
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._hash = new_hash(algorithm)
        self._size = 0
        self._on_close = on_close

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._file.write(view)
        if n is None:  # pragma: no cover - only for non-blocking raw files
            n = 0
        self._hash.update(view[:n])
        self._size += n
        return n

    def tell(self) -> int:
        return self._file.tell()

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def fsync(self) -> None:
        self.flush()
        os.fsync(self._file.fileno())

    @property
    def entry(self) -> FileEntry:
        return FileEntry(self._size, self._hash.hexdigest())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.close()
        finally:
            super().close()
        if self._on_close is not None:
            self._on_close(self.path, self.entry)

    def abort(self) -> None:
        """Close without recording (the write failed)."""
        self._on_close = None
        self.close()


class FileRecords:
    """Thread-safe ``{file name: FileEntry}`` of what this process wrote into one directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: dict[str, FileEntry] = {}

    def record(self, path: Path, entry: FileEntry) -> None:
        with self._lock:
            self.entries[Path(path).name] = entry

    def rename(self, old: Path, new: Path) -> None:
        with self._lock:
            if Path(old).name in self.entries:
                self.entries[Path(new).name] = self.entries.pop(Path(old).name)

    def snapshot(self) -> dict[str, FileEntry]:
        with self._lock:
            return dict(self.entries)


# -- verification -------------------------------------------------------------------------------------------------------
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def assign_files(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Split files over ranks for hashing: balanced by bytes, largest first, each to the least-loaded rank.

    Deterministic, so every rank computes the same assignment from the same manifest.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    loads = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        out[rank].append(name)
        loads[rank] += max(sizes[name], 1)
    return out


def check_files(root: Path, manifest: Manifest, names: Iterable[str], *, checksums: bool = True) -> list[str]:
    """Problems with ``names`` under ``root`` against the manifest: missing, wrong size, wrong checksum."""
    problems = []
    for name in names:
        entry = manifest.files[name]
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != entry.size:
            problems.append(f"{name} has {size} bytes, the manifest says {entry.size} (truncated or overwritten)")
            continue
        if checksums:
            actual = hash_file(path, manifest.hash_algorithm)
            if actual.checksum != entry.checksum:
                problems.append(
                    f"{name} fails its {manifest.hash_algorithm} checksum (the file was modified or damaged)"
                )
    return problems


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint directory ``path``; a :class:`CheckpointError` if it has none or a bad one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Checkpoint {path} does not exist. Check the path, or pass ckpt_path=None to start fresh."
        )
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory.")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint: it has no {MANIFEST_NAME}, so it was never committed (a save that did not"
            " finish, or a directory written by another tool). Load an earlier checkpoint, or delete this directory."
        )
    return Manifest.from_json(manifest_path.read_text(), manifest_path)


def require_listed(path: Path, manifest: Manifest, names: Iterable[str]) -> None:
    """Files about to be read must be covered by the manifest (so they were verified)."""
    unlisted = sorted(set(names) - set(manifest.files))
    if unlisted:
        raise CheckpointError(
            f"Checkpoint {path} is inconsistent: {unlisted[:5]} are read but not listed in its {MANIFEST_NAME}."
            " It was not written by this package or was modified; load another checkpoint."
        )


def verify_files(path: Path, manifest: Manifest, *, checksums: bool = True) -> None:
    """Single-process verification of every file of a checkpoint; raises with every problem found."""
    problems = check_files(Path(path), manifest, sorted(manifest.files), checksums=checksums)
    if problems:
        raise_damaged(Path(path), problems)


def raise_damaged(path: Path, problems: list[str]) -> None:
    shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
    raise CheckpointError(
        f"Checkpoint {path} is damaged and was not loaded: {shown}. Nothing was restored; load an earlier"
        " checkpoint (for example another epoch's, or re-save from a run that still has the state)."
    )
