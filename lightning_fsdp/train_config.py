"""A composed job config, checked and turned into objects: what ``lightning-fsdp train`` does before ``fit``.

Everything that can be checked from the config alone (unknown arguments, a mesh that does not fit the devices)
fails in :func:`validate_config`, before any process or process group exists.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

log = logging.getLogger(__name__)

#: config nodes that are built with `hydra.utils.instantiate`, checked against their target's signature
INSTANTIATED_NODES = ("trainer", "strategy", "model", "data")
#: arguments `run` passes to the Trainer itself
TRAINER_OBJECT_ARGS = ("strategy", "callbacks", "logger")


# -- validation: pure functions of the config ------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config that cannot work; the message names the key and the fix."""


def _locate(target: str, where: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as err:  # ImportError, AttributeError, ValueError: all mean "no such object"
        raise ConfigError(f"{where}._target_={target!r} cannot be imported: {err}") from err


def accepted_arguments(target: Any) -> Optional[set[str]]:
    """Keyword arguments ``target`` accepts, or ``None`` when it takes ``**kwargs`` (anything goes)."""
    params = inspect.signature(target).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def check_init_args(node: Mapping[str, Any], where: str, extra: Sequence[str] = ()) -> None:
    """Raise :class:`ConfigError` if ``node`` has keys its ``_target_`` does not accept, listing the valid ones."""
    target_path = node.get("_target_")
    if not target_path:
        raise ConfigError(f"`{where}` has no `_target_`; choose a config from the `{where}/` group.")
    target = _locate(str(target_path), where)
    accepted = accepted_arguments(target)
    if accepted is None:
        return
    given = [str(k) for k in node.keys() if not str(k).startswith("_")] + list(extra)
    unknown = [k for k in given if k not in accepted]
    if unknown:
        name = getattr(target, "__name__", str(target_path))
        hints = [f"{k!r} → did you mean {m[0]!r}?" for k in unknown if (m := difflib.get_close_matches(k, accepted, 1))]
        raise ConfigError(
            f"`{where}`: {name} has no argument(s) {unknown}."
            + (f" ({'; '.join(hints)})" if hints else "")
            + f" Valid arguments: {', '.join(sorted(accepted))}."
            f" Remove or rename the key (e.g. `~{where}.{unknown[0]}` on the command line)."
        )


def world_size_of(trainer_cfg: Mapping[str, Any]) -> Optional[int]:
    """``devices × num_nodes`` when the config fixes it (an int or a list of devices), else ``None`` ("auto", -1)."""
    devices = trainer_cfg.get("devices", "auto")
    num_nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices) * num_nodes
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices * num_nodes
    return None


def check_mesh(cfg: DictConfig) -> None:
    """The sharding mesh (replicate × shard × context) must equal the number of processes; checked before any starts."""
    from lightning_fsdp.parallel.mesh import resolve_mesh_shape
    from lightning_fsdp.trainer.strategy import FSDPCustomStrategy

    target = _locate(str(cfg.strategy._target_), "strategy")
    if not (isinstance(target, type) and issubclass(target, FSDPCustomStrategy)):
        return
    world = world_size_of(cfg.trainer)
    if world is None:
        return
    num_nodes = int(cfg.trainer.get("num_nodes", 1) or 1)
    replicate = cfg.strategy.get("replicate_size", 1)
    shard = cfg.strategy.get("shard_size", "auto")
    context = cfg.strategy.get("context_parallel", 1)
    try:
        resolve_mesh_shape(replicate, shard, world, num_nodes, context)
    except ValueError as err:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} × trainer.num_nodes={num_nodes} = {world} processes do not fit"
            f" strategy.replicate_size={replicate} × strategy.shard_size={shard} × strategy.context_parallel="
            f"{context}: {err}"
        ) from err


