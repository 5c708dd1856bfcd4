"""The rendezvous store and distributed checkpoint (DCP) internals: the store failures are relayed through, what
DCP's metadata pickle may contain, and how its readers and writers are driven."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_fsdp._torch_compat import base
from lightning_fsdp._torch_compat.base import requirement

if TYPE_CHECKING:
    from torch.distributed import Store


# -- c10d: the rendezvous store ----------------------------------------------------------------------------------------
def default_store() -> Optional[Store]:
    """The default process group's store (the rendezvous TCPStore every rank is connected to), or ``None``."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError) as err:
        base.warn_lost(
            "failure_relay",
            "a failing rank cannot tell the others at once; they wait until the collective timeout",
            f"({type(err).__name__}: {err})",
        )
        return None


def _probe_default_store() -> bool:
    import torch.distributed as dist

    return callable(getattr(dist.distributed_c10d, "_get_default_store", None))


# -- distributed checkpoint (DCP) -------------------------------------------------------------------------------------
def dcp_unpickle_allowlist() -> dict[tuple[str, str], Any]:
    """The globals DCP's ``.metadata`` pickle is made of, keyed ``(module, name)``."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    return allowed


def load_in_place(storage: torch.UntypedStorage, file: Any) -> Any:
    """``torch.load(weights_only=True)`` of the archive ``file`` reads, whose bytes ``storage`` holds from offset 0:
    tensors view ``storage``, as ``torch.load(mmap=True)`` views a file, instead of being copied out of it."""
    import torch.serialization as ser

    if not base.fast_paths()["in_place_load"]:
        base.warn_lost("in_place_load", "every checkpoint entry is copied once more while it loads")
        return torch.load(file, map_location="cpu", weights_only=True)
    with ser._open_zipfile_reader(file) as zip_file:
        return ser._load(zip_file, "cpu", ser._weights_only_unpickler, overall_storage=storage, encoding="utf-8")


def dcp_metadata_path(reader: Any, rank: Optional[int] = None) -> Any:
    """Where a ``FileSystemReader`` keeps ``.metadata``."""
    return reader._get_metadata_path(rank)


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` of a nested state dict, as DCP's default planner does for byte entries."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def hf_storage_info(path: str, shape: Sequence[int], dtype: torch.dtype) -> Any:
    """DCP's record of where one tensor of a safetensors file is, as ``HuggingFaceStorageReader`` reads it."""
    try:
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    except ImportError as err:
        raise requirement("torch.distributed.checkpoint._hf_utils._HFStorageInfo", "sharded safetensors loading", err) from err
    return _HFStorageInfo(relative_path=path, shape=torch.Size(shape), dtype=dtype)


def use_file_system(writer: Any, file_system: Any) -> None:
    """Make a ``FileSystemWriter`` write through ``file_system`` (e.g. one that hashes what it writes)."""
    if not hasattr(writer, "fs"):
        raise requirement("FileSystemWriter.fs", "sharded checkpoints", AttributeError("no attribute 'fs'"))
    writer.fs = file_system


base.PROBES["failure_relay"] = _probe_default_store
base.PROBES["in_place_load"] = lambda: base.has("torch.serialization", "_open_zipfile_reader", "_load", "_weights_only_unpickler")
