"""Pure transformations of a Lightning checkpoint dict: no files, no process group.

- :func:`extract_tensors` / :func:`insert_tensors` split the tensor leaves of ``state_dict`` and
  ``optimizer_states`` (written as shards) from everything else (written to ``meta.pt``).
- :func:`to_plain` turns hyper-parameters and other Lightning state into plain containers, so that
  ``torch.load(..., weights_only=True)`` can read them back without running code.
- :func:`optimizer_state_to_ids` / :func:`optimizer_state_to_fqns` convert between the parameter-name keyed
  optimizer state of ``torch.distributed.checkpoint.state_dict`` and ``torch.optim``'s integer ids.
- :func:`split_checkpoint` / :func:`assemble_full_checkpoint`: a Lightning checkpoint → (``meta.pt`` content, flat
  tensors) for a sharded save, and back to one plain Lightning checkpoint (full saves and consolidation).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath

#: the version of the bookkeeping ``split_checkpoint`` writes into ``meta.pt``
META_FORMAT_VERSION = 1


# -- tensor leaves ------------------------------------------------------------------------------------------------------
def extract_tensors(tree: Any, prefix: TensorPath = ()) -> tuple[Any, dict[TensorPath, torch.Tensor]]:
    """Split ``tree`` into a skeleton without tensors and ``{path: tensor}``.

    Tensors are removed from dicts and replaced by ``None`` in lists/tuples (positions must survive);
    :func:`insert_tensors` puts them back.
    """
    tensors: dict[TensorPath, torch.Tensor] = {}

    def walk(node: Any, path: TensorPath) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return None
        if isinstance(node, Mapping):
            out = {}
            for key, value in node.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise CheckpointError(
                        f"Checkpoint key {key!r} at {_fmt(path)} is a {type(key).__name__}; only str and int keys"
                        " can be saved. Rename the entry in `on_save_checkpoint`."
                    )
                child: TensorPath = (*path, key)
                if isinstance(value, torch.Tensor):
                    tensors[child] = value
                else:
                    out[key] = walk(value, child)
            return out
        if isinstance(node, (list, tuple)):
            items = [walk(v, (*path, i)) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    return walk(tree, prefix), tensors


def insert_tensors(skeleton: Any, tensors: Mapping[TensorPath, torch.Tensor], prefix: TensorPath = ()) -> Any:
    """Inverse of :func:`extract_tensors` for the paths under ``prefix`` (modifies and returns ``skeleton``)."""
    for path, tensor in tensors.items():
        if path[: len(prefix)] != prefix:
            continue
        rel = path[len(prefix) :]
        if not rel:
            skeleton = tensor
            continue
        node = skeleton
        for i, key in enumerate(rel[:-1]):
            nxt = rel[i + 1]
            if isinstance(node, dict):
                if key not in node or node[key] is None:
                    node[key] = {} if isinstance(nxt, str) else []
                node = node[key]
            else:
                assert isinstance(key, int), f"list position {key!r} at {_fmt(path)}"
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = {} if isinstance(nxt, str) else []
                node = node[key]
        last = rel[-1]
        if isinstance(node, dict):
            node[last] = tensor
        else:
            assert isinstance(last, int), f"list position {last!r} at {_fmt(path)}"
            while len(node) <= last:
                node.append(None)
            node[last] = tensor
    return skeleton


#: which weights an export takes: the trained ones, or ``ShardedEMA``'s average
WEIGHTS = ("model", "ema")


def weight_paths(paths: Mapping[str, TensorPath], weights: str, where: Any) -> dict[str, str]:
    """Model key → the storage key its exported tensor is read from (``paths``: storage key → tensor path).

    ``weights="ema"`` takes the average where the checkpoint has one (trainable parameters and floating-point
    buffers) and the trained value elsewhere (frozen parameters, which the average would equal, integer buffers).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"`weights` must be one of {WEIGHTS}, got {weights!r}.")
    chosen = {SCHEMA.model_key(p): key for key, p in paths.items() if SCHEMA.is_model_tensor(p)}
    if weights == "ema":
        average = {SCHEMA.model_key(p): key for key, p in paths.items() if SCHEMA.is_entry_tensor(p, SCHEMA.ema)}
        if not average:
            raise CheckpointError(
                f"{where} holds no weight average ({SCHEMA.ema!r}): it was saved without"
                " `lightning_fsdp.ShardedEMA`. Export the trained weights (without --weights ema)."
            )
        chosen.update({k: v for k, v in average.items() if k in chosen})
    return chosen


