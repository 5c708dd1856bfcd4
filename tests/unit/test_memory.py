"""Byte counting, peak memory and the ``MemoryReport`` callback in one process (the multi-rank table is tested in
``tests/distributed/test_memory_report.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_fsdp.memory import (
    RankMemory,
    StateBytes,
    format_memory_table,
    full_param_bytes,
    global_state_bytes,
    local_state_bytes,
    tensor_bytes,
)
from lightning_fsdp.trainer.memory import MemoryReport, shard_group_size
from tests.helpers.models import TinyLM, loader


def _stepped(optimizer_cls=torch.optim.AdamW, **kw):
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 2))
    opt = optimizer_cls(model.parameters(), lr=0.1, **kw)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_local_and_global_bytes_of_an_unsharded_model():
    model, opt = _stepped()
    n = sum(p.numel() for p in model.parameters())
    expected = StateBytes(params=4 * n, grads=4 * n, optimizer=8 * n)  # AdamW: exp_avg, exp_avg_sq (step is a scalar)
    assert local_state_bytes(model, [opt]) == expected
    assert global_state_bytes(model, [opt]) == expected
    assert full_param_bytes(model) == 4 * n
    assert expected.as_dict()["total"] == 16 * n
    model_sgd, sgd = _stepped(torch.optim.SGD, momentum=0.9)
    assert local_state_bytes(model_sgd, [sgd]).optimizer == 4 * n  # one momentum buffer


def test_tied_parameters_are_counted_once():
    model = TinyLM()
    assert model.net.head.weight is model.net.emb.weight
    assert full_param_bytes(model) == 4 * sum(p.numel() for p in model.parameters())
    assert tensor_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30


_PEAK_PROBE = """
import json, torch
from lightning_fsdp.memory import PeakMemory, current_rss, peak_rss
tracker = PeakMemory(torch.device("cpu"))
tracker.reset()
before = current_rss()
block = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # pages are touched, so they are resident
out = {"kind": tracker.kind, "reset": tracker.peak_was_reset, "grown": current_rss() - before, "peak": tracker.peak()}
del block
tracker.reset()
out["after_reset"] = tracker.peak()
out["hwm"], out["rss"] = peak_rss(), current_rss()
print(json.dumps(out))
"""


def test_peak_memory_on_cpu_sees_a_real_allocation():
    """In a fresh interpreter, so no memory an earlier test freed (and the allocator kept) can hide the allocation."""
    proc = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["kind"] == "rss_above_baseline"
    if seen["grown"] < 60 * 1024 * 1024:
        pytest.skip(f"this kernel's RSS did not grow by a touched 64 MiB block (grew {seen['grown']} B): nothing to measure")
    assert seen["peak"] >= 60 * 1024 * 1024, seen
    if seen["reset"]:  # Linux: the high-water mark restarts at reset
        assert seen["after_reset"] < 32 * 1024 * 1024, seen


def test_table_compares_ranks_with_the_unsharded_total_and_the_ideal():
    rows = [RankMemory(400, 400, 800, rank=0, peak=5 * 1024**2), RankMemory(396, 396, 792, rank=1, peak=5 * 1024**2)]
    table = format_memory_table(rows, StateBytes(796, 796, 1592), 2)
    lines = table.splitlines()
    assert lines[0].startswith("| rank | params | grads | optimizer | state | state / ideal | peak RSS above setup |")
    assert lines[2] == "| 0 | 400 B | 400 B | 800 B | 1.56 KiB | 1.005 | 5.00 MiB |"
    assert lines[3].startswith("| 1 | 396 B | 396 B | 792 B | 1.55 KiB | 0.995 |")
    assert lines[4].startswith("| unsharded | 796 B | 796 B | 1.55 KiB | 3.11 KiB |")
    assert lines[5].startswith("| ideal / 2 | 398 B | 398 B | 796 B | 1.55 KiB | 1.000 |")
    assert "peak (CUDA allocated)" in format_memory_table(rows, StateBytes(1, 1, 1), 1, "cuda_max_allocated")
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        format_memory_table(rows, StateBytes(1, 1, 1), 0)


def test_shard_group_size_reads_the_mesh_or_the_world():
    from lightning_fsdp import FSDPCustomStrategy
    from lightning_fsdp.parallel import MeshShape

    strategy = FSDPCustomStrategy()
    strategy._mesh_shape = MeshShape(replicate=2, shard=3)
    assert shard_group_size(strategy) == 3
    assert shard_group_size(L.pytorch.strategies.SingleDeviceStrategy(torch.device("cpu"))) == 1


def test_memory_report_in_a_single_process_trainer(tmp_path, capsys):
    report = MemoryReport()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[report],
        default_root_dir=tmp_path,
    )
    model = TinyLM(build_in_configure_model=True)
    trainer.fit(model, loader(16, 4))
    out = capsys.readouterr().out
    assert out.count("Memory per rank (single_device, 1 rank(s), state sharded over 1)") == 1
    [row] = report.rows
    expected = local_state_bytes(model, trainer.optimizers)
    assert (row.params, row.grads, row.optimizer) == (expected.params, expected.grads, expected.optimizer)
    assert report.unsharded == expected
    assert row.peak > 0
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "memory/rank0/params" in metrics and "memory/rank0/peak" in metrics


_TRIM_PROBE = r"""
import json
import os
from lightning_fsdp.host_heap import release_freed_host_memory
from lightning_fsdp.memory import current_rss
blocks = [bytearray(100 * 1024) for _ in range(2000)]  # 200 MB in heap-sized blocks (below glibc's mmap threshold)
pin = bytearray(100 * 1024)  # above them: the heap cannot shrink from its top when they are freed
del blocks
before = current_rss()
released = release_freed_host_memory()
print(json.dumps({"released": released, "before": before, "after": current_rss()}))
"""


def test_freed_heap_pages_go_back_to_the_os():
    """Freed small blocks stay resident until trimmed; in a fresh interpreter, so the heap is only this one."""
    proc = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if not seen["released"]:
        pytest.skip("this C library has no malloc_trim")
    assert seen["before"] - seen["after"] >= 150 * 1024 * 1024, seen


_MAP_PROBE = r"""
import json, sys
from lightning_fsdp.host_heap import map_large_host_blocks
from lightning_fsdp.memory import current_rss
mapped = map_large_host_blocks() if sys.argv[1] == "map" else None
warm = bytearray(24 * 1024 * 1024)
del warm  # glibc raises its dynamic mmap threshold to 24 MiB: 8 MiB blocks would now come from the heap
blocks, pins = [], []
for _ in range(30):
    blocks.append(bytearray(8 * 1024 * 1024))
    pins.append(bytearray(256 * 1024))  # between them on the heap: freed blocks cannot merge into its top
