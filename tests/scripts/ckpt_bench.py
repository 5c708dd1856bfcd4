"""Checkpoint throughput: sharded save (sync and async), verified load, full save, consolidation.

``torchrun --nproc_per_node N tests/scripts/ckpt_bench.py --mb 256 --dir /tmp/bench`` (CPU/gloo or CUDA/nccl).
Rank 0 prints one JSON line: seconds and MB/s per operation for a model of ``--mb`` MiB of fp32 parameters
(checkpoint size ≈ 3× that with AdamW state), and the peak RSS increase of consolidation (Linux). Numbers, not
assertions: the tests never time anything. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` for honest RSS peaks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def build(mb: int, device: torch.device, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, mb * 2**20 // (4 * width * width))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def checkpoint(model, opt, full: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return {
        "epoch": 0,
        "global_step": 1,
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_states": [get_optimizer_state_dict(model, opt, options=options)],
    }


def _status_kb(field: str) -> int:
    import re

    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak_rss() -> int:
    """Linux: reset the peak-RSS mark to the current RSS; returns it in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmHWM") * 1024


def _peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--dir", default="ckpt_bench")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_fsdp.checkpoint import Checkpointer, consolidate_checkpoint

    mesh = init_device_mesh(device.type, (world,))
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    model, opt = build(args.mb, device, mesh)
    sync, background = Checkpointer(), Checkpointer(async_save=True)
    results: dict[str, float] = {}
    results["save_sharded_s"] = timed(lambda: sync.save_sharded(checkpoint(model, opt), root / "sharded.ckpt"))
    size = sum(p.stat().st_size for p in (root / "sharded.ckpt").iterdir()) if rank == 0 else 0
    size = [size]
    dist.broadcast_object_list(size)
    size_mb = size[0] / 2**20

    def raw_dcp() -> None:  # the same shards through plain DCP: no staging, manifest, checksums or commit
        import torch.distributed.checkpoint as dcp

        sd = checkpoint(model, opt)
        flat = {f"m/{k}": v for k, v in sd["state_dict"].items()}
        flat.update({f"o/{k}/{n}": t for k, st in sd["optimizer_states"][0]["state"].items() for n, t in st.items()})
        dcp.save(flat, checkpoint_id=root / "raw_dcp")

    results["raw_dcp_save_s"] = timed(raw_dcp)
    results["save_async_blocking_s"] = timed(
        lambda: background.save_sharded(checkpoint(model, opt), root / "async.ckpt")
    )
    results["save_async_commit_s"] = timed(background.finalize)
    results["load_verified_s"] = timed(lambda: sync.load(root / "sharded.ckpt", model, [opt]))
    results["load_unverified_s"] = timed(
        lambda: Checkpointer(verify_checksums=False).load(root / "sharded.ckpt", model, [opt])
    )
    results["save_full_s"] = timed(lambda: sync.save_full(checkpoint(model, opt, full=True), root / "full.ckpt"))
    results["load_full_s"] = timed(lambda: sync.load(root / "full.ckpt", model, [opt]))
    if rank == 0:
        del model, opt  # consolidation runs in a process of its own in practice: measure it alone
        gc.collect()
        peaks: dict[str, float] = {}
        for fmt, name in (("ckpt", "consolidated.ckpt"), ("safetensors", "weights.safetensors")):
            base = _reset_peak_rss()
            start = time.perf_counter()
            consolidate_checkpoint(root / "sharded.ckpt", root / name, format=fmt, progress=False)
            results[f"consolidate_{fmt}_s"] = time.perf_counter() - start
            peaks[f"consolidate_{fmt}_peak_rss_MiB"] = round((_peak_rss() - base) / 2**20, 1)
        rates = {k[: -len("_s")] + "_MBps": round(size_mb / v, 1) for k, v in results.items() if v > 0}
        info = {"world_size": world, "device": device.type, "checkpoint_MiB": round(size_mb, 1)}
        print(json.dumps({**info, **{k: round(v, 3) for k, v in results.items()}, **rates, **peaks}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
