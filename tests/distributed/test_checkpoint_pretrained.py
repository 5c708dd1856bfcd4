"""Pretrained weights into a model built on the meta device, without a full copy on any rank.

Two paths, measured in one job: a ``.ckpt`` is read by rank 0 and broadcast tensor by tensor (the other ranks hold one
full tensor at a time); safetensors are read shard by shard on every rank (no rank reads more than its own rows).
The model is ~40 MiB (4 blocks of 512 wide, largest tensor 3 MiB), large enough for peak-RSS measurements to mean
something. Each rank resets the kernel's peak-RSS mark right before each load and reads it right after.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.hf import save_safetensors_dir
from tests.helpers.models import TinyLM
from tests.scripts.ckpt_jobs import job

MODEL = {"vocab": 37, "dim": 512, "heads": 4, "layers": 4, "seq": 7}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc/self/status")
def test_pretrained_load_keeps_other_ranks_far_below_a_full_copy(tmp_path):
    torch.manual_seed(123)
    weights = {k: v.clone() for k, v in TinyLM(**MODEL).state_dict().items()}
    full_bytes = sum(v.numel() * v.element_size() for k, v in weights.items() if k != "net.head.weight")  # tied
    largest = max(v.numel() * v.element_size() for v in weights.values())
    assert full_bytes > 40e6 and largest < full_bytes / 10
    save_file(
        {k: v for k, v in weights.items() if k != "net.head.weight"}
        | {"net.head.weight": weights["net.emb.weight"].clone()},
        str(tmp_path / "weights.safetensors"),
    )
    torch.save({"state_dict": weights}, tmp_path / "weights.ckpt")
    save_safetensors_dir(weights, tmp_path / "sharded", files=6)

    result = job(
        {
            "devices": 2,
            "stage": "validate",
            "limit_val_batches": 1,
            "empty_init": True,  # built on the meta device: no rank ever materialises the full model
            "model": MODEL,
            "strategy_kwargs": {"pretrained_weights": str(tmp_path / "weights.safetensors")},
            "pretrained_probe": str(tmp_path / "weights.ckpt"),
            "pretrained_probe_sharded": str(tmp_path / "sharded"),
        },
        tmp_path,
        "pretrained",
        # a fixed mmap threshold: every large buffer is mapped on allocation and unmapped on free, so freed memory
        # the allocator kept from earlier work cannot hide a new allocation from the peak-RSS measurement
        env={"MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    # the strategy option loaded the file into the shards (then the probe loaded the same weights again)
    assert result["params"].keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(result["params"][name], value), name
    rank0, rank1 = result["probe_peak_bytes"]
    print(
        f"peak RSS increase during load_pretrained: rank 0 {rank0 / 2**20:.1f} MiB, rank 1 {rank1 / 2**20:.1f} MiB;"
        f" full weights {full_bytes / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB"
    )
    assert rank1 < 0.25 * full_bytes  # one full tensor at a time plus its shard, never the model
    assert rank0 > 0.5 * full_bytes  # rank 0 does read the whole file: the measurement sees a full copy
    sharded = result["probe_sharded_peak_bytes"]
    print(f"peak RSS increase during the sharded safetensors load, per rank: {[f'{b / 2**20:.1f} MiB' for b in sharded]}")
    assert all(b <= 0.25 * full_bytes for b in sharded), sharded  # every rank, rank 0 included
