"""lightning_fsdp: FSDP2 (``fully_shard``) for any LightningModule through one Trainer flag.

``import lightning_fsdp`` registers ``fsdp_custom``, ``fsdp_custom_offload`` and ``fsdp_custom_hybrid``.
"""

from lightning_fsdp.distributed import MeshShape, resolve_mesh_shape
from lightning_fsdp.memory import StateBytes, local_state_bytes
from lightning_fsdp.precision import FSDP2Precision
from lightning_fsdp.registry import (
    StrategySpec,
    discover_strategies,
    load_discovered_strategies,
    register_strategies,
)
from lightning_fsdp.strategy import FSDPCustomStrategy
from lightning_fsdp.wrapping import find_repeated_block_classes, select_units

__version__ = "0.1.0"

__all__ = [
    "FSDP2Precision",
    "FSDPCustomStrategy",
    "MeshShape",
    "StateBytes",
    "StrategySpec",
    "discover_strategies",
    "find_repeated_block_classes",
    "load_discovered_strategies",
    "local_state_bytes",
    "register_strategies",
    "resolve_mesh_shape",
    "select_units",
]

register_strategies()
