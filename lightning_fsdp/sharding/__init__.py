"""Which modules become FSDP units, and applying FSDP2 to a model (no Trainer needed).

==========================  ==========================================================================================
:mod:`.policy`              the policy forms, validated (:func:`validate_policy`) and resolved to one predicate
:mod:`.units`               the post-order walk that picks units (tied weights, containers, user-sharded modules)
:mod:`.compile`             ``torch.compile`` of each unit's forward (names kept; errors name the unit)
:mod:`.parallelize`         activation checkpointing → compile → ``fully_shard`` bottom-up → the root, in that order
:mod:`.comm_buffers`        units of one shape hand their host all-gather and reduce-scatter buffers on
:mod:`.materialize`         meta-device models: parameters on meta and real buffers while building, then each rank
                            allocates its shards of what is on meta (nothing else) and initialises them
:mod:`.init_rules`          how each module is initialised: ``reset_parameters()``, torch's ``_reset_parameters()``,
                            parametrizations (:mod:`.parametrized`); torchmetrics states (:mod:`.metric_states`)
==========================  ==========================================================================================
"""

from lightning_fsdp.sharding.compile import CompileArg, CompileError, compile_units
from lightning_fsdp.sharding.init_rules import (
    DEFAULT_RULES,
    InitRule,
    private_reset_parameters_rule,
    reset_parameters_rule,
)
from lightning_fsdp.sharding.materialize import has_meta_tensors, materialize_meta_module, parameters_on_meta
from lightning_fsdp.sharding.parametrized import parametrization_rule
from lightning_fsdp.sharding.comm_buffers import HostBufferPool, reuse_host_comm_buffers
from lightning_fsdp.sharding.parallelize import Sharded, ShardingPlan, apply_activation_checkpointing, parallelize, shard_model
from lightning_fsdp.sharding.policy import (
    AUTO,
    UnitPolicy,
    WrapPolicy,
    find_repeated_block_classes,
    resolve_policy,
    validate_policy,
)
from lightning_fsdp.sharding.units import select_units, tied_aliases

__all__ = [
    "AUTO",
    "CompileArg",
    "CompileError",
    "DEFAULT_RULES",
    "HostBufferPool",
    "InitRule",
    "Sharded",
    "ShardingPlan",
    "UnitPolicy",
    "WrapPolicy",
    "apply_activation_checkpointing",
    "compile_units",
    "find_repeated_block_classes",
    "has_meta_tensors",
    "materialize_meta_module",
    "parallelize",
    "parameters_on_meta",
    "parametrization_rule",
    "private_reset_parameters_rule",
    "reset_parameters_rule",
    "resolve_policy",
    "reuse_host_comm_buffers",
    "select_units",
    "shard_model",
    "tied_aliases",
    "validate_policy",
]
