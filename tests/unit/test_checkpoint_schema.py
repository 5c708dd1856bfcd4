"""The checkpoint schema: its names are the on-disk format, and its helpers find state where the save put it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_fsdp.checkpoint.schema import SCHEMA, CheckpointSchema
from lightning_fsdp.checkpoint.state import (
    assemble_full_checkpoint,
    optimizer_state_to_fqns,
    split_checkpoint,
)


def _trained_checkpoint() -> tuple[nn.Module, dict]:
    """A Lightning-style checkpoint after one Adam step: name-keyed optimizer state, as a sharded save holds it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    names = [[name for name, _ in model.named_parameters()]]
    checkpoint = {
        "epoch": 1,
        "global_step": 7,
        SCHEMA.model: model.state_dict(),
        SCHEMA.optimizers: [optimizer_state_to_fqns(opt.state_dict(), names)],
        SCHEMA.ema: {k: v.clone() for k, v in model.state_dict().items()},
    }
    return model, checkpoint


def test_names_are_the_on_disk_format():
    """Checkpoints written before must keep loading: these strings are keys in files on disk."""
    assert (SCHEMA.model, SCHEMA.optimizers, SCHEMA.optimizer_state, SCHEMA.param_groups) == (
        "state_dict", "optimizer_states", "state", "param_groups",
    )
    assert SCHEMA.model_like == ("ema_state_dict",)
    assert SCHEMA.sharded == ("state_dict", "optimizer_states", "ema_state_dict")
    assert (SCHEMA.bookkeeping, SCHEMA.tensor_map) == ("lightning_fsdp", "tensors")
    assert (SCHEMA.hf_model, SCHEMA.pretrained_base, SCHEMA.quantized_base, SCHEMA.fabric) == (
        "lightning_fsdp_hf", "lightning_fsdp_pretrained", "lightning_fsdp_quantized_base", "fabric_state",
    )
    assert SCHEMA == CheckpointSchema()
    with pytest.raises(dataclasses.FrozenInstanceError):
        SCHEMA.model = "weights"  # type: ignore[misc]


def test_split_checkpoint_puts_tensors_at_the_schema_paths():
    model, checkpoint = _trained_checkpoint()
    meta, tensors = split_checkpoint(checkpoint)

    model_tensors = {SCHEMA.model_key(p): t for p, t in tensors.items() if SCHEMA.is_model_tensor(p)}
    assert model_tensors.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert tensors[SCHEMA.model_path(name)] is checkpoint[SCHEMA.model][name]
        assert torch.equal(model_tensors[name], value)

    state = SCHEMA.optimizer_state_items(tensors, 0)
    assert set(state) == {(name, key) for name in ("weight", "bias") for key in ("step", "exp_avg", "exp_avg_sq")}
    assert state[("weight", "exp_avg")] is checkpoint[SCHEMA.optimizers][0][SCHEMA.optimizer_state]["weight"]["exp_avg"]
    assert SCHEMA.optimizer_state_items(tensors, 1) == {}
    assert {SCHEMA.optimizer_param(p) for p in tensors if SCHEMA.is_optimizer_state(p)} == {"weight", "bias"}

    average = {SCHEMA.model_key(p) for p in tensors if SCHEMA.is_entry_tensor(p, SCHEMA.ema)}
    assert average == set(model.state_dict())
    assert all(p[0] in SCHEMA.sharded for p in tensors)
    assert set(meta[SCHEMA.bookkeeping][SCHEMA.tensor_map].values()) == set(tensors)
    assert meta[SCHEMA.optimizers][0][SCHEMA.param_groups][0]["params"] == ["weight", "bias"]
    assert (meta["epoch"], meta["global_step"]) == (1, 7)


def test_assembled_checkpoint_has_the_lightning_layout():
    model, checkpoint = _trained_checkpoint()
    full = assemble_full_checkpoint(*split_checkpoint(checkpoint))
    assert SCHEMA.bookkeeping not in full
    assert full[SCHEMA.model].keys() == model.state_dict().keys()
    optimizer = full[SCHEMA.optimizers][0]
    assert optimizer[SCHEMA.param_groups][0]["params"] == [0, 1]  # torch.optim's ids again
    assert set(optimizer[SCHEMA.optimizer_state]) == {0, 1}


def test_path_helpers_tell_entries_apart():
    model_path = SCHEMA.model_path("layer.weight")
    optimizer_path = (*SCHEMA.optimizer_state_prefix(2), "layer.weight", "exp_avg")
    groups_path = (SCHEMA.optimizers, 2, SCHEMA.param_groups, 0, "lr")
    ema_path = (SCHEMA.ema, "layer.weight")

    assert model_path == ("state_dict", "layer.weight")
    assert optimizer_path == ("optimizer_states", 2, "state", "layer.weight", "exp_avg")
    assert SCHEMA.is_model_tensor(model_path) and SCHEMA.model_key(model_path) == "layer.weight"
    assert not any(SCHEMA.is_model_tensor(p) for p in (optimizer_path, groups_path, ema_path, ("state_dict",)))
    assert SCHEMA.is_entry_tensor(ema_path, SCHEMA.ema) and SCHEMA.model_key(ema_path) == "layer.weight"
    assert not SCHEMA.is_entry_tensor(model_path, SCHEMA.ema)

    assert SCHEMA.is_optimizer_path(optimizer_path) and SCHEMA.is_optimizer_path(groups_path)
    assert not SCHEMA.is_optimizer_path(model_path)
    assert SCHEMA.is_optimizer_state(optimizer_path) and not SCHEMA.is_optimizer_state(groups_path)
    assert SCHEMA.optimizer_param(optimizer_path) == "layer.weight"
    items = {optimizer_path: "a", groups_path: "b", model_path: "c"}
    assert SCHEMA.optimizer_state_items(items, 2) == {("layer.weight", "exp_avg"): "a"}
