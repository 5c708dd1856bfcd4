import pytest
import torch

from lightning_fsdp.precision import mixed_precision_policy, normalize_precision
from lightning_fsdp.trainer.precision import FSDP2Precision


@pytest.mark.parametrize(
    ("flag", "param", "reduce"),
    [
        ("32-true", None, None),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),
        ("bf16-true", None, None),
    ],
)
def test_policy_per_precision(flag, param, reduce):
    policy = mixed_precision_policy(flag)
    assert policy.param_dtype == param and policy.reduce_dtype == reduce


def test_aliases():
    assert normalize_precision("bf16") == "bf16-mixed"
    assert normalize_precision(32) == "32-true"


@pytest.mark.parametrize("bad", ["8-mixed", "transformer-engine", None, True])
def test_unknown_precision_lists_choices(bad):
    with pytest.raises(ValueError, match=r"precision=.* is not supported by the fsdp_custom strategies. Choose one of"):
        normalize_precision(bad)


def test_override_from_yaml_like_dict():
    policy = mixed_precision_policy("32-true", {"param_dtype": "bfloat16", "reduce_dtype": "torch.float32"})
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="Unknown `mixed_precision` keys"):
        mixed_precision_policy("32-true", {"param": "bf16"})
    with pytest.raises(ValueError, match="is not a dtype"):
        mixed_precision_policy("32-true", {"param_dtype": "bf17"})


def test_true_precision_converts_module_and_inputs():
    plugin = FSDP2Precision("bf16-true")
    module = plugin.convert_module(torch.nn.Linear(2, 2))
    assert module.weight.dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2)).dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2, dtype=torch.long)).dtype == torch.long
    with plugin.tensor_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_mixed_keeps_fp32_storage_and_enables_autocast():
    plugin = FSDP2Precision("bf16-mixed")
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float32
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")


def test_scaler_only_for_fp16():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(FSDP2Precision("16-mixed").scaler, ShardedGradScaler)
    assert FSDP2Precision("bf16-mixed").scaler is None
    with pytest.raises(ValueError, match="does not use a gradient scaler"):
        FSDP2Precision("bf16-mixed", scaler=object())


def test_total_grad_norm_without_process_group_matches_torch():
    from lightning_fsdp.parallel.grad_norm import clip_grad_norm_ as clip_grad_norm_sharded

    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 5)
    a(x).pow(2).sum().backward()
    b(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    got = clip_grad_norm_sharded(list(a.parameters()), 0.1)
    torch.testing.assert_close(got, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)
