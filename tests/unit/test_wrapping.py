import pytest
import torch
from torch import nn

from lightning_fsdp.sharding import find_repeated_block_classes, resolve_policy, select_units
from tests.helpers.models import Block, TinyLM


def _lm(**kw) -> nn.Module:
    return TinyLM(**kw)


def test_auto_finds_transformer_blocks():
    model = _lm()
    assert find_repeated_block_classes(model) == {Block}
    assert select_units(model, "auto") == ["net.layers.0", "net.layers.1", "net.layers.2"]


def test_auto_prefers_no_split_modules():
    model = _lm()
    model._no_split_modules = ["LayerNorm"]
    assert find_repeated_block_classes(model) == {nn.LayerNorm}


def test_auto_ignores_repeated_parameterless_modules():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.ReLU())
    assert find_repeated_block_classes(model) == set()
    with pytest.warns(UserWarning, match="found no repeated blocks"):
        assert select_units(model, "auto") == []


@pytest.mark.parametrize("policy", [{Block}, {"Block"}, ["tests.helpers.models.Block"], lambda m: isinstance(m, Block)])
def test_class_name_and_callable_policies(policy):
    assert select_units(_lm(), policy) == ["net.layers.0", "net.layers.1", "net.layers.2"]


def test_size_policy_wraps_bottom_up():
    model = _lm()
    block_params = sum(p.numel() for p in model.net.layers[0].parameters())
    units = select_units(model, block_params)
    assert units[:3] == ["net.layers.0", "net.layers.1", "net.layers.2"]


def test_units_are_deepest_first():
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    units = select_units(outer, {"Sequential", "Linear"})
    depths = [u.count(".") for u in units]
    assert depths == sorted(depths, reverse=True)


def test_tied_module_is_not_a_separate_unit():
    model = _lm(tied=True)
    assert "net.head" not in select_units(model, {"Linear", "Embedding"})
    assert "net.emb" not in select_units(model, {"Linear", "Embedding"})
    assert "net.head" in select_units(_lm(tied=False), {"Linear", "Embedding"})


def test_policy_matching_nothing_names_the_classes():
    with pytest.raises(ValueError, match=r"auto_wrap_policy=\{'DecoderLayer'\}` matched no module in TinyLM.*'Block'"):
        select_units(_lm(), {"DecoderLayer"})


@pytest.mark.parametrize(
    ("policy", "exc", "match"),
    [
        ("transformer", ValueError, "not a known policy"),
        (0, ValueError, "minimum parameter count"),
        (True, TypeError, "ambiguous"),
        ([], ValueError, "empty collection"),
        ([3.5], TypeError, "nn.Module classes or class names"),
        ({int}, TypeError, "nn.Module classes or class names"),
    ],
)
def test_bad_policies(policy, exc, match):
    with pytest.raises(exc, match=match):
        resolve_policy(policy, nn.Linear(2, 2), arg_name="auto_wrap_policy")


def test_none_means_root_only():
    assert resolve_policy(None, nn.Linear(2, 2)) is None
    assert select_units(_lm(), None) == []


def test_activation_checkpointing_keeps_parameter_names():
    from lightning_fsdp.sharding import apply_activation_checkpointing

    model = _lm()
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, {"Block"}) == ["net.layers.0", "net.layers.1", "net.layers.2"]
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, 37, (2, 7))
    model(x).sum().backward()
    assert model.net.layers[0].qkv.weight.grad is not None
