"""torch.compile per unit: options validated up front, names kept, a block that cannot compile named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fsdp.sharding.compile import CompileError, compile_options, compile_units


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        x = self.lin(x)
        torch._dynamo.graph_break()  # what an unsupported op does: fullgraph=True cannot compile this block
        return x * 2


def test_options_forms():
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {}
    assert compile_options({"fullgraph": True, "root": True}) == {"fullgraph": True, "root": True}
    with pytest.raises(ValueError, match=r"Unknown `compile` keys \['fulgraph'\]"):
        compile_options({"fulgraph": True})
    with pytest.raises(TypeError, match="must be a bool or a dict"):
        compile_options("yes")


def test_compiled_units_keep_parameter_names_and_the_root_stays_eager():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    names = [n for n, _ in model.named_parameters()]
    root_forward = model.forward
    assert compile_units(model, ["0", "1", ""], True) == ["0", "1"]
    assert [n for n, _ in model.named_parameters()] == names
    assert model.forward == root_forward
    assert model(torch.ones(2, 3)).shape == (2, 3)


def test_a_block_that_cannot_be_compiled_is_named_with_the_fix():
    model = nn.Sequential(Breaks())
    compile_units(model, ["0"], {"fullgraph": True})
    with pytest.raises(CompileError, match=r"could not compile the FSDP unit '0' \(Breaks\).*drop `fullgraph`"):
        model(torch.ones(2, 3))


def test_the_strategy_rejects_bad_compile_options_before_any_process_starts():
    from lightning_fsdp import FSDPCustomStrategy

    with pytest.raises(ValueError, match="Unknown `compile` keys"):
        FSDPCustomStrategy(compile={"backend": "inductor", "modee": "max-autotune"})
