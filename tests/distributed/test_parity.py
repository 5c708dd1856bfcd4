"""Sharded training equals an unsharded single-process run on the same global batch (fp32 default tolerances).

Per-rank batch = global / world size and the loss is a mean over the local batch, so the rank-averaged loss is
the reference loss. The sampler does not shuffle here, so the ranks' batches together are the reference batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import train

GLOBAL_BATCH = 8
STEPS = 6


#: single-process references by spec: several parity tests compare against the same one (per test process)
_REFERENCES: dict[str, dict] = {}


def _reference(tmp_path, *, model=None, steps=STEPS, **extra):
    spec = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": steps, "model": model or {}, **extra}
    key = json.dumps(spec, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = train(spec, tmp_path, "reference")
    return _REFERENCES[key]


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
    # the three blocks (one shape) gather into, and reduce-scatter out of, a few host buffers handed on; the root's
    # gather is its own: the blocks' buffers held are at most the pool's four of one size
    pool = result["comm_buffers"]
    assert 1 <= pool["allocated"] <= 4 < 6 * 3 < pool["reused"], pool


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


# -- torch.compile per unit ------------------------------------------------------------------------------------------
def _checkpoint_keys(path) -> list[str]:
    from lightning_fsdp.checkpoint.safe_load import read_metadata

    return list(read_metadata(path).state_dict_metadata)


@pytest.mark.slow  # the default suite compiles a HF Llama's blocks with activation checkpointing instead
def test_compiled_units_with_activation_checkpointing_equal_one_process(tmp_path):
    """fp32 on CPU, held to torch's default fp32 tolerances against one process whose blocks are checkpointed and
    compiled the same way (inductor's fused kernels round differently from eager by ~1e-5 on some CPUs, so an eager
    reference would test the CPU, not the sharding). One graph serves the three identical blocks, forward and
    recompute alike; none is compiled after the warm-up steps; the checkpoint keeps the parameter names."""
    kwargs = {"compile": True, "activation_checkpointing_policy": ["Block"]}
    reference = _reference(tmp_path, compile_like_strategy=kwargs)
    result = _sharded(tmp_path, 2, name="compiled", strategy_kwargs=kwargs, count_compiles_after=2,
                      save_path=str(tmp_path / "compiled.ckpt"))
    assert result["wrapped_units"] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]
    assert_parity(result, reference)
    assert result["compiled_graphs"]["after_warmup"] == result["compiled_graphs"]["at_end"] >= 1
    keys = _checkpoint_keys(tmp_path / "compiled.ckpt")
    assert "state_dict/net.layers.0.qkv.weight" in keys and not any("_orig_mod" in k for k in keys)


@pytest.mark.slow
def test_compiled_bf16_mixed_at_four_ranks_tracks_eager(tmp_path):
    """bf16-mixed: the compiled graph may keep intermediates in fp32 where eager rounds them to bf16, so compiled
    and eager agree to bf16's own resolution (torch's bf16 defaults: rtol 1.6e-2), not fp32's."""
    eager = _sharded(tmp_path, 4, name="eager_bf16", precision="bf16-mixed")
    compiled = _sharded(tmp_path, 4, name="compiled_bf16", precision="bf16-mixed", strategy_kwargs={"compile": True})
    torch.testing.assert_close(
        torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1.6e-2, atol=1e-5
    )


@pytest.mark.slow
def test_compiled_hsdp_offload_meta_init_equals_eager(tmp_path):
    """compile with HSDP (2 × 2), CPU offload and a model built on the meta device: equal to the same run eager."""
    kwargs = {"replicate_size": 2, "shard_size": 2, "cpu_offload": True}
    common = {"devices": 4, "batch_size": GLOBAL_BATCH // 4, "max_steps": STEPS, "empty_init": True}
    eager = train({**common, "strategy_kwargs": kwargs}, tmp_path, "eager_hsdp")
    compiled = train({**common, "strategy_kwargs": {**kwargs, "compile": True}}, tmp_path, "compiled_hsdp")
    assert_parity(compiled, eager)
