"""The sharded format, written: a directory every rank writes its own shards into, committed atomically.

Save (every rank calls each step; :class:`~lightning_fsdp.checkpoint.checkpointer.Checkpointer` orders them):

1. :func:`stage`: rank 0 repairs/cleans leftovers of interrupted saves in the target's directory, creates a hidden
   staging directory and writes ``meta.pt`` (all non-tensor Lightning state, as plain data);
2. :func:`write_shards`: every rank writes its shards through ``torch.distributed.checkpoint``, hashing each file
   while it is written;
3. :func:`commit`: rank 0 checks the staged files against what every rank reported, writes ``manifest.json``,
   fsyncs, and renames the directory into place (:mod:`~lightning_fsdp.checkpoint.commit`).

Loading is :mod:`~lightning_fsdp.checkpoint.sharded_load`.

Every step that can fail on one rank ends in an agreement, so all ranks raise the same :class:`CheckpointError`.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Generator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_fsdp._torch_compat import use_file_system
from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint.checksums import FileEntry, FileRecords, HashingWriter
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME, META_NAME, build_manifest, write_manifest
from lightning_fsdp.checkpoint.safe_load import (
    load_metadata_bytes,
    safe_torch_load,
)
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.checkpoint.state import split_checkpoint
from lightning_fsdp.parallel.collectives import (
    agree,
    all_gather_object,
    broadcast_object,
    is_distributed,
    on_rank_zero,
    rank,
    world_size,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

T = TypeVar("T")

SAVE_HINT = (
    "Nothing was committed: a previous checkpoint at this path is unchanged. Check the free space and permissions of"
    " the checkpoint directory on every node."
)
RESTORE_HINT = (
    "The model and optimizers may be partly restored: do not continue from this state. Check the checkpoint with"
    " `lightning-fsdp verify`, or load another one."
)


def agreed(fn: Callable[[], T], what: str, **kwargs: Any) -> T:
    """:func:`~lightning_fsdp.parallel.collectives.agree`, raising :class:`CheckpointError`."""
    return agree(fn, what, error_type=CheckpointError, **kwargs)


def single_process_ok(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """DCP warns that it assumes a single process when there is no process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


def read_into(targets: dict[str, torch.Tensor], reader: Any, planner: Any, what: str, hint: str) -> None:
    """Every rank: DCP reads its part of ``targets`` in place (resharding as needed); failures agreed. When every
    failure is a :class:`CheckpointError` (a damaged entry, named by the reader), that error is raised as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def load() -> None:
        try:
            single_process_ok(dcp.load, targets, storage_reader=reader, planner=planner, no_dist=not is_distributed())
        except CheckpointException as err:
            failures = [failure for failure, _ in err.failures.values()]
            if failures and all(isinstance(f, CheckpointError) for f in failures):
                raise failures[0] from None
            raise

    agreed(load, what, hint=hint)


# -- writing ------------------------------------------------------------------------------------------------------------
class RecordingFileSystem(FileSystem):
    """DCP's file system, but every file written is hashed on the fly and recorded (name, size, checksum)."""

    def __init__(self, records: FileRecords) -> None:
        super().__init__()
        self.records = records

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = HashingWriter(Path(path), self.records.record)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        self.records.rename(Path(path), Path(new_path))


class RecordingWriter(FileSystemWriter):
    """DCP's writer (one file per rank, fsynced, never overwriting) through a :class:`RecordingFileSystem`."""

    def __init__(self, path: Path, records: FileRecords) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        use_file_system(self, RecordingFileSystem(records))


