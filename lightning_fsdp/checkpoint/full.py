"""The full format: one ordinary Lightning ``.ckpt`` file written by rank 0, loadable without this package.

Save: rank 0 writes the gathered checkpoint to a hidden temporary file, fsyncs and renames it into place. Load:
rank 0 checks the archive's CRCs, reads it with ``weights_only`` and checks keys, dtypes and shapes; the other
ranks receive only their shards, one tensor at a time (``broadcast_from_rank0``).
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint.checksums import kind_of
from lightning_fsdp.checkpoint.compatibility import check_count, check_entry_fits, check_fits, describe
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.load_options import LoadOptions
from lightning_fsdp.checkpoint.safe_load import safe_torch_load
from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.checkpoint.sharded import RESTORE_HINT, SAVE_HINT, agreed
from lightning_fsdp.checkpoint.state import (
    assemble_full_checkpoint,
    is_id_keyed,
    optimizer_state_to_fqns,
    plain_meta_and_tensors,
)
from lightning_fsdp.parallel.collectives import broadcast_object, is_distributed, on_rank_zero, rank


def save(checkpoint: Mapping[str, Any], path: Path) -> None:
    """Rank 0 writes one ordinary Lightning ``.ckpt`` (full tensors, integer-keyed optimizer state)."""

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        commit_ops.recover(path.parent)
        payload = full_payload(checkpoint)
        with commit_ops.staged(path) as staging, open(staging, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())

    agreed(on_rank_zero(write), f"Saving checkpoint {path}", hint=SAVE_HINT)


def full_payload(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A full checkpoint as plain Lightning expects it; its non-tensor part is checked to load with weights_only."""
    meta, tensors = plain_meta_and_tensors(checkpoint)
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    buffer.seek(0)
    safe_torch_load(buffer, where="the Lightning state being saved")
    return assemble_full_checkpoint(meta, {p: t.detach() for p, t in tensors.items()})


def load(path: Path, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], options: LoadOptions) -> dict[str, Any]:
    """Restore ``model`` (and ``optimizers``) from a full file (every rank); returns the rest of the checkpoint,
    with the ``options.model_entries`` asked for (keyed like the model, e.g. an EMA's) scattered into shards like the
    model's (rank 0 holds the file; no rank receives more than its shards)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from lightning_fsdp.sharding.quantize import quantized_names

    strict, model_entries = options.strict, options.model_entries
    if quantized_names(model):
        raise CheckpointError(
            f"{path} is a full checkpoint, which holds the base in full precision; this run holds it quantized"
            " (`quantize_base`). Resume from a sharded checkpoint of the quantized run, or start from the weights with"
            " `pretrained_weights=`."
        )
    current = describe({k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)})
    group_names = [param_group_names(model, opt) for opt in optimizers]
    holder: dict[str, Any] = {}

    def read() -> dict[str, Any]:
        check_zip(path, options.checksums)
        ckpt = safe_torch_load(path, where=path, mmap=zipfile.is_zipfile(path))
        if not isinstance(ckpt, dict):
            raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a Lightning checkpoint dict.")
        full_sd = ckpt.pop(SCHEMA.model, None)
        if full_sd is None:
            raise CheckpointError(f"{path} has no {SCHEMA.model!r}; it is not a Lightning checkpoint.")
        if not isinstance(full_sd, Mapping) or any(not isinstance(v, torch.Tensor) for v in full_sd.values()):
            raise CheckpointError(f"{path}: {SCHEMA.model!r} must map parameter names to tensors.")
        optim_states = ckpt.pop(SCHEMA.optimizers, None)
        full_sd = dict(full_sd)
        check_fits(path, describe(full_sd), current, strict=strict, what="model")
        for key in set(full_sd) - set(current):
            del full_sd[key]
        if optimizers and optim_states is not None:
            check_count(path, optim_states, optimizers)
            optim_states = [
                optimizer_state_to_fqns(o, names) if is_id_keyed(o) else o for o, names in zip(optim_states, group_names)
            ]
        entries = {key: ckpt.pop(key) for key in SCHEMA.model_like if isinstance(ckpt.get(key), Mapping)}
        for key, entry in entries.items():
            if key not in model_entries:
                continue
            check_entry_fits(path, describe(dict(entry)), current, what=key)
        holder.update(model=full_sd, optim=optim_states, entries={k: v for k, v in entries.items() if k in model_entries})
        return ckpt

    rest = broadcast_object(agreed(on_rank_zero(read), f"Loading checkpoint {path}"))
    assert rest is not None  # rank 0's checkpoint dict, on every rank
    has_optim = broadcast_object(holder.get("optim") is not None) and bool(optimizers)
    is_zero = rank() == 0
    broadcast = is_distributed()  # rank 0 alone holds the full tensors; the others receive their shards

    def apply() -> None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=strict)
        set_model_state_dict(model, holder["model"] if is_zero else {}, options=options)
        if has_optim:
            for i, opt in enumerate(optimizers):
                osd = holder["optim"][i] if is_zero else {}
                set_optimizer_state_dict(
                    model, opt, osd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
                )

    agreed(apply, f"Restoring checkpoint {path}", hint=RESTORE_HINT)
    names = broadcast_object({k: sorted(v) for k, v in holder.get("entries", {}).items()})
    if names:
        like = get_model_state_dict(model)
        rest.update(agreed(lambda: scatter_entries(names, holder.get("entries", {}), like), f"Loading checkpoint {path}"))
    holder.clear()
    rest.pop(SCHEMA.bookkeeping, None)
    return rest


def scatter_entries(
    names: Mapping[str, Sequence[str]], entries: Mapping[str, Mapping[str, torch.Tensor]], like: Mapping[str, Any]
) -> dict[str, dict[str, torch.Tensor]]:
    """Rank 0's full tensors of each entry → every rank's shards, placed like the model's tensor of that name."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, keys in names.items():
        out[key] = {}
        for name in keys:
            target = like[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            source = entries[key][name] if rank() == 0 else torch.empty(target.shape, dtype=local.dtype)
            source = source.to(device=local.device, dtype=local.dtype)
            if isinstance(target, DTensor):
                out[key][name] = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=0)
            else:
                if is_distributed():
                    torch.distributed.broadcast(source, src=0)
                out[key][name] = source
    return out


def param_group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
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


def check_zip(path: Path, checksums: bool) -> None:
    """A full checkpoint is a zip archive whose members carry CRC-32s: check them before anything is unpickled.
    Only a regular file is opened (a FIFO or device would block or never end)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise CheckpointError(f"{path} could not be read: {err}.") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is {kind_of(mode)}, not a checkpoint file; refusing to read it.")
    if not zipfile.is_zipfile(path):
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