def validate_config(cfg: DictConfig) -> None:
    """Everything checkable from the config alone: unknown arguments and the mesh. Starts nothing."""
    missing = [name for name in INSTANTIATED_NODES if cfg.get(name) is None]
    if missing:
        raise ConfigError(f"The config has no {missing}; every job needs trainer, strategy, model and data.")
    for name in INSTANTIATED_NODES:
        check_init_args(cfg[name], name, extra=TRAINER_OBJECT_ARGS if name == "trainer" else ())
    for group in ("callbacks", "logger"):
        for key, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig) and "_target_" in node:
                check_init_args(node, f"{group}.{key}")
    check_mesh(cfg)
    if cfg.get("pretrained_if_missing", "error") not in ("error", "init"):
        raise ConfigError(f"pretrained_if_missing={cfg.pretrained_if_missing!r}: use 'error' or 'init'.")
    export = cfg.get("export")
    if export:
        from lightning_fsdp.commands.consolidate import FORMATS

        unknown = [f for f in export.get("formats", []) if f not in FORMATS]
        if unknown or not export.get("dir"):
            raise ConfigError(f"export={OmegaConf.to_container(export)}: needs `dir` and `formats` from {list(FORMATS)}.")


# -- building the objects ------------------------------------------------------------------------------------------
def instantiate_group(group_cfg: Optional[DictConfig], group: str) -> list[Any]:
    """Instantiate each ``_target_`` entry of a callbacks/logger group (TensorBoard only if installed)."""
    from hydra.utils import instantiate

    objects: list[Any] = []
    for key, node in (group_cfg or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        if "TensorBoardLogger" in str(node._target_) and not _tensorboard_available():
            log.warning("%s.%s skipped: neither tensorboard nor tensorboardX is installed.", group, key)
            continue
        made = instantiate(node, _convert_="all")
        if made is not None:  # a factory may decline (e.g. no progress bar when the Trainer shows none)
            objects.append(made)
    return objects


def _tensorboard_available() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def ensure_demo_data(cfg: DictConfig) -> Optional[Path]:
    """Write a job's generated data set if missing, before any process starts: ``demo_data: DIR`` the chat demo
    and its trained tokenizer (``finetune_hf_chat``, before the model that takes its vocabulary is written), or
    ``demo_data: {_target_: FUNCTION, dir: DIR, ...}`` any writer called as ``FUNCTION(dir=DIR, ...)``, e.g.
    :func:`~lightning_fsdp.data.sft.stdlib_docs.write_docstring_chat` (the default job)."""
    target = cfg.get("demo_data")
    if not target:
        return None
    if isinstance(target, DictConfig):
        from hydra.utils import instantiate

        return Path(str(instantiate(target)))
    from lightning_fsdp.data.sft.demo import write_chat_demo

    return write_chat_demo(Path(str(target)))


def ensure_pretrained(cfg: DictConfig) -> Optional[Path]:
    """Make sure ``strategy.pretrained_weights`` exists before any process starts.

    With ``pretrained_if_missing=init`` a missing file is created from a freshly initialised model (its full
    state dict), so the fine-tuning experiment runs on any machine; otherwise a missing file is an error.
    """
    weights = cfg.strategy.get("pretrained_weights")
    if not weights:
        return None
    path = Path(str(weights))
    if path.exists():
        return path
    if cfg.get("pretrained_if_missing", "error") != "init":
        raise ConfigError(
            f"strategy.pretrained_weights={str(path)!r} does not exist. Write it from a trained run with"
            f" `lightning-fsdp consolidate <checkpoint directory> {path}`, or pass pretrained_if_missing=init to"
            " start from a freshly initialised model's weights."
        )
    if cfg.get("pretrained_init"):
        from lightning_fsdp.models.hf_causal_lm import write_random_model

        init = OmegaConf.to_container(cfg.pretrained_init, resolve=True)
        assert isinstance(init, dict)  # a HF config mapping
        write_random_model(path, {str(key): value for key, value in init.items()})
        log.warning("pretrained_if_missing=init: wrote a freshly initialised %s model to %s", init["model_type"], path)
        return path
    import torch
    from hydra.utils import instantiate

    model = instantiate(cfg.model, _convert_="all")
    if callable(getattr(model, "configure_model", None)):
        model.configure_model()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)
    log.warning("pretrained_if_missing=init: wrote a freshly initialised %s to %s", type(model).__name__, path)
    return path
