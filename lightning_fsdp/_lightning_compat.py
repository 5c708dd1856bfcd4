"""Every private Lightning internal the package relies on, in one module, checked against the Lightning it was
written for (torch's internals live in ``_torch_compat/``), and the few of torchmetrics, Lightning's metrics.

Lightning's two halves meet here only as names: ``lightning.fabric`` internals (process-group start-up, Fabric's
launcher and backward-sync control) and ``lightning.pytorch`` internals (the Trainer's launcher, step redirection,
loop progress). Each front end imports the names of its own half; the layout test keeps it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch
from lightning.fabric.strategies.launchers.subprocess_script import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
from lightning.fabric.strategies.strategy import _BackwardSyncControl as FabricBackwardSyncControl
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.types import _PATH as PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.strategy import _ForwardRedirection as ForwardRedirection

from lightning_fsdp._torch_compat import keep_root_gathered

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

#: the version every internal below was checked against
TESTED_LIGHTNING = "2.6"
#: ``RichProgressBar``'s method that titles the training bar (overridden by ``trainer.progress``)
RICH_TRAIN_DESCRIPTION = "_get_train_description"

__all__ = [
    "PATH",
    "FabricBackwardSyncControl",
    "FabricSubprocessScriptLauncher",
    "ForwardRedirection",
    "RootForwardRedirection",
    "SubprocessScriptLauncher",
    "ModuleAssignmentHook",
    "attached_trainer",
    "batches_processed",
    "checkpoint_every_n_train_steps",
    "give_module_device_mesh",
    "init_dist_connection",
    "metric_states",
    "optimizers_to_device",
    "reset_optimizers",
    "set_metric_defaults",
    "set_num_threads_if_needed",
    "start_local_ranks",
    "sync_ddp_if_available",
    "trainer_callbacks",
    "uncompile",
    "unwrap_optimizer",
]


class RootForwardRedirection(ForwardRedirection):
    """Lightning's step redirection through the root's ``__call__``, without the second all-gather of the root's
    parameters that a ``self(x)`` inside the step would otherwise cost (see ``_torch_compat.keep_root_gathered``)."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(wrapper_module, FSDPModule):
            keep_root_gathered(wrapper_module)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def start_local_ranks(launcher: Any, started: Optional[Callable[[], Any]] = None) -> list[Any]:
    """Start the other local ranks, as Lightning's script launchers (the Trainer's and Fabric's) do at the top of
    their ``launch``; ``started()`` runs as soon as they are started."""
    from lightning_fsdp._warm_start import handing_over

    with handing_over(launcher.num_processes - 1):  # warm processes of `lightning-fsdp train`, when it started some
        launcher._call_children_scripts()
        if started is not None:
            started()  # before this rank goes on (a warm rank 0 imports more): the others may need it first
    return launcher.procs


def attached_trainer(module: Optional[pl.LightningModule]) -> Optional[pl.Trainer]:
    """The Trainer ``module`` is attached to, or ``None`` (Lightning's public ``trainer`` property raises then)."""
    return getattr(module, "_trainer", None) if module is not None else None


def checkpoint_every_n_train_steps(callback: Any) -> int:
    """How often a ``ModelCheckpoint`` saves in optimizer steps (0: not by steps); it keeps it private."""
    return int(getattr(callback, "_every_n_train_steps", 0) or 0)


def give_module_device_mesh(module: Optional[pl.LightningModule], mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` return ``mesh`` (for ``configure_model``), as Lightning's strategies do."""
    if module is not None:
        module._device_mesh = mesh


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """The Trainer's callback list (set by its callback connector, so not declared on the class)."""
    return cast(Any, trainer).callbacks


def reset_optimizers(strategy: Any) -> None:
    """Forget the optimizers and schedulers of a previous stage (Lightning's strategy keeps them)."""
    strategy._reset_optimizers_and_schedulers()


def batches_processed(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch already processed (Lightning's fit-loop progress counter)."""
    return int(cast(Any, trainer.fit_loop.epoch_loop.batch_progress.current).processed)  # typed as its base class


class ModuleAssignmentHook:
    """Lightning stores the module a Trainer entry point (``fit``, ``validate``, ``test``, ``predict``) was given in
    its strategy's ``_lightning_module`` before it checks compiled modules or starts any process (on every rank that
    runs the script); a strategy with this mixin sees it there, in :meth:`on_lightning_module`, and may refuse it."""

    def on_lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        """Called with every module assigned (``None`` when Lightning clears it)."""

    @property
    def _lightning_module(self) -> Optional[pl.LightningModule]:
        return self.__dict__.get("_assigned_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        self.on_lightning_module(module)
        self.__dict__["_assigned_lightning_module"] = module


def uncompile(module: pl.LightningModule) -> bool:
    """If Lightning unwrapped a ``torch.compile``'d module into ``module`` (``fit(torch.compile(model))``), restore
    its own methods (Lightning's ``to_uncompiled``) and return ``True``."""
    from lightning.pytorch.utilities.compile import to_uncompiled

    if getattr(module, "_compiler_ctx", None) is None:
        return False
    to_uncompiled(module)
    return True


# -- torchmetrics -----------------------------------------------------------------------------------------------------
def metric_states(metric: nn.Module) -> dict[str, tuple[Any, Any, bool]]:
    """A ``torchmetrics.Metric``'s table of states: name → (reset default, ``dist_reduce_fx``, persistent)."""
    m = cast(Any, metric)
    return {name: (default, m._reductions[name], bool(m._persistent[name])) for name, default in m._defaults.items()}


def set_metric_defaults(metric: nn.Module, defaults: dict[str, Any], device: torch.device) -> None:
    """Make ``defaults`` (tensors, or ``[]`` for list states) a metric's reset defaults and its current states, on
    ``device``, and record ``device`` as the one the metric computes on."""
    m = cast(Any, metric)
    for name, default in defaults.items():
        value: Any = default.detach().to(device) if isinstance(default, torch.Tensor) else []
        m._defaults[name] = value
        setattr(m, name, value.clone() if isinstance(value, torch.Tensor) else [])
    m._device = torch.device(device)