def storage_key(path: TensorPath) -> str:
    """The flat key a tensor is stored under in the shard files (human-readable; the exact path is in meta.pt)."""
    return "/".join(str(p) for p in path)


def _fmt(path: TensorPath) -> str:
    return "checkpoint" + "".join(f"[{p!r}]" for p in path)


# -- plain containers ---------------------------------------------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_TORCH_PLAIN = (torch.dtype, torch.Size, torch.device)


def to_plain(obj: Any, path: TensorPath = (), converted: list[str] | None = None) -> Any:
    """Plain containers and values only, so ``torch.load(weights_only=True)`` reads them without running code.

    OmegaConf configs, ``AttributeDict``, ``Namespace`` and dataclasses become dicts, enums their values,
    paths strings; anything else is stored as its ``repr`` and named in ``converted`` (the caller warns).
    """
    if type(obj) in _SCALARS or isinstance(obj, _TORCH_PLAIN):
        return obj
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            raise CheckpointError(
                f"{_fmt(path)} is a sharded DTensor outside {SCHEMA.model!r}/{SCHEMA.optimizers!r}; gather it with"
                " `.full_tensor()` in `on_save_checkpoint` before saving."
            )
        return obj.detach()
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, path, converted)
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return "".join([obj])
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    container = _omegaconf_container(obj)
    if container is not None:
        return to_plain(container, path, converted)
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            plain_key = to_plain(key, (*path, key), converted)
            out[plain_key] = to_plain(value, (*path, key), converted)
        return out
    if isinstance(obj, tuple):
        return tuple(to_plain(v, (*path, i), converted) for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [to_plain(v, (*path, i), converted) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return {to_plain(v, path, converted) for v in obj}
    if converted is not None:
        converted.append(f"{_fmt(path)} ({type(obj).__name__})")
    return repr(obj)


def _omegaconf_container(obj: Any) -> Any:
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with hydra-core, a dependency
        return None
    if isinstance(obj, Container):
        return OmegaConf.to_container(obj, resolve=True)
    return None


def stamp_lightning_version(meta: dict[str, Any]) -> None:
    """Record the running Lightning version where a checkpoint dict has none (Lightning's loader reads it)."""
    import lightning

    meta.setdefault("pytorch-lightning_version", lightning.__version__)


def plain_checkpoint_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """:func:`to_plain` for a whole Lightning checkpoint dict (minus tensors), warning about lossy conversions.

    ``hparams_type`` (a class, only present for OmegaConf hyper-parameters) is dropped: the hyper-parameters
    are stored as a plain dict and Lightning loads them as one.
    """
    converted: list[str] = []
    meta = {k: v for k, v in meta.items() if k not in ("hparams_type", "datamodule_hparams_type")}
    plain = to_plain(meta, (), converted)
    if converted:
        warnings.warn(
            "These checkpoint entries are not plain data and were stored as their repr() so that the checkpoint"
            f" loads without executing code: {', '.join(converted)}. Store plain values (str, numbers, lists, dicts)"
            " to keep them.",
            stacklevel=3,
        )
    return plain


# -- optimizer state keys -----------------------------------------------------------------------------------------------
def optimizer_state_to_ids(state: Mapping[str, Any]) -> dict[str, Any]:
    """Parameter-name keyed optimizer state → ``torch.optim`` format (ids in param-group order).

    This is what a plain Lightning ``.ckpt`` holds, so ``optimizer.load_state_dict`` works without this package.
    """
    ids: dict[Any, int] = {}
    groups = []
    for group in state.get(SCHEMA.param_groups, []):
        new_group = dict(group)
        new_group["params"] = []
        for name in group["params"]:
            ids.setdefault(name, len(ids))
            new_group["params"].append(ids[name])
        groups.append(new_group)
    per_param = {ids[name]: value for name, value in state.get(SCHEMA.optimizer_state, {}).items() if name in ids}
    return {SCHEMA.optimizer_state: per_param, SCHEMA.param_groups: groups}


def is_id_keyed(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state dict uses ``torch.optim``'s integer ids (rather than parameter names)."""
    params = [p for g in state.get(SCHEMA.param_groups, []) for p in g.get("params", [])]
    return bool(params) and all(isinstance(p, int) and not isinstance(p, bool) for p in params)


def optimizer_state_to_fqns(state: Mapping[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """``torch.optim`` format → parameter-name keyed, matching ids to the current optimizer's names by position."""
    groups = state.get(SCHEMA.param_groups, [])
    saved_sizes = [len(g["params"]) for g in groups]
    current_sizes = [len(n) for n in group_names]
    if saved_sizes != current_sizes:
        raise CheckpointError(
            f"The checkpoint's optimizer has param groups of sizes {saved_sizes}, the current optimizer"
            f" {current_sizes}. Build the optimizer with the same parameter groups as when it was saved."
        )
    name_of: dict[int, str] = {}
    new_groups = []
    for group, names in zip(groups, group_names):
        new_group = dict(group)
        new_group["params"] = list(names)
        for pid, name in zip(group["params"], names):
            name_of[pid] = name
        new_groups.append(new_group)
    per_param = {name_of[pid]: value for pid, value in state.get(SCHEMA.optimizer_state, {}).items() if pid in name_of}
    return {SCHEMA.optimizer_state: per_param, SCHEMA.param_groups: new_groups}


# -- whole checkpoints ------------------------------------------------------------------------------------------------
def plain_meta_and_tensors(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[TensorPath, torch.Tensor]]:
    """Model/optimizer tensors pulled out of their containers (skeletons stay), the rest made plain data."""
    meta: dict[str, Any] = {}
    tensors: dict[TensorPath, torch.Tensor] = {}
    for key, value in checkpoint.items():
        if key in SCHEMA.sharded:
            skeleton, found = extract_tensors(value, (key,))
            meta[key] = skeleton
            tensors.update(found)
        else:
            meta[key] = value
    return plain_checkpoint_meta(meta), tensors


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[TensorPath, torch.Tensor]]:
    """Lightning's checkpoint → (plain ``meta.pt`` content, ``{path: tensor}`` of model and optimizer tensors).

    ``meta[SCHEMA.bookkeeping][SCHEMA.tensor_map]`` maps each tensor's storage key to its exact path in the
    checkpoint dict.
    """
    meta, tensors = plain_meta_and_tensors(checkpoint)
    keys: dict[str, TensorPath] = {}
    for path in tensors:
        key = storage_key(path)
        while key in keys:
            key += "#"
        keys[key] = path
    meta[SCHEMA.bookkeeping] = {"format_version": META_FORMAT_VERSION, SCHEMA.tensor_map: keys}
    return meta, tensors


def assemble_full_checkpoint(meta: dict[str, Any], tensors: Mapping[TensorPath, torch.Tensor]) -> dict[str, Any]:
    """``meta`` with its tensors put back and optimizer states in ``torch.optim``'s integer-id format: what a plain
    Lightning ``.ckpt`` holds, so ``load_from_checkpoint`` and ``optimizer.load_state_dict`` work without us."""
    meta.pop(SCHEMA.bookkeeping, None)
    for top in SCHEMA.sharded:
        if top in meta:
            meta[top] = insert_tensors(meta[top], tensors, (top,))
    if meta.get(SCHEMA.optimizers) is not None:
        meta[SCHEMA.optimizers] = [
            s if is_id_keyed(s) or not s.get(SCHEMA.param_groups) else optimizer_state_to_ids(s)
            for s in meta[SCHEMA.optimizers]
        ]
    return meta
