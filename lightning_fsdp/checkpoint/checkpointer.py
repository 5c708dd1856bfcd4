"""``Checkpointer``: sharded and full checkpoints of a sharded model, with an atomic commit and verified loads.

Save (every rank calls it):

1. rank 0 repairs/cleans leftovers of interrupted saves in the target's directory and creates a hidden staging
   directory; it writes ``meta.pt`` (all non-tensor Lightning state, as plain data);
2. every rank writes its own shards through ``torch.distributed.checkpoint`` (checksums are computed while
   writing); a failure on any rank reaches every rank;
3. rank 0 checks the staged files against what every rank reported, writes ``manifest.json``, fsyncs, and renames
   the directory into place (:mod:`lightning_fsdp.checkpoint.commit`). Only then may older checkpoints be pruned.

Load (every rank calls it): manifest → checksums (the files split over the ranks) → ``.metadata`` with a
restricted unpickler and ``meta.pt`` with ``weights_only`` → key/dtype/shape checks → only then is any state
changed: shards are read into the current (possibly differently sharded) model and optimizers.

Every step that can fail on one rank ends in an agreement (:func:`_agree`), so all ranks raise the same
:class:`CheckpointError` and none is left waiting in a collective.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import (
    MANIFEST_NAME,
    META_NAME,
    FileEntry,
    FileRecords,
    HashingWriter,
    Manifest,
    assign_files,
    build_manifest,
    check_files,
    raise_damaged,
    read_manifest,
    require_listed,
)
from lightning_fsdp.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_metadata_bytes,
    safe_torch_load,
)
from lightning_fsdp.checkpoint.state import (
    META_KEY,
    SHARDED_KEYS,
    TensorPath,
    extract_tensors,
    insert_tensors,
    is_id_keyed,
    optimizer_state_to_fqns,
    optimizer_state_to_ids,
    plain_checkpoint_meta,
    storage_key,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Test hook: seconds each rank sleeps after writing its shard files, before the ranks agree that the save is
#: complete (before ``.metadata``, the manifest and the commit), so a test can kill a rank mid-save. Unset normally.
PAUSE_ENV = "LIGHTNING_FSDP_TEST_PAUSE_AFTER_WRITE"
META_FORMAT_VERSION = 1


# -- process-group helpers ----------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s value on every rank (our own processes' plain data; nothing read from a checkpoint)."""
    if not _distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def _all_gather(obj: T) -> list[T]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _describe(err: BaseException) -> str:
    if isinstance(err, CheckpointError):
        return str(err)
    if isinstance(err, CheckpointException):
        parts = [f"rank {r}: {type(e).__name__}: {e}" for r, (e, _tb) in sorted(err.failures.items())]
        return "; ".join(parts) or str(err).splitlines()[0]
    return f"{type(err).__name__}: {err}"


def _agree(fn: Callable[[], T], what: str, on_error: Optional[Callable[[], None]] = None, hint: str = "") -> T:
    """Run ``fn`` on this rank; if it failed on any rank, every rank raises the same :class:`CheckpointError`.

    ``on_error`` runs (on every rank, errors ignored) before raising, e.g. to delete a staging directory;
    ``hint`` (what state things are in, what to do) ends the message of errors that are not ours already.
    """
    result: Any = None
    error: Optional[tuple[bool, str]] = None
    try:
        result = fn()
    except (Exception, CheckpointException) as err:  # CheckpointException derives from BaseException
        error = (isinstance(err, CheckpointError), _describe(err))
    errors = _all_gather(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    if on_error is not None:
        try:
            on_error()
        except Exception as cleanup_err:  # pragma: no cover - best effort
            log.warning("cleanup after a failed checkpoint operation failed: %s", cleanup_err)
    messages = list(dict.fromkeys(msg for _, (_, msg) in failed))
    if len(messages) == 1:
        detail = messages[0]
        if len(failed) < len(errors):
            detail += f" (on rank {', '.join(str(r) for r, _ in failed)})"
    else:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in failed)
    if len(messages) == 1 and all(is_ours for _, (is_ours, _) in failed):
        raise CheckpointError(detail)
    raise CheckpointError(f"{what} failed: {detail}." + (f" {hint}" if hint else ""))


def _noop() -> None:
    return None


SAVE_HINT = (
    "Nothing was committed: a previous checkpoint at this path is unchanged. Check the free space and permissions of"
    " the checkpoint directory on every node."
)
RESTORE_HINT = (
    "The model and optimizers may be partly restored: do not continue from this state. Check the checkpoint with"
    " `lightning_fsdp.checkpoint.verify_checkpoint`, or load another one."
)