def write_meta(path: Path, meta: dict[str, Any], records: FileRecords) -> None:
    """``torch.save`` the non-tensor state, hashed while written, fsynced, and checked to load with weights_only."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    buffer.seek(0)
    safe_torch_load(buffer, where=f"the Lightning state being saved to {path.parent}")
    writer = HashingWriter(path, records.record)
    try:
        writer.write(buffer.getbuffer())
        writer.fsync()
    except BaseException:
        writer.abort()
        raise
    writer.close()


@dataclass
class StagedSave:
    """A sharded save in progress: where it is staged, what each file hashed to, what the manifest will record."""

    target: Path
    staging: Path
    token: str
    records: FileRecords
    mesh: tuple[int, ...]
    extra: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: what DCP wrote (returned by a synchronous ``dcp.save``; an async save's is read back from ``.metadata``)
    metadata: Any = None

    def cleanup(self) -> None:
        """On every rank after a failure: rank 0 deletes the staging directory."""
        if rank() == 0:
            commit_ops.delete(self.staging)


def stage(checkpoint: Mapping[str, Any], path: Path, mesh: tuple[int, ...]) -> StagedSave:
    """Prepare a save: split the checkpoint, create the staging directory and write ``meta.pt`` (rank 0)."""
    token = broadcast_object(commit_ops.new_token())
    staging = commit_ops.temp_path(path, commit_ops.STAGING, token)
    meta, tensors = agreed(lambda: split_checkpoint(checkpoint), f"Preparing checkpoint {path}")
    extra = {k: checkpoint[k] for k in SCHEMA.progress if type(checkpoint.get(k)) is int}
    save = StagedSave(path, staging, token, FileRecords(), mesh, extra)
    save.tensors = {key: tensors[p] for key, p in meta[SCHEMA.bookkeeping][SCHEMA.tensor_map].items()}

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        commit_ops.recover(path.parent)
        staging.mkdir()
        write_meta(staging / META_NAME, meta, save.records)

    agreed(on_rank_zero(prepare), f"Saving checkpoint {path}", on_error=save.cleanup, hint=SAVE_HINT)
    return save


def write_shards(save: StagedSave, async_group: Optional[ProcessGroup] = None) -> Union[Future, AsyncSaveResponse, None]:
    """Every rank writes its shards; with ``async_group`` in the background (returns what to wait for: a future, or
    torch's response whose ``upload_completion`` is the future)."""
    import torch.distributed.checkpoint as dcp

    writer = RecordingWriter(save.staging, save.records)
    tensors, save.tensors = save.tensors, {}
    if async_group is not None:
        return agreed(
            lambda: dcp.async_save(tensors, storage_writer=writer, process_group=async_group),
            f"Saving checkpoint {save.target}",
            on_error=save.cleanup,
            hint=SAVE_HINT,
        )
    save.metadata = agreed(
        lambda: single_process_ok(dcp.save, tensors, storage_writer=writer, no_dist=not is_distributed()),
        f"Writing the shards of checkpoint {save.target}",
        on_error=save.cleanup,
        hint=SAVE_HINT,
    )
    return None


def commit(save: StagedSave, state_dict_type: str = "sharded") -> None:
    """Every rank's shards are written: rank 0 verifies the staged directory, writes the manifest, commits."""
    written = all_gather_object(save.records.snapshot())
    world = world_size()

    def run() -> None:
        files: dict[str, FileEntry] = {}
        for per_rank in written:
            files.update(per_rank)
        check_staged(save.staging, files, save.metadata)
        manifest = build_manifest(
            files,
            world_size=world,
            mesh=save.mesh,
            state_dict_type=state_dict_type,
            target=save.target.name,
            save_id=save.token,
            extra=save.extra,
        )
        write_manifest(save.staging, manifest)
        commit_ops.fsync_path(save.staging)
        commit_ops.commit(save.staging, save.target)

    agreed(on_rank_zero(run), f"Committing checkpoint {save.target}", on_error=save.cleanup, hint=SAVE_HINT)


def check_staged(staging: Path, files: Mapping[str, FileEntry], metadata: Any = None) -> None:
    """The staged directory holds exactly the files the ranks reported, at the sizes they wrote."""
    present = {p.name: p.stat().st_size for p in staging.iterdir() if p.name != MANIFEST_NAME + ".tmp"}
    missing = sorted(set(files) - set(present))
    extra = sorted(set(present) - set(files))
    wrong = sorted(n for n in set(files) & set(present) if present[n] != files[n].size)
    if missing or extra or wrong:
        raise CheckpointError(
            f"The staged checkpoint {staging} does not match what the ranks wrote (missing {missing}, unexpected"
            f" {extra}, wrong size {wrong}); it was not committed. Check the file system (is it shared by all ranks?)."
        )
    if metadata is None:
        metadata = load_metadata_bytes((staging / ".metadata").read_bytes(), staging / ".metadata")
    referenced = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    unknown = sorted(str(r) for r in referenced - set(files))
    if unknown:
        raise CheckpointError(f"The staged checkpoint {staging} references files that were not written: {unknown}.")
    ranges = {name: {(o, n) for o, n, _ in e.items} or {(0, e.size)} for name, e in files.items()}
    unhashed = sorted(
        f"{info.relative_path} bytes {info.offset}..{info.offset + info.length}"
        for info in metadata.storage_data.values()
        if (info.offset, info.length) not in ranges[info.relative_path]
    )
    if unhashed:  # each entry must have its own checksum, so that a load can check what it reads
        raise CheckpointError(
            f"The staged checkpoint {staging} has entries without their own checksum ({unhashed[:3]}); it was not"
            " committed. The DCP writer wrote its files differently from what this version expects."
        )
