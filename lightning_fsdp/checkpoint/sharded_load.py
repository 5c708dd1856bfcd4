"""The sharded format, read: verified as it is read, resharded to the current world size and mesh.

:func:`load`: manifest → every file's size, and the state files' checksums → ``.metadata`` with a restricted
unpickler and ``meta.pt`` with ``weights_only`` → key/dtype/shape checks → the referenced base weights, if any → the
shards, each entry read once and checked against its checksum before it is parsed
(:class:`~lightning_fsdp.checkpoint.safe_load.VerifyingFileSystemReader`). A damaged entry raises on every rank,
naming the file; tensors read before it may already be in the model, so the caller must not continue (the Trainer
does not). Files without per-entry checksums (format-1 manifests, sealed directories) are checked in a pass before
any state changes, and ``verify_before_load`` does that for every file (two reads of every byte).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fsdp.checkpoint.base_weights import (
    check_quantization,
    pop_quantized,
    pop_reference,
    require_resolver,
)
from lightning_fsdp.checkpoint.compatibility import check_count, check_entry_fits, check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.load_options import LoadOptions
from lightning_fsdp.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    assign_files,
    raise_damaged,
    read_manifest,
)
from lightning_fsdp.checkpoint.reader import STATE_FILES, checks_before_reading, read_state_files
from lightning_fsdp.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, VerifyingFileSystemReader
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath
from lightning_fsdp.checkpoint.sharded import RESTORE_HINT, agreed, read_into
from lightning_fsdp.checkpoint.state import extract_tensors, insert_tensors, storage_key
from lightning_fsdp.parallel.collectives import (
    all_gather_object,
    any_rank,
    broadcast_object,
    on_rank_zero,
    rank,
    world_size,
)


def agreed_manifest(path: Path) -> Manifest:
    """Rank 0 reads the manifest (the directory's entries checked first); every rank gets it, or the same error."""
    text = broadcast_object(agreed(on_rank_zero(lambda: read_manifest(path).to_json()), f"Loading checkpoint {path}"))
    assert isinstance(text, str)  # rank 0 read it, or every rank raised
    return Manifest.from_json(text, path / MANIFEST_NAME)


def shard_share(manifest: Manifest) -> list[str]:
    """The shard files this rank verifies (its own first; see ``assign_files``)."""
    sizes = {n: e.size for n, e in manifest.files.items() if n not in STATE_FILES}
    return assign_files(sizes, world_size())[rank()]


def raise_if_damaged(path: Path, problems: list[str]) -> None:
    """Every rank: if any rank found a problem, every rank raises the same error listing all of them."""
    if any_rank(bool(problems)):
        raise_damaged(path, sorted({p for per_rank in all_gather_object(problems) for p in per_rank}))


def load(path: Path, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], options: LoadOptions) -> dict[str, Any]:
    """Restore ``model`` and ``optimizers`` from the sharded checkpoint ``path`` (every rank). Returns the rest of
    the Lightning checkpoint. A checkpoint that refers to frozen base weights has them restored by
    ``options.resolve_base`` (after every check, before its own tensors are read). ``model_entries``: the entries keyed
    like the model (``SCHEMA.model_like``, e.g. an EMA's) that a callback will take, returned resharded like the
    model; other such entries are not read (they would cost memory for nothing).

    Sizes (and the checksums of files read unverified) are checked in a background thread while the (already
    verified) state files are parsed and the targets built, which changes nothing. The shards' entries are then
    checked as they are read (``verify_before_load``: every file is hashed first, as in format 1).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    strict, checksums, model_entries = options.strict, options.checksums, options.model_entries
    resolve_base, verify_before_load = options.resolve_base, options.verify_before_load
    manifest = agreed_manifest(path)
    if manifest.world_size != world_size():
        rank_zero_info(
            f"Resharding checkpoint {path}: saved on {manifest.world_size} ranks (mesh {list(manifest.mesh)}),"
            f" loading on {world_size()}."
        )

    def prepare() -> tuple[Any, ...]:
        from lightning_fsdp.sharding.quantize import quantized_names

        metadata, meta, saved_paths = read_state_files(path, manifest)
        reference = pop_reference(meta, path)
        quantized = pop_quantized(meta, path)
        check_quantization(path, quantized, quantized_names(model))
        has_optim = bool(optimizers) and meta.get(SCHEMA.optimizers) is not None
        model_sd = get_model_state_dict(model)
        optim_sds = [get_optimizer_state_dict(model, opt) for opt in optimizers] if has_optim else []
        targets: dict[TensorPath, torch.Tensor] = {
            SCHEMA.model_path(name): value for name, value in model_sd.items() if isinstance(value, torch.Tensor)
        }
        for i, osd in enumerate(optim_sds):
            targets.update(extract_tensors(osd[SCHEMA.optimizer_state], SCHEMA.optimizer_state_prefix(i))[1])
        targets.update(model_like_targets(saved_paths, model_sd, model_entries))
        # not in the checkpoint: the base weights it refers to, and weights quantized from the model as built
        referenced = tuple(dict.fromkeys([*(reference.keys if reference else ()), *(quantized.names if quantized else ())]))
        check_compatible(path, meta, optimizers, targets, saved_paths, metadata, strict, referenced, model_entries)
        return meta, saved_paths, referenced, reference, model_sd, optim_sds, targets

    with ThreadPoolExecutor(1, thread_name_prefix="lightning_fsdp-verify") as pool:
        shards = pool.submit(checks_before_reading, path, manifest, shard_share(manifest), checksums, verify_before_load)
        problems = checks_before_reading(path, manifest, list(STATE_FILES), checksums, every_byte=True)
        prepared: Any = None
        if not problems:
            try:
                prepared = prepare()
            except (Exception, CheckpointException) as err:  # agreed below, after the damage check
                prepared = err
        problems += shards.result()
    raise_if_damaged(path, problems)
    meta, saved_paths, referenced, reference, model_sd, optim_sds, targets = agreed(
        lambda: _result(prepared), f"Loading checkpoint {path}"
    )
    if reference is not None:
        resolve_base = require_resolver(reference, resolve_base, path)
    key_of = {p: k for k, p in saved_paths.items()}
    if reference is not None and resolve_base is not None:
        resolve_base(reference)  # the frozen base first: it is not in this checkpoint
    model_sd = {k: v for k, v in model_sd.items() if k not in set(referenced)}
    to_load = {key_of[p]: t for p, t in targets.items() if p in key_of}
    reader = VerifyingFileSystemReader(path, manifest) if checksums else SafeFileSystemReader(path)
    planner = SafeLoadPlanner(allow_partial_load=True)
    read_into(to_load, reader, planner, f"Reading the shards of checkpoint {path}", RESTORE_HINT)

    def apply() -> None:
        # keys were checked above; the base's keys are not in `model_sd` (restored by `resolve_base`)
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict and not referenced))
        for i, (opt, osd) in enumerate(zip(optimizers, optim_sds)):
            saved = meta[SCHEMA.optimizers][i]
            loaded = SCHEMA.optimizer_state_items(targets, i)
            state = {k: v for k, v in saved.get(SCHEMA.optimizer_state, {}).items() if k in osd[SCHEMA.optimizer_state]}
            groups = saved[SCHEMA.param_groups]
            set_optimizer_state_dict(
                model, opt, {SCHEMA.optimizer_state: insert_tensors(state, loaded), SCHEMA.param_groups: groups}
            )

    agreed(apply, f"Restoring checkpoint {path}", hint=RESTORE_HINT)
    for key in SCHEMA.sharded:
        meta.pop(key, None)
    for key in SCHEMA.model_like:  # e.g. the EMA average: read resharded, handed to the callback that saved it
        entry = {SCHEMA.model_key(p): t for p, t in targets.items() if SCHEMA.is_entry_tensor(p, key)}
        if entry:
            meta[key] = entry
    return meta


def _result(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


def model_like_targets(
    saved_paths: Mapping[str, TensorPath], model_sd: Mapping[str, Any], wanted: Sequence[str]
) -> dict[TensorPath, Any]:
    """Fresh tensors, sharded like the model's, for the saved ``wanted`` entries keyed like the model (keys the
    model lacks get none: :func:`check_compatible` names them)."""
    entries = [key for key in SCHEMA.model_like if key in wanted]
    return {
        p: torch.empty_like(model_sd[SCHEMA.model_key(p)])
        for p in saved_paths.values()
        if any(SCHEMA.is_entry_tensor(p, key) for key in entries)
        and isinstance(model_sd.get(SCHEMA.model_key(p)), torch.Tensor)
    }


def check_compatible(
    path: Path,
    meta: Mapping[str, Any],
    optimizers: Sequence[Any],
    targets: Mapping[TensorPath, torch.Tensor],
    saved_paths: Mapping[str, TensorPath],
    metadata: Any,
    strict: bool,
    referenced: Sequence[str] = (),
    model_entries: Sequence[str] = (),
) -> None:
    """Keys, dtypes and shapes of the sharded checkpoint against the current model and optimizers; ``referenced``
    model keys come from the checkpoint's base weights instead; the ``model_entries`` read must fit the model."""
    saved_info: dict[TensorPath, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, p in saved_paths.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "properties"):
            raise CheckpointError(
                f"{path}: .metadata has no tensor {key!r} listed in meta.pt; the checkpoint is inconsistent."
            )
        saved_info[p] = (md.properties.dtype, tuple(md.size))
    model_saved = {SCHEMA.model_key(p): v for p, v in saved_info.items() if SCHEMA.is_model_tensor(p)}
    model_current = describe({SCHEMA.model_key(p): t for p, t in targets.items() if SCHEMA.is_model_tensor(p)})
    model_saved.update({k: model_current[k] for k in referenced if k in model_current})
    check_fits(path, model_saved, model_current, strict=strict, what="model")
    for key in model_entries:  # read into tensors shaped like the model's
        saved = {SCHEMA.model_key(p): v for p, v in saved_info.items() if SCHEMA.is_entry_tensor(p, key)}
        check_entry_fits(path, saved, model_current, what=key)
    saved_states = meta.get(SCHEMA.optimizers)
    if not optimizers or saved_states is None:
        return
    check_count(path, saved_states, optimizers)
    for i in range(len(optimizers)):
        saved = {storage_key(p): v for p, v in SCHEMA.optimizer_state_items(saved_info, i).items()}
        current = describe({storage_key(p): t for p, t in SCHEMA.optimizer_state_items(targets, i).items()})
        check_fits(path, saved, current, strict=strict, what=f"optimizer {i} state")
