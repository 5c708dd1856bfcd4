"""Where each kind of state lives in a checkpoint: the one place that names it.

Both front ends write one layout, Lightning's checkpoint dict: the Trainer's own, and Fabric's
``fabric.save(path, {"model": m, "optimizer": o, ...})``, which :mod:`lightning_fsdp.fabric.checkpoint` maps onto
it. ``consolidate``, ``verify``, ``inspect`` and ``seal`` read that layout back. A tensor's place in it is a
:data:`TensorPath`, e.g. ``("state_dict", "layer.weight")`` or ``("optimizer_states", 0, "state", "layer.weight",
"exp_avg")``; :data:`SCHEMA`'s methods build and take apart those paths so that no module spells them out.

Changing a value here changes the on-disk format: checkpoints written before would no longer load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar, Union

PathItem = Union[str, int]
#: a tensor's place in the checkpoint dict: the keys (and list positions) leading to it
TensorPath = tuple[PathItem, ...]

T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointSchema:
    """The top-level entries of a checkpoint and the keys inside them (see the module docstring)."""

    #: the model's state dict (model key → tensor)
    model: str = "state_dict"
    #: the optimizers' state dicts, a list in the order the optimizers were configured
    optimizers: str = "optimizer_states"
    #: inside one optimizer's state dict: per-parameter state (``exp_avg``, ...), then the parameter groups
    optimizer_state: str = "state"
    param_groups: str = "param_groups"
    #: ``lightning_fsdp.ShardedEMA``'s average: keyed and sharded like the model
    ema: str = "ema_state_dict"
    #: our own bookkeeping inside ``meta.pt`` (removed before the dict reaches Lightning), and in it the map of
    #: each tensor's storage key to its :data:`TensorPath`
    bookkeeping: str = "lightning_fsdp"
    tensor_map: str = "tensors"
    #: what HF model the checkpoint holds (``lightning_fsdp.hf.info``), plain data
    hf_model: str = "lightning_fsdp_hf"
    #: the frozen pretrained base a checkpoint refers to instead of storing it (plain data)
    pretrained_base: str = "lightning_fsdp_pretrained"
    #: which base weights the run held quantized, and how (plain data; they are never stored)
    quantized_base: str = "lightning_fsdp_quantized_base"
    #: Fabric's own state: the names its model and optimizers had, and its other entries
    fabric: str = "fabric_state"
    #: the training progress a manifest's ``extra`` copies (so a directory listing can show it)
    progress: tuple[str, ...] = ("epoch", "global_step")

    @property
    def model_like(self) -> tuple[str, ...]:
        """Entries keyed like the model and sharded like it: saved in shards, resharded on load into tensors shaped
        like the model's."""
        return (self.ema,)

    @property
    def sharded(self) -> tuple[str, ...]:
        """The entries whose tensors go to the shard files (everything else is plain data in ``meta.pt``)."""
        return (self.model, self.optimizers, *self.model_like)

    # -- the model and the entries keyed like it ---------------------------------------------------------------------
    def model_path(self, key: str) -> TensorPath:
        """The path of the model's tensor ``key``."""
        return (self.model, key)

    def is_model_tensor(self, path: TensorPath) -> bool:
        """Whether ``path`` is one of the model's tensors."""
        return self.is_entry_tensor(path, self.model)

    def is_entry_tensor(self, path: TensorPath, entry: str) -> bool:
        """Whether ``path`` is one tensor of ``entry``, an entry keyed by model key (the model or one like it)."""
        return len(path) == 2 and path[0] == entry

    def model_key(self, path: TensorPath) -> str:
        """The model key of a tensor of the model (or of an entry keyed like it)."""
        return str(path[1])

    # -- optimizers --------------------------------------------------------------------------------------------------
    def optimizer_state_prefix(self, index: int) -> TensorPath:
        """Where the per-parameter state of optimizer ``index`` starts; its tensors' paths continue below it."""
        return (self.optimizers, index, self.optimizer_state)

    def optimizer_state_items(self, items: Mapping[TensorPath, T], index: int) -> dict[TensorPath, T]:
        """The ``items`` under optimizer ``index``'s state, keyed by their path inside it (``(param, "exp_avg")``)."""
        prefix = self.optimizer_state_prefix(index)
        return {p[len(prefix) :]: v for p, v in items.items() if p[: len(prefix)] == prefix}

    def is_optimizer_path(self, path: TensorPath) -> bool:
        """Whether ``path`` lies under one of the optimizers (its index is ``path[1]``)."""
        return bool(path) and path[0] == self.optimizers

    def is_optimizer_state(self, path: TensorPath) -> bool:
        """Whether ``path`` is per-parameter optimizer state (of any optimizer)."""
        return len(path) > 3 and path[0] == self.optimizers and path[2] == self.optimizer_state

    def optimizer_param(self, path: TensorPath) -> str:
        """The parameter a per-parameter optimizer state path belongs to."""
        return str(path[3])


#: the layout every checkpoint of this package has
SCHEMA = CheckpointSchema()
