"""The sharded format, read: verified before any state changes, resharded to the current world size and mesh.

:func:`load`: manifest → checksums (the files split over the ranks) → ``.metadata`` with a restricted unpickler and
``meta.pt`` with ``weights_only`` → key/dtype/shape checks → the referenced base weights, if any → only then is any
state changed: shards are read into the current (possibly differently sharded) model and optimizers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_fsdp.checkpoint.base_weights import BaseResolver, pop_reference, require_resolver
from lightning_fsdp.checkpoint.compatibility import check_count, check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import (
    MANIFEST_NAME,
    META_NAME,
    Manifest,
    assign_files,
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
from lightning_fsdp.checkpoint.sharded import RESTORE_HINT, agreed, read_into
from lightning_fsdp.checkpoint.state import (
    META_KEY,
    SHARDED_KEYS,
    TensorPath,
    extract_tensors,
    insert_tensors,
    storage_key,
)
from lightning_fsdp.parallel.collectives import (
    all_gather_object,
    broadcast_object,
    on_rank_zero,
    rank,
    world_size,
)


def read_state_files(path: Path, manifest: Manifest) -> tuple[Any, dict[str, Any], dict[str, TensorPath]]:
    """``.metadata`` (restricted unpickler), ``meta.pt`` (weights_only) and the storage-key → tensor-path map, each
    file checked to be covered by the (verified) manifest first."""
    require_listed(path, manifest, [".metadata", META_NAME])
    metadata = load_metadata_bytes((path / ".metadata").read_bytes(), path / ".metadata")
    require_listed(path, manifest, [getattr(i, "relative_path", "") for i in metadata.storage_data.values()])
    meta = safe_torch_load(path / META_NAME, where=path / META_NAME)
    if not isinstance(meta, dict) or not isinstance(meta.get(META_KEY), dict):
        raise CheckpointError(f"{path / META_NAME} is not a lightning_fsdp checkpoint state file.")
    info = meta.pop(META_KEY)
    return metadata, meta, {k: tuple(v) for k, v in info["tensors"].items()}


def verify(path: Path, checksums: bool) -> Manifest:
    """Every rank: read the manifest (rank 0) and verify its share of the files; the same error on every rank."""
    text = broadcast_object(agreed(on_rank_zero(lambda: read_manifest(path).to_json()), f"Loading checkpoint {path}"))
    manifest = Manifest.from_json(text, path / MANIFEST_NAME)
    mine = assign_files({n: e.size for n, e in manifest.files.items()}, world_size())[rank()]
    problems = agreed(lambda: check_files(path, manifest, mine, checksums=checksums), f"Verifying {path}")
    all_problems = [p for per_rank in all_gather_object(problems) for p in per_rank]
    if all_problems:
        raise_damaged(path, sorted(all_problems))
    return manifest


def load(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    checksums: bool = True,
    resolve_base: Optional[BaseResolver] = None,
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizers`` from the sharded checkpoint ``path`` (every rank). Returns the rest of
    the Lightning checkpoint. A checkpoint that refers to frozen base weights has them restored by
    ``resolve_base`` (after every check, before its own tensors are read)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    manifest = verify(path, checksums)
    if manifest.world_size != world_size():
        rank_zero_info(
            f"Resharding checkpoint {path}: saved on {manifest.world_size} ranks (mesh {list(manifest.mesh)}),"
            f" loading on {world_size()}."
        )
    metadata, meta, saved_paths = agreed(lambda: read_state_files(path, manifest), f"Loading checkpoint {path}")
    reference = agreed(lambda: pop_reference(meta, path), f"Loading checkpoint {path}")
    if reference is not None:
        resolve_base = require_resolver(reference, resolve_base, path)
    key_of = {p: k for k, p in saved_paths.items()}
    has_optim = bool(optimizers) and meta.get("optimizer_states") is not None

    def build_targets() -> tuple[dict[str, Any], list[dict[str, Any]], dict[TensorPath, torch.Tensor]]:
        model_sd = get_model_state_dict(model)
        optim_sds = [get_optimizer_state_dict(model, opt) for opt in optimizers] if has_optim else []
        targets: dict[TensorPath, torch.Tensor] = {
            ("state_dict", name): value for name, value in model_sd.items() if isinstance(value, torch.Tensor)
        }
        for i, osd in enumerate(optim_sds):
            targets.update(extract_tensors(osd["state"], ("optimizer_states", i, "state"))[1])
        referenced = reference.keys if reference is not None else ()
        check_compatible(path, meta, optimizers, targets, saved_paths, metadata, strict, referenced)
        return model_sd, optim_sds, targets

    model_sd, optim_sds, targets = agreed(build_targets, f"Loading checkpoint {path}")
    if reference is not None and resolve_base is not None:
        resolve_base(reference)  # the frozen base first: it is not in this checkpoint
        model_sd = {k: v for k, v in model_sd.items() if k not in set(reference.keys)}
    to_load = {key_of[p]: t for p, t in targets.items() if p in key_of}
    reader, planner = SafeFileSystemReader(path), SafeLoadPlanner(allow_partial_load=True)
    read_into(to_load, reader, planner, f"Reading the shards of checkpoint {path}", RESTORE_HINT)

    def apply() -> None:
        # keys were checked above; the base's keys are not in `model_sd` (restored by `resolve_base`)
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict and reference is None))
        for i, (opt, osd) in enumerate(zip(optimizers, optim_sds)):
            saved = meta["optimizer_states"][i]
            loaded = {p[3:]: t for p, t in targets.items() if p[:3] == ("optimizer_states", i, "state")}
            state = {k: v for k, v in saved.get("state", {}).items() if k in osd["state"]}
            set_optimizer_state_dict(
                model, opt, {"state": insert_tensors(state, loaded), "param_groups": saved["param_groups"]}
            )

    agreed(apply, f"Restoring checkpoint {path}", hint=RESTORE_HINT)
    for key in SHARDED_KEYS:
        meta.pop(key, None)
    return meta


def check_compatible(
    path: Path,
    meta: Mapping[str, Any],
    optimizers: Sequence[Any],
    targets: Mapping[TensorPath, torch.Tensor],
    saved_paths: Mapping[str, TensorPath],
    metadata: Any,
    strict: bool,
    referenced: Sequence[str] = (),
) -> None:
    """Keys, dtypes and shapes of the sharded checkpoint against the current model and optimizers; ``referenced``
    model keys come from the checkpoint's base weights instead."""
    saved_info: dict[TensorPath, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, p in saved_paths.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "properties"):
            raise CheckpointError(
                f"{path}: .metadata has no tensor {key!r} listed in meta.pt; the checkpoint is inconsistent."
            )
        saved_info[p] = (md.properties.dtype, tuple(md.size))
    model_saved = {p[1]: v for p, v in saved_info.items() if p[0] == "state_dict" and len(p) == 2}
    model_current = describe({p[1]: t for p, t in targets.items() if p[0] == "state_dict"})
    model_saved.update({k: model_current[k] for k in referenced if k in model_current})
    check_fits(path, model_saved, model_current, strict=strict, what="model")
    saved_states = meta.get("optimizer_states")
    if not optimizers or saved_states is None:
        return
    check_count(path, saved_states, optimizers)
    for i in range(len(optimizers)):
        prefix = ("optimizer_states", i, "state")
        saved = {storage_key(p[3:]): v for p, v in saved_info.items() if p[:3] == prefix}
        current = describe({storage_key(p[3:]): t for p, t in targets.items() if p[:3] == prefix})
        check_fits(path, saved, current, strict=strict, what=f"optimizer {i} state")
