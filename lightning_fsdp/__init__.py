"""lightning_fsdp: FSDP2 (``fully_shard``) for any LightningModule through one Trainer flag, and for Fabric loops.

``import lightning_fsdp`` registers ``fsdp_custom``, ``fsdp_custom_offload``, ``fsdp_custom_hybrid`` and
``fsdp_custom_qlora`` for ``Trainer(strategy=...)`` and ``Fabric(strategy=...)``.
"""

from lightning_fsdp import _warm_start

_warm_start.begin_if_requested()  # `lightning-fsdp train` on N devices: ranks 1..N-1 import alongside this one

from lightning_fsdp._version import __version__  # noqa: E402
from lightning_fsdp.averaging import ShardedAverage
from lightning_fsdp.checkpoint import CheckpointError, consolidate_checkpoint, load_pretrained, verify_checkpoint
from lightning_fsdp.fabric import FSDP2FabricPrecision, FSDPCustomFabricStrategy
from lightning_fsdp.memory import StateBytes, local_state_bytes
from lightning_fsdp.parallel import MeshShape, resolve_mesh_shape
from lightning_fsdp.registry import (
    StrategySpec,
    discover_strategies,
    load_discovered_strategies,
    register_fabric_strategies,
    register_strategies,
)
from lightning_fsdp.resilience import PREEMPTED_EXIT_CODE, preemption_requested
from lightning_fsdp.sharding import find_repeated_block_classes, select_units
from lightning_fsdp.trainer.strategy import FSDPCustomStrategy
from lightning_fsdp.trainer import FSDP2Precision, MemoryReport, SafeOnExceptionCheckpoint, ShardedEMA

__all__ = [
    "__version__",
    "PREEMPTED_EXIT_CODE",
    "CheckpointError",
    "FSDP2FabricPrecision",
    "FSDP2Precision",
    "FSDPCustomFabricStrategy",
    "FSDPCustomStrategy",
    "MemoryReport",
    "MeshShape",
    "SafeOnExceptionCheckpoint",
    "ShardedAverage",
    "ShardedEMA",
    "StateBytes",
    "StrategySpec",
    "consolidate_checkpoint",
    "discover_strategies",
    "find_repeated_block_classes",
    "load_discovered_strategies",
    "load_pretrained",
    "local_state_bytes",
    "preemption_requested",
    "register_fabric_strategies",
    "register_strategies",
    "resolve_mesh_shape",
    "select_units",
    "verify_checkpoint",
]

register_strategies()
register_fabric_strategies()
