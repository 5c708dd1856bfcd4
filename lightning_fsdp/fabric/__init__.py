"""The Fabric front end: ``Fabric(strategy="fsdp_custom")`` for hand-written training loops.

``import lightning_fsdp`` registers ``fsdp_custom``, ``fsdp_custom_offload``, ``fsdp_custom_hybrid`` and
``fsdp_custom_qlora`` in Fabric's registry as well as the Trainer's; each name takes the same arguments in both.
"""

from lightning_fsdp.fabric.checkpoint import FABRIC_ENTRY, FabricState
from lightning_fsdp.fabric.precision import FSDP2FabricPrecision
from lightning_fsdp.fabric.strategy import FSDPCustomFabricStrategy

__all__ = ["FABRIC_ENTRY", "FSDP2FabricPrecision", "FSDPCustomFabricStrategy", "FabricState"]
