"""Sharded training equals an unsharded single-process run on the same global batch (fp32 default tolerances).

Per-rank batch = global / world size and the loss is a mean over the local batch, so the rank-averaged loss is
the reference loss. The sampler does not shuffle here, so the ranks' batches together are the reference batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import train

GLOBAL_BATCH = 8
STEPS = 6


def _reference(tmp_path, *, model=None, steps=STEPS, **extra):
    spec = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": steps, "model": model or {}, **extra}
    return train(spec, tmp_path, "reference")


def _sharded(tmp_path, world, *, model=None, steps=STEPS, accumulate=1, name="sharded", **extra):
    spec = {
        "strategy": "fsdp_custom",
        "devices": world,
        "batch_size": GLOBAL_BATCH // world // accumulate,
        "max_steps": steps,
        "model": model or {},
        "accumulate_grad_batches": accumulate,
        **extra,
    }
    return train(spec, tmp_path, name)


def assert_parity(result, reference):
    losses = torch.tensor(result["losses"])
    ref = torch.tensor(reference["losses"])
    if len(losses) != len(ref):  # accumulation records each micro-batch's loss already divided by their count
        losses = losses.view(len(ref), -1).sum(1)
    torch.testing.assert_close(losses, ref)
    assert result["params"].keys() == reference["params"].keys()
    for name, ref_param in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref_param, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_parity_uneven_tied_transformer(tmp_path, world):
    """Auto-wrapped transformer blocks, tied embedding/head, dims no world size divides."""
    reference = _reference(tmp_path)
    result = _sharded(tmp_path, world)
    assert result["wrapped_units"] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]
    assert result["world_size"] == world
    assert_parity(result, reference)


def test_parity_frozen_params_and_clipping(tmp_path):
    """LoRA-like frozen parameters, and clip-by-norm computed over the sharded gradients. The non-finite check is
    on too (it changes nothing without NaNs): both share one norm per step, computed with one all-reduce, and the
    whole check-and-clip costs one device→host transfer (the agreed skip flags)."""
    model = {"frozen": ["net.layers.0", "net.emb"], "lr": 3e-2}
    reference = _reference(tmp_path, model=model, gradient_clip_val=0.05)
    result = _sharded(
        tmp_path, 2, model=model, gradient_clip_val=0.05, count_norm_work_at=3,
        strategy_kwargs={"skip_nonfinite_steps": True},
    )
    assert_parity(result, reference)
    assert result["norm_work_in_step"] == {"norms": 1, "norm_all_reduces": 1, "host_transfers": 1}
    frozen_before = {k: v for k, v in result["params"].items() if k.startswith("net.layers.0")}
    assert frozen_before


def test_parity_gradient_accumulation(tmp_path):
    """Two micro-batches per step with the reduce-scatter skipped on the first."""
    reference = _reference(tmp_path, steps=4)
    result = _sharded(tmp_path, 2, steps=4, accumulate=2)
    assert len(result["losses"]) == 2 * len(reference["losses"])
    assert_parity(result, reference)
