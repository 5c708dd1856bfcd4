"""A Hugging Face model directory (or one ``.safetensors`` file), checked before a byte of weights is read.

``model.safetensors.index.json`` names the file of every tensor; a directory without one holds a single
``model.safetensors``. :meth:`HFDirectory.open` reads only headers (a few KiB per file) and refuses, naming the
problem: a missing shard, an index naming a file that is not there, tensors the index and the files disagree on,
a corrupt or lying header (safetensors checks offsets against the file size), or an entry that is not a regular
file (a FIFO or device would block or never end; symlinks to regular files, as in the Hub's cache, are fine).

:meth:`HFDirectory.identity` is what a checkpoint records to refer to these weights instead of storing them: the
index's hash and every file's size and checksum (CRC-32, hashed split over the ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from lightning_fsdp.checkpoint.checksums import HASH_ALGORITHM, hash_file
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import assign_files
from lightning_fsdp.checkpoint.safetensors_file import TORCH_DTYPES
from lightning_fsdp.formatting import short_list
from lightning_fsdp.parallel.collectives import all_gather_object, rank, world_size

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
#: files copied next to exported weights so the directory loads (and tokenizes) like the original
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of the directory is and what it is."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HFDirectory:
    """A validated set of safetensors files: every tensor's file, dtype and shape."""

    root: Path
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    index_sha256: str = ""
    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Union[str, Path]) -> HFDirectory:
        """Validate ``path`` (a directory or a ``.safetensors`` file) from its headers; a :class:`CheckpointError`
        naming the file and the fix otherwise."""
        path = Path(path)
        if path.is_file() and path.suffix == SUFFIX:
            root, names, weight_map, index_sha = path.parent, [path.name], None, ""
        elif path.is_dir():
            root = path
            index = root / INDEX_NAME
            if _exists(index):
                weight_map, index_sha = _read_index(index)
                names = sorted(set(weight_map.values()))
            elif _exists(root / SINGLE_NAME):
                weight_map, index_sha, names = None, "", [SINGLE_NAME]
            else:
                found = sorted(p.name for p in root.glob(f"*{SUFFIX}"))
                raise CheckpointError(
                    f"{root} is not a Hugging Face model directory: it has neither {INDEX_NAME} nor {SINGLE_NAME}"
                    + (f" (it has {short_list(found)} but no index naming them)" if found else "")
                    + ". Point `pretrained_weights` at the directory `save_pretrained` wrote, or at one .safetensors file."
                )
        else:
            raise CheckpointError(
                f"Pretrained weights {path} do not exist (or are neither a directory nor a .safetensors file)."
                " Check `pretrained_weights`."
            )
        tensors: dict[str, TensorInfo] = {}
        sizes: dict[str, int] = {}
        for name in names:
            file = _regular_file(root, name, "the index names it" if weight_map is not None else "")
            sizes[name] = file.stat().st_size
            for key, info in _read_header(file).items():
                if key in tensors:
                    raise CheckpointError(f"{root}: tensor {key!r} is in both {tensors[key].file} and {name}.")
                tensors[key] = TensorInfo(name, *info)
        if weight_map is not None:
            _check_index_agrees(root, weight_map, tensors)
        return cls(root, tuple(names), tensors, index_sha, sizes)

    def describe(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (v.dtype, v.shape) for k, v in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def hash_share(self) -> dict[str, str]:
        """Checksums of this rank's share of the files (split over the ranks by size), bounded by their sizes."""
        mine = assign_files(self.sizes, world_size())[rank()]
        return {name: hash_file(self.root / name, limit=self.sizes[name]).checksum for name in mine}

    def hash_all(self) -> dict[str, str]:
        """Checksums of every file, in this process alone (e.g. an export, process group or not)."""
        return {name: hash_file(self.root / name, limit=self.sizes[name]).checksum for name in self.files}

    def identity(self, digests: Mapping[str, str]) -> dict[str, Any]:
        """What a checkpoint records about these weights, from every rank's :meth:`hash_share`. Two directories with
        the same identity hold the same bytes (the path may differ)."""
        return {
            "path": str(self.root.resolve()),
            "index_sha256": self.index_sha256,
            "algorithm": HASH_ALGORITHM,
            "files": {name: {"size": self.sizes[name], "checksum": digests.get(name, "")} for name in self.files},
        }


def hash_directory(directory: HFDirectory, agree: Any) -> dict[str, Any]:
    """Every rank: hash its share (failures agreed through ``agree(fn, what)``), gather, return the identity."""
    share = agree(directory.hash_share, f"Hashing pretrained weights {directory.root}")
    digests: dict[str, str] = {}
    for part in all_gather_object(share):
        digests.update(part)
    return directory.identity(digests)


def identity_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two identities (empty: the same weights; the path may differ)."""
    problems = []
    if recorded.get("index_sha256") != current.get("index_sha256"):
        problems.append("its index changed")
    old, new = recorded.get("files", {}), current.get("files", {})
    for name in sorted(set(old) | set(new)):
        if name not in new:
            problems.append(f"{name} is missing")
        elif name not in old:
            problems.append(f"{name} is new")
        elif old[name] != new[name]:
            problems.append(f"{name} changed ({old[name]['size']} → {new[name]['size']} bytes, other checksum)")
    return problems


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _regular_file(root: Path, name: str, why: str = "") -> Path:
    """``root/name`` if it is a regular file (after following symlinks); refuses anything that could block or lie."""
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise CheckpointError(f"{root}: {name!r} is not a plain file name inside the directory.")
    path = root / name
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing{f' ({why})' if why else ''}: the model directory is incomplete. Download or copy it"
            " again (every shard the index names must be present)."
        ) from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err}.") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{path} is not a regular file (a FIFO, device or socket); refusing to read it, since it could block"
            " or never end. Replace it with the real file."
        )
    return path


def _read_index(index: Path) -> tuple[dict[str, str], str]:
    file = _regular_file(index.parent, index.name)
    data = file.read_bytes()
    try:
        weight_map = json.loads(data)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a valid safetensors index ({type(err).__name__}: {err}).") from None
    return weight_map, hashlib.sha256(data).hexdigest()


def _read_header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for key in f.keys():
                tensor_slice = f.get_slice(key)
                dtype = TORCH_DTYPES.get(tensor_slice.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{file}: tensor {key!r} has the unsupported dtype {tensor_slice.get_dtype()}.")
                out[key] = (dtype, tuple(tensor_slice.get_shape()))
            return out
    except SafetensorError as err:
        raise CheckpointError(
            f"{file} is not a valid safetensors file ({err}); it is truncated, damaged or was not written by"
            " safetensors. Download or copy it again."
        ) from None


def _check_index_agrees(root: Path, weight_map: Mapping[str, str], tensors: Mapping[str, TensorInfo]) -> None:
    not_found = sorted(k for k in weight_map if k not in tensors)
    elsewhere = sorted(k for k, f in weight_map.items() if k in tensors and tensors[k].file != f)
    unlisted = sorted(k for k in tensors if k not in weight_map)
    if not_found or elsewhere or unlisted:
        raise CheckpointError(
            f"{root / INDEX_NAME} does not agree with the files: tensors it names that no file holds"
            f" {short_list(not_found)}, in another file than it says {short_list(elsewhere)}, in a file but not in"
            f" the index {short_list(unlisted)}. The directory is inconsistent: download or copy it again."
        )


def side_files(root: Path) -> list[Path]:
    """The config and tokenizer files of a model directory (those that exist)."""
    return [root / name for name in SIDE_FILES if (root / name).is_file()]