def _single_process_ok(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """DCP warns that it assumes a single process when there is no process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


# -- writing ------------------------------------------------------------------------------------------------------------
class _RecordingFileSystem(FileSystem):
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


class _RecordingWriter(FileSystemWriter):
    def __init__(self, path: Path, records: FileRecords) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.fs = _RecordingFileSystem(records)

    def write_data(self, plan: Any, planner: Any) -> Future:
        result = super().write_data(plan, planner)
        _test_pause()
        return result


def _write_meta(path: Path, meta: dict[str, Any], records: FileRecords) -> None:
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


def _test_pause() -> None:
    seconds = float(os.environ.get(PAUSE_ENV, "0") or 0)
    if seconds > 0:
        log.warning("%s=%s: pausing after writing this rank's shards (test hook)", PAUSE_ENV, seconds)
        time.sleep(seconds)


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[TensorPath, torch.Tensor]]:
    """Lightning's checkpoint → (plain ``meta.pt`` content, ``{path: tensor}`` of model and optimizer tensors)."""
    meta, tensors = _plain_meta_and_tensors(checkpoint)
    keys: dict[str, TensorPath] = {}
    for path in tensors:
        key = storage_key(path)
        while key in keys:
            key += "#"
        keys[key] = path
    meta[META_KEY] = {"format_version": META_FORMAT_VERSION, "tensors": keys}
    return meta, tensors


def _plain_meta_and_tensors(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[TensorPath, torch.Tensor]]:
    """Model/optimizer tensors pulled out of their containers (skeletons stay), the rest made plain data."""
    meta: dict[str, Any] = {}
    tensors: dict[TensorPath, torch.Tensor] = {}
    for key, value in checkpoint.items():
        if key in SHARDED_KEYS:
            skeleton, found = extract_tensors(value, (key,))
            meta[key] = skeleton
            tensors.update(found)
        else:
            meta[key] = value
    return plain_checkpoint_meta(meta), tensors


@dataclass
class _PendingSave:
    """An async save whose shards are being written; committed at the next save, load or ``finalize``."""

    future: Future
    records: FileRecords
    staging: Path
    target: Path
    token: str
    mesh: tuple[int, ...]
    extra: dict[str, Any]
    started: float
    removals: list[Path] = field(default_factory=list)


# -- the checkpointer ---------------------------------------------------------------------------------------------------
class Checkpointer:
    """Saves and loads checkpoints of a sharded model; every rank calls every method (see the module docstring).

    Args:
        async_save: write shards in a background thread while training continues; the commit (manifest,
            rename) happens at the next save, load or :meth:`finalize`, where a failed write is raised on every rank.
        verify_checksums: check every file's checksum before loading (sizes are always checked).
    """

    def __init__(self, async_save: bool = False, verify_checksums: bool = True) -> None:
        self.async_save = bool(async_save)
        self.verify_checksums = bool(verify_checksums)
        self._pending: Optional[_PendingSave] = None
        self._async_group: Any = None

    # -- save ---------------------------------------------------------------------------------------------------------
    def save_sharded(self, checkpoint: Mapping[str, Any], path: Path, mesh_shape: Any = None) -> None:
        """Write ``checkpoint`` (with DTensor model/optimizer state) as a checkpoint directory at ``path``."""
        path = Path(path)
        self._commit_pending()
        token = _broadcast(commit_ops.new_token())
        staging = commit_ops.temp_path(path, commit_ops.STAGING, token)
        records = FileRecords()
        meta, tensors = _agree(lambda: split_checkpoint(checkpoint), f"Preparing checkpoint {path}")
        flat = {key: tensors[p] for key, p in meta[META_KEY]["tensors"].items()}

        def prepare() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            commit_ops.recover(path.parent)
            staging.mkdir()
            _write_meta(staging / META_NAME, meta, records)

        cleanup = self._cleanup(staging)
        _agree(prepare if _rank() == 0 else _noop, f"Saving checkpoint {path}", on_error=cleanup, hint=SAVE_HINT)
        mesh = _mesh_tuple(mesh_shape)
        extra = {k: checkpoint[k] for k in ("epoch", "global_step") if type(checkpoint.get(k)) is int}
        writer = _RecordingWriter(staging, records)
        import torch.distributed.checkpoint as dcp

        if self.async_save and _distributed():
            future = _agree(
                lambda: dcp.async_save(flat, storage_writer=writer, process_group=self._group_for_async()),
                f"Saving checkpoint {path}",
                on_error=cleanup,
                hint=SAVE_HINT,
            )
            self._pending = _PendingSave(future, records, staging, path, token, mesh, extra, time.time())
            return
        _agree(
            lambda: _single_process_ok(dcp.save, flat, storage_writer=writer, no_dist=not _distributed()),
            f"Writing the shards of checkpoint {path}",
            on_error=cleanup,
            hint=SAVE_HINT,
        )
        self._finish(records, staging, path, token, mesh, "sharded", extra)

    def save_full(self, checkpoint: Mapping[str, Any], path: Path, mesh_shape: Any = None) -> None:
        """Rank 0 writes one ordinary Lightning ``.ckpt`` (full tensors, integer-keyed optimizer state)."""
        path = Path(path)
        self._commit_pending()
        token = _broadcast(commit_ops.new_token())
        staging = commit_ops.temp_path(path, commit_ops.STAGING, token)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            commit_ops.recover(path.parent)
            payload = _full_payload(checkpoint)
            with open(staging, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            commit_ops.commit(staging, path)

        _agree(
            write if _rank() == 0 else _noop,
            f"Saving checkpoint {path}",
            on_error=self._cleanup(staging),
            hint=SAVE_HINT,
        )

    def _finish(
        self,
        records: FileRecords,
        staging: Path,
        target: Path,
        token: str,
        mesh: tuple[int, ...],
        state_dict_type: str,
        extra: dict[str, Any],
    ) -> None:
        """Every rank's shards are written: rank 0 verifies the staged directory, writes the manifest, commits."""
        written = _all_gather(records.snapshot())
        world = _world_size()

        def commit() -> None:
            files: dict[str, FileEntry] = {}
            for per_rank in written:
                files.update(per_rank)
            _check_staged(staging, files)
            manifest = build_manifest(
                files,
                world_size=world,
                mesh=mesh,
                state_dict_type=state_dict_type,
                target=target.name,
                save_id=token,
                extra=extra,
            )
            tmp = staging / (MANIFEST_NAME + ".tmp")
            with open(tmp, "w") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, staging / MANIFEST_NAME)
            commit_ops.fsync_path(staging)
            commit_ops.commit(staging, target)

        _agree(
            commit if _rank() == 0 else _noop,
            f"Committing checkpoint {target}",
            on_error=self._cleanup(staging),
            hint=SAVE_HINT,
        )

    @staticmethod
    def _cleanup(staging: Path) -> Callable[[], None]:
        def run() -> None:
            if _rank() == 0:
                commit_ops.delete(staging)

        return run

    def _group_for_async(self) -> Any:
        """Background writes need their own (gloo) group: collectives must not interleave with training's."""
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return

        def wait() -> None:
            getattr(pending.future, "upload_completion", pending.future).result()

        try:
            _agree(
                wait,
                f"Writing the shards of checkpoint {pending.target} (async)",
                on_error=self._cleanup(pending.staging),
                hint=SAVE_HINT,
            )
            p = pending
            self._finish(p.records, p.staging, p.target, p.token, p.mesh, "sharded", p.extra)
        except CheckpointError:
            if pending.removals:
                log.warning(
                    "Not removing %s: the checkpoint that replaces them failed.", [str(p) for p in pending.removals]
                )
            raise
        log.debug("checkpoint %s committed %.1fs after the save started", pending.target, time.time() - pending.started)
        for path in pending.removals:
            self._remove_now(path)

    def finalize(self) -> None:
        """Commit a pending async save (every rank, at teardown). Skipped while an exception is propagating:
        the other ranks may not reach this point, and a collective would hang."""
        if self._pending is None:
            return
        if sys.exc_info()[0] is not None:
            log.warning(
                "An exception is propagating: the async checkpoint %s was not committed (it is not a checkpoint;"
                " the next save in that directory deletes it).",
                self._pending.target,
            )
            self._pending = None
            return
        self._commit_pending()

    # -- remove -------------------------------------------------------------------------------------------------------
    def remove(self, path: Path) -> None:
        """Delete a checkpoint (file operations on rank 0). While an async save is pending, deferred until it commits."""
        path = Path(path)
        if self._pending is not None:
            self._pending.removals.append(path)
            return
        self._remove_now(path)

    @staticmethod
    def _remove_now(path: Path) -> None:
        if _rank() != 0:
            return
        try:
            commit_ops.remove(path)
        except OSError as err:
            warnings.warn(f"Could not remove the old checkpoint {path}: {err}. Delete it by hand.", stacklevel=3)

    # -- load ---------------------------------------------------------------------------------------------------------
    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        strict: bool = True,
    ) -> dict[str, Any]:
        """Restore ``model`` (and ``optimizers``) in place from a sharded directory or a full ``.ckpt`` file.

        Returns the rest of the Lightning checkpoint (epoch, loops, callbacks, schedulers, hyper-parameters, ...).
        """
        path = Path(path)
        self._commit_pending()

        def detect() -> str:
            if not path.exists():
                commit_ops.recover(path.parent, {path.name}, delete_leftovers=False)
            if path.is_dir():
                return "dir"
            if path.is_file():
                return "file"
            raise CheckpointError(
                f"Checkpoint {path} does not exist. Check the path (or pass ckpt_path=None to start fresh)."
            )

        kind = _broadcast(_agree(detect if _rank() == 0 else _noop, f"Loading checkpoint {path}"))
        if kind == "dir":
            return self._load_sharded(path, model, list(optimizers), strict)
        return self._load_full(path, model, list(optimizers), strict)

    def _load_sharded(
        self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        text = _agree(lambda: read_manifest(path).to_json() if _rank() == 0 else None, f"Loading checkpoint {path}")
        text = _broadcast(text)
        manifest = Manifest.from_json(text, path / MANIFEST_NAME)
        world = _world_size()
        if manifest.world_size != world:
            rank_zero_info(
                f"Resharding checkpoint {path}: saved on {manifest.world_size} ranks (mesh {list(manifest.mesh)}),"
                f" loading on {world}."
            )
        mine = assign_files({n: e.size for n, e in manifest.files.items()}, world)[_rank()]
        problems = _agree(
            lambda: check_files(path, manifest, mine, checksums=self.verify_checksums), f"Verifying {path}"
        )
        all_problems = [p for per_rank in _all_gather(problems) for p in per_rank]
        if all_problems:
            raise_damaged(path, sorted(all_problems))

        def read_state() -> tuple[Any, dict[str, Any]]:
            require_listed(path, manifest, [".metadata", META_NAME])
            metadata = load_metadata_bytes((path / ".metadata").read_bytes(), path / ".metadata")
            require_listed(path, manifest, [getattr(i, "relative_path", "") for i in metadata.storage_data.values()])
            meta = safe_torch_load(path / META_NAME, where=path / META_NAME)
            if not isinstance(meta, dict) or not isinstance(meta.get(META_KEY), dict):
                raise CheckpointError(f"{path / META_NAME} is not a lightning_fsdp checkpoint state file.")
            return metadata, meta

        metadata, meta = _agree(read_state, f"Loading checkpoint {path}")
        info = meta.pop(META_KEY)
        saved_paths: dict[str, TensorPath] = {k: tuple(v) for k, v in info["tensors"].items()}
        key_of = {p: k for k, p in saved_paths.items()}

        def build_targets() -> tuple[dict[str, Any], list[dict[str, Any]], dict[TensorPath, torch.Tensor]]:
            model_sd = get_model_state_dict(model)
            optim_sds = (
                [get_optimizer_state_dict(model, opt) for opt in optimizers] if _has_optim(meta, optimizers) else []
            )
            targets: dict[TensorPath, torch.Tensor] = {}
            for name, value in model_sd.items():
                if isinstance(value, torch.Tensor):
                    targets[("state_dict", name)] = value
            for i, osd in enumerate(optim_sds):
                _, found = extract_tensors(osd["state"], ("optimizer_states", i, "state"))
                targets.update(found)
            _check_compatible(path, meta, optimizers, targets, saved_paths, metadata, strict)
            return model_sd, optim_sds, targets

        model_sd, optim_sds, targets = _agree(build_targets, f"Loading checkpoint {path}")
        to_load = {key_of[p]: t for p, t in targets.items() if p in key_of}
        import torch.distributed.checkpoint as dcp

        _agree(
            lambda: _single_process_ok(
                dcp.load,
                to_load,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(allow_partial_load=True),
                no_dist=not _distributed(),
            ),
            f"Reading the shards of checkpoint {path}",
            hint=RESTORE_HINT,
        )

        def apply() -> None:
            set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
            for i, (opt, osd) in enumerate(zip(optimizers, optim_sds)):
                saved = meta["optimizer_states"][i]
                loaded = {p[3:]: t for p, t in targets.items() if p[:3] == ("optimizer_states", i, "state")}
                state = {k: v for k, v in saved.get("state", {}).items() if k in osd["state"]}
                state = insert_tensors(state, loaded)
                set_optimizer_state_dict(model, opt, {"state": state, "param_groups": saved["param_groups"]})

        _agree(apply, f"Restoring checkpoint {path}", hint=RESTORE_HINT)
        for key in SHARDED_KEYS:
            meta.pop(key, None)
        return meta

    def _load_full(
        self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        current = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
        group_names = [_param_group_names(model, opt) for opt in optimizers]
        holder: dict[str, Any] = {}

        def read() -> dict[str, Any]:
            _check_zip(path, self.verify_checksums)
            ckpt = safe_torch_load(path, where=path, mmap=_is_zip(path))
            if not isinstance(ckpt, dict):
                raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a Lightning checkpoint dict.")
            full_sd = ckpt.pop("state_dict", None)
            if full_sd is None:
                raise CheckpointError(f"{path} has no 'state_dict'; it is not a Lightning checkpoint.")
            if not isinstance(full_sd, Mapping) or any(not isinstance(v, torch.Tensor) for v in full_sd.values()):
                raise CheckpointError(f"{path}: 'state_dict' must map parameter names to tensors.")
            optim_states = ckpt.pop("optimizer_states", None)
            full_sd = dict(full_sd)
            _check_keys_and_dtypes(
                path, {k: (v.dtype, tuple(v.shape)) for k, v in full_sd.items()}, current, strict, what="model"
            )
            for key in set(full_sd) - set(current):
                del full_sd[key]
            if optimizers and optim_states is not None:
                if len(optim_states) != len(optimizers):
                    raise CheckpointError(
                        f"{path} holds {len(optim_states)} optimizer state(s), the model configures"
                        f" {len(optimizers)}. Return the same optimizers from `configure_optimizers`."
                    )
                optim_states = [
                    optimizer_state_to_fqns(o, names) if is_id_keyed(o) else o
                    for o, names in zip(optim_states, group_names)
                ]
            holder.update(model=full_sd, optim=optim_states)
            return ckpt

        rest = _broadcast(_agree(read if _rank() == 0 else _noop, f"Loading checkpoint {path}"))
        has_optim = _broadcast(holder.get("optim") is not None) and bool(optimizers)
        is_zero = _rank() == 0

        broadcast = _distributed()  # rank 0 alone holds the full tensors; the others receive their shards

        def apply() -> None:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=strict)
            set_model_state_dict(model, holder["model"] if is_zero else {}, options=options)
            if has_optim:
                for i, opt in enumerate(optimizers):
                    osd = holder["optim"][i] if is_zero else {}
                    set_optimizer_state_dict(
                        model, opt, osd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
                    )

        _agree(apply, f"Restoring checkpoint {path}", hint=RESTORE_HINT)
        holder.clear()
        rest.pop(META_KEY, None)
        return rest


# -- helpers ------------------------------------------------------------------------------------------------------------
def _mesh_tuple(mesh_shape: Any) -> tuple[int, ...]:
    if mesh_shape is None:
        return (_world_size(),)
    if hasattr(mesh_shape, "replicate") and hasattr(mesh_shape, "shard"):
        return (int(mesh_shape.replicate), int(mesh_shape.shard))
    return tuple(int(x) for x in mesh_shape)


def _has_optim(meta: Mapping[str, Any], optimizers: Sequence[Any]) -> bool:
    return bool(optimizers) and meta.get("optimizer_states") is not None


def _param_group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names per param group, in the optimizer's order (the first name of a tied parameter)."""
    name_of: dict[int, str] = {}
    for name, param in model.named_parameters():
        name_of.setdefault(id(param), name)
    try:
        return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise CheckpointError(
            "The optimizer holds a parameter that is not in the model; build it from `self.parameters()`."
        ) from None


def _full_payload(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A full checkpoint as plain Lightning expects it: plain containers, integer-keyed optimizer states."""
    ckpt = dict(checkpoint)
    if ckpt.get("optimizer_states") is not None:
        ckpt["optimizer_states"] = [
            s if is_id_keyed(s) or not s.get("param_groups") else optimizer_state_to_ids(s)
            for s in ckpt["optimizer_states"]
        ]
    meta, tensors = _plain_meta_and_tensors(ckpt)
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    buffer.seek(0)
    safe_torch_load(buffer, where="the Lightning state being saved")
    for key in SHARDED_KEYS:
        if key in meta:
            meta[key] = insert_tensors(meta[key], {p: t.detach() for p, t in tensors.items()}, (key,))
    return meta


def _check_staged(staging: Path, files: Mapping[str, FileEntry]) -> None:
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
    metadata = load_metadata_bytes((staging / ".metadata").read_bytes(), staging / ".metadata")
    referenced = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    unknown = sorted(str(r) for r in referenced - set(files))
    if unknown:
        raise CheckpointError(f"The staged checkpoint {staging} references files that were not written: {unknown}.")


def _check_keys_and_dtypes(
    where: Path,
    saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    current: Mapping[str, torch.Tensor],
    strict: bool,
    what: str,
) -> None:
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where} does not match the {what}: missing keys {_short(missing)}, unexpected keys {_short(unexpected)}."
            " Load the checkpoint of this model, or set `strict_loading = False` on the LightningModule to load the"
            " keys that match."
        )
    if missing or unexpected:
        warnings.warn(
            f"Loading {where} non-strictly: {what} keys not in the checkpoint {_short(missing)} keep their current"
            f" values; checkpoint keys not in the {what} {_short(unexpected)} are ignored.",
            stacklevel=4,
        )
    bad = []
    for key in sorted(set(saved) & set(current)):
        dtype, shape = saved[key]
        tensor = current[key]
        if dtype != tensor.dtype:
            bad.append(f"{key}: checkpoint {dtype}, {what} {tensor.dtype}")
        elif tuple(shape) != tuple(tensor.shape):
            bad.append(f"{key}: checkpoint shape {tuple(shape)}, {what} {tuple(tensor.shape)}")
    if bad:
        raise CheckpointError(
            f"{where} does not fit the {what} ({len(bad)} tensor(s)): {_short(bad)}. Tensors are never cast or"
            " reshaped silently: use the same precision and model configuration as when the checkpoint was saved."
        )


def _check_compatible(
    path: Path,
    meta: Mapping[str, Any],
    optimizers: Sequence[Any],
    targets: Mapping[TensorPath, torch.Tensor],
    saved_paths: Mapping[str, TensorPath],
    metadata: Any,
    strict: bool,
) -> None:
    """Keys, dtypes and shapes of the sharded checkpoint against the current model and optimizers."""
    saved_info: dict[TensorPath, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, p in saved_paths.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "properties"):
            raise CheckpointError(
                f"{path}: .metadata has no tensor {key!r} listed in meta.pt; the checkpoint is inconsistent."
            )
        saved_info[p] = (md.properties.dtype, tuple(md.size))
    model_saved = {p[1]: v for p, v in saved_info.items() if p[0] == "state_dict" and len(p) == 2}
    model_current = {p[1]: t for p, t in targets.items() if p[0] == "state_dict"}
    _check_keys_and_dtypes(path, model_saved, model_current, strict, what="model")
    if not optimizers:
        return
    saved_states = meta.get("optimizer_states")
    if saved_states is None:
        return
    if len(saved_states) != len(optimizers):
        raise CheckpointError(
            f"{path} holds {len(saved_states)} optimizer state(s), the model configures {len(optimizers)}."
            " Return the same optimizers from `configure_optimizers` as when the checkpoint was saved."
        )
    for i in range(len(optimizers)):
        prefix = ("optimizer_states", i, "state")
        saved = {storage_key(p[3:]): v for p, v in saved_info.items() if p[:3] == prefix}
        current = {storage_key(p[3:]): t for p, t in targets.items() if p[:3] == prefix}
        _check_keys_and_dtypes(path, saved, current, strict, what=f"optimizer {i} state")


def _short(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    if not items:
        return "[]"
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', ... {len(items) - limit} more' if len(items) > limit else ''}]"


def _is_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def _check_zip(path: Path, checksums: bool) -> None:
    """A full checkpoint is a zip archive whose members carry CRC-32s: check them before anything is unpickled."""
    if not _is_zip(path):
        try:
            with open(path, "rb") as f:
                head = f.read(2)
        except OSError as err:
            raise CheckpointError(f"{path} could not be read: {err}.") from None
        if head[:1] == b"\x80":  # a legacy (non-zip) torch.save file; weights_only still applies
            return
        raise CheckpointError(f"{path} is not a checkpoint file (not a zip archive): it is truncated or damaged.")
    if not checksums:
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged ({err}); it was not loaded.") from None
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: its member {bad!r} fails its CRC check; it was not loaded.")
