"""Strategy names: registration in Lightning's ``StrategyRegistry`` and discovery through entry points.

Lightning reads no entry points for strategies, so ``import lightning_fsdp`` registers the names itself.
The same names are advertised in the ``lightning.pytorch.strategies`` entry-point group, so a tool can find
every strategy an installed package offers without knowing its module path (:func:`discover_strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "lightning.pytorch.strategies"
#: the Fabric front end of every name (same arguments, ``Fabric(strategy=name)``)
FABRIC_TARGET = "lightning_fsdp.fabric.strategy:FSDPCustomFabricStrategy"


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry: a name, the strategy class (as ``module:Class``), its init arguments and a description."""

    name: str
    target: str
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)

    def load_class(self, target: str = "") -> type:
        module_name, _, attr = (target or self.target).partition(":")
        module = __import__(module_name, fromlist=[attr])
        return getattr(module, attr)

    def register(self, registry: Any, override: bool = True, target: str = "") -> None:
        registry.register(
            self.name, self.load_class(target), description=self.description, override=override, **self.init_params
        )


_TARGET = "lightning_fsdp.trainer.strategy:FSDPCustomStrategy"

FSDP_CUSTOM = StrategySpec(
    "fsdp_custom", _TARGET, "FSDP2 full sharding of parameters, gradients and optimizer state (auto-wrapped)."
)
FSDP_CUSTOM_OFFLOAD = StrategySpec(
    "fsdp_custom_offload",
    _TARGET,
    "FSDP2 full sharding with parameters, gradients and optimizer state offloaded to CPU memory.",
    {"cpu_offload": True},
)
FSDP_CUSTOM_HYBRID = StrategySpec(
    "fsdp_custom_hybrid",
    _TARGET,
    "FSDP2 hybrid sharding (HSDP): replicate across nodes, shard within each node.",
    {"replicate_size": "auto", "shard_size": "auto"},
)

FSDP_CUSTOM_QLORA = StrategySpec(
    "fsdp_custom_qlora",
    _TARGET,
    "FSDP2 full sharding with the frozen base held in 4-bit NF4 (QLoRA, torchao), quantized as it loads.",
    {"quantize_base": "nf4"},
)

STRATEGIES: tuple[StrategySpec, ...] = (FSDP_CUSTOM, FSDP_CUSTOM_OFFLOAD, FSDP_CUSTOM_HYBRID, FSDP_CUSTOM_QLORA)


def register_strategies(registry: Any = None) -> list[str]:
    """Register our names in ``registry`` (Lightning's ``StrategyRegistry`` by default). Safe to call twice."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for spec in STRATEGIES:
        spec.register(registry, override=True)
    return [spec.name for spec in STRATEGIES]


def register_fabric_strategies(registry: Any = None) -> list[str]:
    """The same names in Fabric's registry (``lightning.fabric.strategies.STRATEGY_REGISTRY`` by default), for
    :class:`~lightning_fsdp.fabric.FSDPCustomFabricStrategy`. Safe to call twice."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    for spec in STRATEGIES:
        spec.register(registry, override=True, target=FABRIC_TARGET)
    return [spec.name for spec in STRATEGIES]


def discover_strategies(group: str = ENTRY_POINT_GROUP) -> dict[str, StrategySpec]:
    """Every ``StrategySpec`` advertised by installed packages in the entry-point ``group``, by name."""
    found: dict[str, StrategySpec] = {}
    for ep in entry_points(group=group):
        spec = ep.load()
        if not isinstance(spec, StrategySpec):
            raise TypeError(f"Entry point {ep.name!r} in {group!r} must point to a StrategySpec, got {type(spec).__name__}.")
        found[ep.name] = spec
    return found


def load_discovered_strategies(registry: Any = None, group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register every discovered strategy in ``registry`` (Lightning's by default); returns their names."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    specs = discover_strategies(group)
    for spec in specs.values():
        spec.register(registry, override=True)
    return sorted(specs)
