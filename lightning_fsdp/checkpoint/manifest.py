"""The manifest that makes a directory a checkpoint: every file with its size and checksum, plus provenance.

A sharded checkpoint is committed only after ``manifest.json`` is written, and a directory without a valid one is
not a checkpoint. Checksums are computed while the files are written (:class:`HashingWriter`), so a save does not
read its shards back. Since format 2, a shard file has one checksum per DCP entry, so a load verifies what it reads
as it reads it; files of format 1 manifests are verified in a pass before the load (:func:`assign_files`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_fsdp.checkpoint.checksums import (
    ALGORITHMS,
    HASH_ALGORITHM,
    FileEntry,
    NotARegularFile,
    check_items,
    gap_in,
    hash_file,
    kind_of,
    require_regular,
)
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.fixes import current_wording

MANIFEST_NAME = "manifest.json"
META_NAME = "meta.pt"
FORMAT_NAME = "lightning_fsdp.sharded"
#: 2: per-entry checksums of shard files (``items``); 1: one checksum per file (still read)
FORMAT_VERSION = 2


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
                "files": {name: _entry_json(e) for name, e in sorted(self.files.items())},
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
            if algorithm not in ALGORITHMS:
                raise ValueError(f"unknown hash_algorithm {algorithm!r}")
            files = {}
            for name, entry in data["files"].items():
                if not is_safe_name(name):
                    raise ValueError(f"file name {name!r} is not a plain file name")
                files[name] = _entry_from_json(entry)
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


def _entry_json(entry: FileEntry) -> dict[str, Any]:
    if entry.items:
        return {"size": entry.size, "items": [list(item) for item in entry.items]}
    return {"size": entry.size, "checksum": entry.checksum}


def _entry_from_json(data: Mapping[str, Any]) -> FileEntry:
    size = int(data["size"])
    if "items" not in data:
        return FileEntry(size, str(data["checksum"]))
    items = tuple((int(o), int(n), str(c)) for o, n, c in data["items"])
    gap = gap_in(items, size)
    if gap is not None:
        raise ValueError(gap)
    return FileEntry(size, "", items)


def is_safe_name(name: str) -> bool:
    """Manifest entries are plain names inside the checkpoint directory (no paths that escape it)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\x00" not in name


def versions() -> dict[str, str]:
    import torch

    out: dict[str, str] = {"torch": torch.__version__}
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


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``directory`` durably: a temporary file, fsynced, renamed into place."""
    tmp = Path(directory) / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(directory) / MANIFEST_NAME)


# -- verification -------------------------------------------------------------------------------------------------------
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def shard_rank(name: str) -> Optional[int]:
    """The rank that wrote the DCP shard file ``name`` (``__<rank>_<n>.distcp``); ``None`` for other files."""
    match = _RANK_FILE.match(name)
    return int(match.group(1)) if match else None


def assign_files(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Split files over ranks for hashing: each rank's own shard file (``__<rank>_*.distcp``) to that rank — the one
    that reads it for loading at the same world size, so its bytes are hashed where they are then read from the page
    cache — and the rest balanced by bytes, largest first, each to the least-loaded rank.

    Deterministic, so every rank computes the same assignment from the same manifest.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    loads = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    rest = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = shard_rank(name)
        if rank is not None and rank < world_size:
            out[rank].append(name)
            loads[rank] += max(sizes[name], 1)
        else:
            rest.append(name)
    for name in rest:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        out[rank].append(name)
        loads[rank] += max(sizes[name], 1)
    return out


def check_files(root: Path, manifest: Manifest, names: Iterable[str], *, checksums: bool = True) -> list[str]:
    """Problems with ``names`` under ``root`` against the manifest: not a regular file, missing, wrong size, wrong
    checksum. No file is read past the size the manifest gives."""
    problems = []
    for name in names:
        entry = manifest.files[name]
        path = root / name
        try:
            size = require_regular(path).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except NotARegularFile as err:
            problems.append(f"{err} (refused: it could block, never end, or lie outside the checkpoint)")
            continue
        if size != entry.size:
            problems.append(f"{name} has {size} bytes, the manifest says {entry.size} (truncated or overwritten)")
            continue
        if checksums and entry.items:
            problem = check_items(path, entry, manifest.hash_algorithm)
            if problem:
                problems.append(f"{problem} (the file was modified or damaged)")
        elif checksums:
            actual = hash_file(path, manifest.hash_algorithm, limit=entry.size)
            if actual.checksum != entry.checksum or actual.size != entry.size:
                problems.append(
                    f"{name} fails its {manifest.hash_algorithm} checksum (the file was modified or damaged)"
                )
    return problems


def check_entries(path: Path) -> None:
    """Every entry of a checkpoint directory must be a regular file: symlinks (to ``/dev/zero``, or to a file
    elsewhere), devices, FIFOs and sockets are refused by name before anything is opened."""
    bad = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            bad.append(f"{entry.name} ({kind_of(mode)})")
    if bad:
        raise CheckpointError(
            f"Checkpoint {path} holds entries that are not regular files: {', '.join(bad)}. A checkpoint is read only"
            " through regular files inside its directory (a link, device or FIFO could block, never end, or point"
            " outside it); nothing was read. Replace them with the files themselves."
        )


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint directory ``path``; a :class:`CheckpointError` if it has none or a bad one,
    or if the directory holds anything but regular files."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Checkpoint {path} does not exist. Check the path, or {current_wording().start_fresh} to start fresh."
        )
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory.")
    manifest_path = path / MANIFEST_NAME
    if not (manifest_path.exists() or manifest_path.is_symlink()):
        if (path / ".metadata").is_file():  # a complete DCP save by another tool (ModelParallelStrategy, torchtitan)
            raise CheckpointError(
                f"{path} is not a checkpoint: it has no {MANIFEST_NAME}. It looks like a DCP checkpoint written by"
                " another tool (Lightning's ModelParallelStrategy, plain torch.distributed.checkpoint); to load it"
                f" with fsdp_custom, seal it first (checks it is complete, hashes it, writes the manifest):"
                f" `lightning-fsdp seal {path}`."
            )
        raise CheckpointError(
            f"{path} is not a checkpoint: it has no {MANIFEST_NAME}, so it was never committed (a save that did not"
            " finish, or a directory written by another tool). Load an earlier checkpoint, or delete this directory."
            f" If another tool wrote it completely, `lightning-fsdp seal {path}` checks it and makes it loadable."
        )
    check_entries(path)
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