before = current_rss()
del blocks
print(json.dumps({"mapped": mapped, "kept": current_rss() - (before - 240 * 1024 * 1024)}))
"""


@pytest.mark.parametrize("how", ["map", "heap"])
def test_large_host_blocks_go_back_to_the_os_when_freed(how):
    """With the fixed threshold, freed 8 MiB blocks leave RSS at once; without it (the control, which shows the probe
    can fail) they stay resident between live small blocks. In fresh interpreters, so each heap is only its own."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run([sys.executable, "-c", _MAP_PROBE, how], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if how == "map":
        if not seen["mapped"]:
            pytest.skip("this C library has no mallopt")
        assert seen["kept"] < 16 * 1024 * 1024, seen
    else:
        assert seen["kept"] >= 200 * 1024 * 1024, seen


def test_an_mmap_threshold_in_the_environment_wins(monkeypatch):
    from lightning_fsdp.host_heap import map_large_host_blocks

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert map_large_host_blocks() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert map_large_host_blocks() is False


@pytest.mark.parametrize("front_end", ["FSDPCustomStrategy", "FSDPCustomFabricStrategy"])
def test_either_front_end_releases_host_memory_on_cpu_or_offload_unless_told(front_end):
    import lightning_fsdp

    strategy = getattr(lightning_fsdp, front_end)
    assert strategy(cpu_offload=True).releases_host_memory
    assert not strategy(cpu_offload=True, release_host_memory=False).releases_host_memory
    assert strategy(parallel_devices=[torch.device("cpu")]).releases_host_memory
    assert strategy(parallel_devices=[torch.device("cpu")], release_host_memory=True).releases_host_memory


def test_only_a_run_that_trains_most_weights_counts_as_a_full_fine_tune():
    from lightning_fsdp.host_heap import trains_most_weights

    base = nn.Linear(64, 64)  # 4160 weights
    adapter = nn.Linear(64, 4)  # 260: LoRA-like, on a frozen base
    model = nn.ModuleDict({"base": base, "adapter": adapter})
    assert trains_most_weights(model)
    base.requires_grad_(False)
    assert not trains_most_weights(model)
    tied = nn.ModuleDict({"a": base, "b": base, "adapter": adapter})  # a shared module counts once
    assert not trains_most_weights(tied)
    base.requires_grad_(True)
    adapter.requires_grad_(False)
    assert trains_most_weights(tied)


def test_the_heap_is_trimmed_only_once_rss_grew_past_the_first_steps_by_the_slack(monkeypatch):
    from lightning_fsdp import host_heap as memory

    rss = iter([1000, 1100, 1200, 1201, 900, 1150, 1250])
    trimmed: list[int] = []
    monkeypatch.setattr(memory, "current_rss", lambda: next(rss))
    monkeypatch.setattr(memory, "release_freed_host_memory", lambda: trimmed.append(1) or True)
    trim = memory.HeapTrimAfterGrowth(slack=200)
    assert [trim.after_step() for _ in range(7)] == [False, False, False, True, False, False, True]
    assert trim.trims == len(trimmed) == 2 and trim.ceiling == 1200
