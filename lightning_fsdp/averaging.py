"""``ShardedEMA``: Lightning's ``EMAWeightAveraging`` for sharded models, keeping the average on each rank's shards.

Lightning's ``WeightAveraging`` deep-copies the whole module into an ``AveragedModel`` before the strategy shards it
(a full copy on every rank) and then mixes plain tensors with the sharded DTensor parameters in its update, which
fails. ``ShardedEMA`` takes the same constructor arguments and has the same semantics — updates after optimizer
steps as ``should_update`` says, the first update copies, the model holds the average during validation and after
fit — but the average is a copy of each rank's *local shards* only (1/N of the model, optionally in CPU memory),
updated with fused ``foreach`` ops, and never gathered. Frozen parameters are not copied: their average is
themselves (under LoRA only the adapters are averaged).

Checkpoints: the average is saved under ``ema_state_dict`` next to the model's ``state_dict`` (which stays the
model being trained, so a resumed run continues exactly). Sharded checkpoints store it in shards and reshard it on
resume at another world size like everything else; ``lightning-fsdp consolidate --weights ema`` exports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_fsdp._torch_compat import foreach_copy_, foreach_lerp_
from lightning_fsdp.checkpoint.state import MODEL_LIKE_KEYS
from lightning_fsdp.memory import tensor_bytes
from lightning_fsdp.parallel.mesh import local_shard

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: the checkpoint entry holding the average (model keys → tensors, sharded like the model)
EMA_ENTRY = MODEL_LIKE_KEYS[0]


def refuse_unsharded_averaging(callbacks: Iterable[Any]) -> None:
    """Lightning's ``WeightAveraging`` deep-copies the whole model and then fails on its sharded parameters: refuse
    it before any process group exists, naming the drop-in replacement."""
    for callback in callbacks:
        if isinstance(callback, WeightAveraging) and not isinstance(callback, ShardedEMA):
            kind = type(callback).__name__
            raise MisconfigurationException(
                f"`{kind}` keeps a full, unsharded copy of the model on every rank (its `AveragedModel` deep-copies"
                " the module) and cannot update it from sharded parameters. With `fsdp_custom`, use"
                f" `lightning_fsdp.ShardedEMA` instead: the same arguments as `EMAWeightAveraging`"
                " (decay, update_every_n_steps, update_starting_at_step, update_starting_at_epoch, device, use_buffers),"
                " the average kept on each rank's shards only."
            )


class ShardedEMA(EMAWeightAveraging):
    """Exponential moving average of the weights, on this rank's shards only (see the module docstring).

    Args: those of ``lightning.pytorch.callbacks.EMAWeightAveraging`` (``device``: where the average lives, e.g.
    ``"cpu"``; default the parameters' device; ``use_buffers``: average floating-point buffers too; ``decay``,
    ``update_every_n_steps``, ``update_starting_at_step``, ``update_starting_at_epoch``).
    """

    #: the checkpoint entry this callback saves and loads (the strategy reads it resharded for it)
    checkpoint_entry = EMA_ENTRY

    def __init__(
        self,
        device: Optional[Union[torch.device, str, int]] = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: Optional[int] = None,
        update_starting_at_epoch: Optional[int] = None,
    ) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ShardedEMA(decay={decay}): the decay must be in [0, 1].")
        super().__init__(
            device=device,
            use_buffers=use_buffers,
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
        )
        self.decay = float(decay)
        self.n_averaged = 0
        self._names: list[str] = []
        self._aliases: dict[str, list[str]] = {}  # tracked name → every state-dict key of that tensor (tied weights)
        self._average: list[Tensor] = []  # local shards (or replicated buffers), on `self._device` if given

    # -- the average ---------------------------------------------------------------------------------------------
    def _tracked(self, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
        # frozen parameters never change, so their average is themselves: not copied (LoRA: only the adapters)
        tracked = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        if self._use_buffers:
            tracked += [(n, b) for n, b in pl_module.named_buffers() if b is not None and b.is_floating_point()]
        return tracked

    def _ensure(self, pl_module: pl.LightningModule) -> None:
        """Take the average's first value from the (sharded) weights, once the model exists."""
        if self._average:
            return
        tracked = self._tracked(pl_module)
        saved_keys = set(pl_module.state_dict(keep_vars=True))
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in [*pl_module.named_parameters(remove_duplicate=False),
                             *pl_module.named_buffers(remove_duplicate=False)]:
            if name in saved_keys:
                by_tensor.setdefault(id(tensor), []).append(name)
        self._names = [name for name, _ in tracked]
        self._aliases = {name: by_tensor.get(id(t), []) for name, t in tracked}
        self._average = [local_shard(t).detach().to(self._device or t.device, copy=True) for _, t in tracked]

    def average_tensors(self) -> list[Tensor]:
        """This rank's part of the average (its local shards), in tracking order."""
        return list(self._average)

    def average_bytes(self) -> int:
        """Bytes this rank holds for the average (its local shards)."""
        return sum(tensor_bytes(t) for t in self._average)

    def _update(self, pl_module: pl.LightningModule) -> None:
        self._ensure(pl_module)
        current = [local_shard(t).detach() for _, t in self._tracked(pl_module)]
        with torch.no_grad():
            if self.n_averaged == 0:
                foreach_copy_(self._average, [c.to(a.device) for a, c in zip(self._average, current)])
            else:
                by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
                for avg, cur in zip(self._average, current):
                    pair = by_device.setdefault(avg.device, ([], []))
                    pair[0].append(avg)
                    pair[1].append(cur.to(avg.device))
                for averages, values in by_device.values():
                    foreach_lerp_(averages, values, 1.0 - self.decay)  # decay·avg + (1 − decay)·value
        self.n_averaged += 1

    def _swap(self, pl_module: pl.LightningModule) -> None:
        """Exchange the weights and the average (both local shards)."""
        with torch.no_grad():
            for avg, (_, t) in zip(self._average, self._tracked(pl_module)):
                local = local_shard(t)
                held = local.detach().clone()
                local.copy_(avg.to(local.device))
                avg.copy_(held.to(avg.device))

    # -- Lightning's hooks ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Nothing to copy yet: the average is taken from the sharded parameters at the first update."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1  # zero-based index of the optimizer step just taken, as Lightning's
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update(pl_module)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update(pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After fit the model holds the average (as with Lightning's callback)."""
        with torch.no_grad():
            for avg, (_, t) in zip(self._average, self._tracked(pl_module)):
                local_shard(t).copy_(avg.to(local_shard(t).device))

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average:
            self._swap(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average:
            self._swap(pl_module)

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_epoch_end(trainer, pl_module)

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_epoch_end(trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch,
                "n_averaged": self.n_averaged, "decay": self.decay}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = int(state_dict.get("latest_update_step", 0))
        self._latest_update_epoch = int(state_dict.get("latest_update_epoch", -1))
        self.n_averaged = int(state_dict.get("n_averaged", 0))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The average next to ``state_dict`` under every key of its tensor (tied weights too): DTensors sharded like
        the parameters for a sharded save; for a full one gathered tensor by tensor and kept on rank 0 only (a
        collective: every rank saves)."""
        if not self._average:
            return
        from torch.distributed.tensor import DTensor

        full = getattr(trainer.strategy, "state_dict_type", "sharded") == "full"
        keep = trainer.global_rank == 0 or not full
        entry: dict[str, Tensor] = {}
        for name, avg, (_, t) in zip(self._names, self._average, self._tracked(pl_module)):
            value = avg.to(local_shard(t).device)
            if isinstance(t, DTensor):
                value = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                           stride=t.stride())
                if full:
                    value = value.full_tensor()
            if full:
                value = value.cpu()
            if keep:
                for key in self._aliases.get(name) or [name]:
                    entry[key] = value.detach()
        checkpoint[EMA_ENTRY] = entry

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(EMA_ENTRY)
        if saved is None:
            rank_zero_warn(f"{type(self).__name__}: the checkpoint holds no average; it starts from the weights.")
            return
        self._ensure(pl_module)
        missing = [name for name in self._names if name not in saved]
        if missing:
            raise MisconfigurationException(
                f"{type(self).__name__}: the checkpoint's average has no {missing[:5]} (saved with use_buffers ="
                f" {not self._use_buffers}?). Use the settings it was saved with."
            )
        from torch.distributed.tensor import DTensor, distribute_tensor

        tracked = dict(self._tracked(pl_module))
        with torch.no_grad():
            for name, avg in zip(self._names, self._average):
                value, param = saved[name], tracked[name]
                if isinstance(value, DTensor):
                    value = value.to_local()
                elif isinstance(param, DTensor):  # a full tensor held by every rank: this rank's slice of it
                    value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
                avg.copy_(value.to(avg.device))
