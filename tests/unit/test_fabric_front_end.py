"""The Fabric front end without processes: the registry names, precision adoption, early argument checks, and the
mapping between Fabric's ``state`` and the checkpoint dict."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import lightning_fsdp
from lightning_fsdp.fabric import FABRIC_ENTRY, FSDP2FabricPrecision, FSDPCustomFabricStrategy, FabricState
from lightning_fsdp.fabric.checkpoint import restore_entries, to_checkpoint
from lightning_fsdp.registry import STRATEGIES


@pytest.mark.parametrize("spec", STRATEGIES, ids=lambda s: s.name)
def test_every_name_builds_the_fabric_strategy_with_its_arguments(spec):
    if spec.init_params.get("quantize_base"):
        pytest.importorskip("torchao")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=spec.name, precision="bf16-mixed")
    strategy = fabric.strategy
    assert type(strategy) is FSDPCustomFabricStrategy
    for key, value in spec.init_params.items():
        assert getattr(strategy, key) == value
    assert isinstance(strategy.precision, FSDP2FabricPrecision)  # Fabric's generic plugin, replaced
    assert strategy.precision.mp_policy.param_dtype == torch.bfloat16
    assert strategy.precision.mp_policy.reduce_dtype == torch.float32


def test_registration_is_idempotent_and_public():
    assert lightning_fsdp.register_fabric_strategies() == [s.name for s in STRATEGIES]
    assert lightning_fsdp.FSDPCustomFabricStrategy is FSDPCustomFabricStrategy


def test_bad_arguments_fail_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="quantize_base"):
        FSDPCustomFabricStrategy(quantize_base="int3")
    with pytest.raises(ValueError, match="shard_size"):
        FSDPCustomFabricStrategy(shard_size=0)
    with pytest.raises(TypeError, match="does not support the precision plugin"):
        L.Fabric(accelerator="cpu", devices=1, strategy=FSDPCustomFabricStrategy(), plugins=[_OtherPrecision()])
    # mesh sizes that do not fit the world: when Fabric is built, before any process starts
    with pytest.raises(ValueError, match="context_parallel=3 does not divide the world size 4"):
        L.Fabric(accelerator="cpu", devices=4, strategy=FSDPCustomFabricStrategy(context_parallel=3))
    with pytest.raises(ValueError, match="replicate_size=3 does not divide the world size 4"):
        L.Fabric(accelerator="cpu", devices=4, strategy=FSDPCustomFabricStrategy(replicate_size=3))


class _OtherPrecision(L.fabric.plugins.Precision):
    pass


def test_precision_plugin_casts_true_precisions_and_returns_default_dtype_outputs():
    plugin = FSDP2FabricPrecision("bf16-true")
    module = plugin.convert_module(nn.Linear(2, 2))
    assert module.weight.dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(1)).dtype == torch.bfloat16
    assert plugin.convert_output(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.float32
    assert FSDP2FabricPrecision("16-mixed").scaler is not None
    with pytest.raises(ValueError, match="not supported"):
        FSDP2FabricPrecision("8-true")


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_state_is_sorted_into_model_optimizers_objects_and_values():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = _Counter()
    counter.n = 7
    state = FabricState.of({"model": model, "opt": opt, "counter": counter, "step": 3}, "fabric.save")
    checkpoint = to_checkpoint(state, {"w": torch.ones(1)}, [{"state": {}}])
    assert checkpoint["state_dict"] == {"w": torch.ones(1)} and checkpoint["optimizer_states"] == [{"state": {}}]
    assert checkpoint[FABRIC_ENTRY] == {"model": "model", "optimizers": ["opt"], "entries": {"counter": {"n": 7}, "step": 3}}

    fresh_counter = _Counter()
    target = {"model": model, "opt": opt, "counter": fresh_counter, "step": 0}
    rest = {FABRIC_ENTRY: checkpoint[FABRIC_ENTRY], "lightning_fsdp_hf": {}, "extra": 1}
    remainder = restore_entries(FabricState.of(target, "fabric.load"), target, rest, Path("c"), strict=True)
    assert fresh_counter.n == 7 and target["step"] == 3
    assert remainder == {"extra": 1}  # what `state` did not ask for; the package's own entry is not handed back


def test_state_without_one_model_or_with_reserved_keys_is_refused():
    with pytest.raises(ValueError, match="exactly one model.*found 0"):
        FabricState.of({"step": 1}, "fabric.save")
    with pytest.raises(ValueError, match=r"exactly one model.*found 2 \(\[a, b\]\)"):
        FabricState.of({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)}, "fabric.save")
    with pytest.raises(ValueError, match="reserved"):
        FabricState.of({"model": nn.Linear(1, 1), "state_dict": {}}, "fabric.save")


def test_strict_load_names_entries_the_checkpoint_lacks():
    target = {"model": nn.Linear(1, 1), "step": 0, "epoch": 0}
    rest = {FABRIC_ENTRY: {"model": "model", "optimizers": [], "entries": {"step": 5}}}
    with pytest.raises(KeyError, match=r"has no \[epoch\].*strict=False"):
        restore_entries(FabricState.of(target, "fabric.load"), target, dict(rest), Path("c"), strict=True)
    assert restore_entries(FabricState.of(target, "fabric.load"), target, dict(rest), Path("c"), strict=False) == {}
    assert target == {"model": target["model"], "step": 5, "epoch": 0}
