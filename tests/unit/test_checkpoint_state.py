"""Pure transformations of checkpoint dicts: tensor split/merge, plain containers, optimizer key formats."""

from __future__ import annotations

import argparse
import enum
import io
import pathlib
from dataclasses import dataclass

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from omegaconf import OmegaConf

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.state import (
    extract_tensors,
    insert_tensors,
    is_id_keyed,
    optimizer_state_to_fqns,
    optimizer_state_to_ids,
    plain_checkpoint_meta,
    storage_key,
    to_plain,
)


def test_extract_and_insert_tensors_round_trip():
    t = [torch.randn(2) for _ in range(5)]
    tree = {
        "state": {"a.weight": {"step": t[0], "exp_avg": t[1], "note": "x"}, "b": {}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight"]}],
        "buffers": [t[2], 3, (t[3], "y")],
        "top": t[4],
    }
    skeleton, tensors = extract_tensors(tree, ("opt", 0))
    assert set(tensors) == {
        ("opt", 0, "state", "a.weight", "step"),
        ("opt", 0, "state", "a.weight", "exp_avg"),
        ("opt", 0, "buffers", 0),
        ("opt", 0, "buffers", 2, 0),
        ("opt", 0, "top"),
    }
    assert skeleton["state"]["a.weight"] == {"note": "x"}
    assert skeleton["buffers"] == [None, 3, (None, "y")]
    rebuilt = insert_tensors({**skeleton, "buffers": [None, 3, [None, "y"]]}, tensors, ("opt", 0))
    assert rebuilt["state"]["a.weight"]["exp_avg"] is t[1]
    assert rebuilt["buffers"][0] is t[2] and rebuilt["buffers"][2][0] is t[3]
    assert rebuilt["top"] is t[4] and rebuilt["param_groups"] == tree["param_groups"]


def test_insert_creates_missing_levels():
    tensor = torch.ones(1)
    assert insert_tensors({}, {("s", "p", "exp_avg"): tensor}, ("s",)) == {"p": {"exp_avg": tensor}}


def test_extract_rejects_non_string_keys():
    with pytest.raises(CheckpointError, match="only str and int keys"):
        extract_tensors({("a", "b"): torch.ones(1)})


def test_storage_key_is_readable():
    assert storage_key(("optimizer_states", 0, "state", "net.w", "exp_avg")) == "optimizer_states/0/state/net.w/exp_avg"


class Color(enum.Enum):
    RED = "red"


@dataclass
class Config:
    width: int
    path: pathlib.Path


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


def _weights_only_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_to_plain_makes_hparams_loadable_with_weights_only():
    hparams = AttributeDict(
        cfg=OmegaConf.create({"lr": 0.1, "layers": [1, 2], "ref": "${lr}"}),
        ns=argparse.Namespace(a=1),
        color=Color.RED,
        data=Config(3, pathlib.Path("data") / "x"),
        frozen=("a", "b"),
        tags=frozenset({"t"}),
        dtype=torch.bfloat16,
        scale=torch.tensor(2.0),
    )
    converted: list[str] = []
    plain = to_plain(hparams, (), converted)
    assert type(plain) is dict and converted == []
    assert plain["cfg"] == {"lr": 0.1, "layers": [1, 2], "ref": 0.1}
    assert plain["ns"] == {"a": 1} and plain["color"] == "red"
    assert plain["data"] == {"width": 3, "path": str(pathlib.Path("data") / "x")}
    loaded = _weights_only_round_trip(plain)
    assert loaded["frozen"] == ("a", "b") and loaded["tags"] == {"t"} and loaded["dtype"] is torch.bfloat16


def test_to_plain_reports_what_it_could_not_keep():
    converted: list[str] = []
    assert to_plain({"x": [Opaque()]}, (), converted) == {"x": ["Opaque()"]}
    assert converted == ["checkpoint['x'][0] (Opaque)"]
    with pytest.warns(UserWarning, match=r"checkpoint\['hyper_parameters'\]\['obj'\]"):
        meta = plain_checkpoint_meta({"hyper_parameters": {"obj": Opaque()}, "hparams_type": AttributeDict})
    assert "hparams_type" not in meta


def test_optimizer_state_keys_round_trip():
    by_name = {
        "state": {"a": {"step": torch.tensor(1.0)}, "c": {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}, {"lr": 0.2, "params": ["c"]}],
    }
    by_id = optimizer_state_to_ids(by_name)
    assert is_id_keyed(by_id) and not is_id_keyed(by_name)
    assert [g["params"] for g in by_id["param_groups"]] == [[0, 1], [2]]
    assert set(by_id["state"]) == {0, 2}
    back = optimizer_state_to_fqns(by_id, [["a", "b"], ["c"]])
    assert back["param_groups"] == by_name["param_groups"] and back["state"].keys() == by_name["state"].keys()
    with pytest.raises(CheckpointError, match=r"sizes \[2, 1\].*\[3\]"):
        optimizer_state_to_fqns(by_id, [["a", "b", "c"]])
