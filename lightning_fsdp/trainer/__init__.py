"""The Trainer front end: ``Trainer(strategy="fsdp_custom")`` and its Lightning pieces.

Everything here speaks ``lightning.pytorch`` and delegates down to the front-end-free packages (the shared
:class:`~lightning_fsdp.runtime.ShardedRuntime` above all), as the Fabric front end (:mod:`lightning_fsdp.fabric`)
does for Fabric:

=================================  ==================================================================================
:mod:`.strategy`                   ``FSDPCustomStrategy``: Lightning's strategy hooks, translated to the runtime
:mod:`.root_steps`                 each step through the FSDP root's own call; no evaluation leaves the root gathered
:mod:`.mesh_strategy`              processes, ranks, the data-parallel mesh and collectives (Lightning's hooks)
:mod:`.precision`                  ``FSDP2Precision``: the Trainer's plugin over ``precision.PrecisionPolicy``
:mod:`.resilience`                 the Trainer's adapter over ``resilience.Resilience``: callback, launcher, the
                                   on-exception save
:mod:`.averaging`                  ``ShardedEMA``: a callback over ``averaging.ShardedAverage``
:mod:`.memory`                     ``MemoryReport``: a callback over what ``memory`` measures
:mod:`.progress`                   the progress bar of ``max_steps`` runs
=================================  ==================================================================================
"""

from lightning_fsdp.trainer.averaging import ShardedEMA
from lightning_fsdp.trainer.memory import MemoryReport
from lightning_fsdp.trainer.precision import FSDP2Precision
from lightning_fsdp.trainer.resilience import SafeOnExceptionCheckpoint

__all__ = ["FSDP2Precision", "MemoryReport", "SafeOnExceptionCheckpoint", "ShardedEMA"]
