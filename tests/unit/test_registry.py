import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_fsdp
from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.registry import discover_strategies, load_discovered_strategies, register_strategies

NAMES = ("fsdp_custom", "fsdp_custom_offload", "fsdp_custom_hybrid", "fsdp_custom_qlora")


def test_names_registered_with_descriptions():
    available = StrategyRegistry.available_strategies()
    for name in NAMES:
        assert name in available
        assert StrategyRegistry[name]["description"]
        assert StrategyRegistry[name]["strategy"] is FSDPCustomStrategy


def test_registration_is_idempotent():
    assert register_strategies() == list(NAMES)
    assert register_strategies() == list(NAMES)
    FSDPCustomStrategy.register_strategies(StrategyRegistry)


@pytest.mark.parametrize(
    ("name", "offload", "replicate", "quantize"),
    [("fsdp_custom", False, 1, None), ("fsdp_custom_offload", True, 1, None), ("fsdp_custom_hybrid", False, "auto", None),
     ("fsdp_custom_qlora", False, 1, "nf4")],
)
def test_trainer_resolves_names_on_cpu(name, offload, replicate, quantize):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDPCustomStrategy)
    assert trainer.strategy.cpu_offload is offload and trainer.strategy.replicate_size == replicate
    assert trainer.strategy.quantize_base == quantize
    assert isinstance(trainer.precision_plugin, lightning_fsdp.FSDP2Precision)


def test_trainer_maps_precision_flag_to_fsdp2_plugin():
    trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_fsdp.FSDP2Precision) and plugin.precision == "bf16-mixed"
    assert trainer.precision_plugin is plugin or trainer.precision_plugin.precision == "bf16-mixed"


def test_entry_points_advertise_every_strategy():
    specs = discover_strategies()
    assert set(NAMES) <= set(specs)
    assert specs["fsdp_custom_offload"].init_params == {"cpu_offload": True}
    assert specs["fsdp_custom"].load_class() is FSDPCustomStrategy


def test_load_discovered_into_a_fresh_registry():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    registry = _StrategyRegistry()
    assert set(NAMES) <= set(load_discovered_strategies(registry))
    assert registry.get("fsdp_custom_hybrid").replicate_size == "auto"


def test_mesh_sizes_that_do_not_divide_fail_in_trainer_construction():
    """Before any process starts: replicate, shard and context sizes that do not fit the world."""
    with pytest.raises(ValueError, match=r"replicate_size=3 does not divide the world size 4"):
        L.Trainer(strategy=FSDPCustomStrategy(replicate_size=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"context_parallel=3 does not divide the world size 4"):
        L.Trainer(strategy=FSDPCustomStrategy(context_parallel=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"2 × 3 = 6, but WORLD_SIZE = 4"):
        L.Trainer(strategy=FSDPCustomStrategy(replicate_size=2, shard_size=3), accelerator="cpu", devices=4, logger=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"auto_wrap_policy": "transformer"}, "auto_wrap_policy='transformer'` is not a known policy"),
        ({"activation_checkpointing_policy": "everything"}, "activation_checkpointing_policy='everything'"),
        ({"state_dict_type": "local"}, "state_dict_type"),
        ({"process_group_backend": "mpii"}, "process_group_backend"),
        ({"timeout": -5}, "timeout"),
        ({"replicate_size": 0}, "replicate_size"),
        ({"max_nonfinite_steps": 0}, "max_nonfinite_steps"),
        ({"quantize_base": "int3"}, r"`quantize_base` must be one of \['nf4'\] or None, got 'int3'"),
        ({"quantize_base": "nf4", "state_dict_type": "full"}, "keeps the quantized base out of checkpoints"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FSDPCustomStrategy(**kwargs)


def test_unknown_precision_in_trainer():
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=2, precision="8-mixed", logger=False)
