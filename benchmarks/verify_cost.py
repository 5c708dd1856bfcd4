"""Where a verified sharded load spends its time: the checksum pass against DCP's own read, in one run.

    python benchmarks/verify_cost.py              # ~50M parameters + AdamW (~600 MB) at 2 and 4 ranks; results/verify_cost.md
    python benchmarks/verify_cost.py --quick      # a tiny model at 2 ranks (the smoke test)

In fresh processes (``torchrun``, gloo, one thread per rank): a stack of ``nn.Linear`` layers, each sharded with
``fully_shard``, takes one AdamW step, is saved with ``lightning_fsdp``'s sharded format, and is then loaded back
``--rounds`` times with checksums and as many times without (alternating which goes first, the files in the page
cache). Each load is split into its phases by timing the loader's steps on every rank: the checksum pass
(``_checked``), DCP's read into the model and optimizer (``read_into``), and the rest. Also, on one core: CRC-32 on
bytes already in memory and the checksum pass as the loader runs it (read plus CRC-32) over the largest shard file.

This explains the checkpoint benchmark's "checksums' share of the load": verifying is one more pass over every byte,
so from the page cache it costs a fixed fraction of a load that is itself about one pass over memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

PHASES = ("_checked", "read_into")


def worker(width: int, layers: int, rounds: int, root: Path, out: Path) -> None:
    """One rank (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import lightning_fsdp.checkpoint.sharded_load as sharded_load
    from lightning_fsdp.checkpoint.checkpointer import Checkpointer
    from lightning_fsdp.parallel.process_group import release_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (one of the loader's steps), adding its wall time to ``spent[name]``."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    for name in PHASES:
        setattr(sharded_load, name, timed(name, getattr(sharded_load, name)))

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

    checkpointer = Checkpointer()
    path = root / "ckpt"
    state = {
        "state_dict": checkpointer.model_state_dict(model, full=False),
        "optimizer_states": [checkpointer.optimizer_state_dict(model, optimizer, full=False)],
        "epoch": 0,
        "global_step": 1,
    }
    checkpointer.save_sharded(state, path, mesh_shape=(dist.get_world_size(),))
    dist.barrier()

    loads: dict[str, list[dict[str, float]]] = {"verified": [], "unverified": []}
    for i in range(rounds):
        for verified in (True, False) if i % 2 else (False, True):
            checkpointer.verify_checksums = verified
            spent.clear()
            dist.barrier()
            started = time.perf_counter()
            checkpointer.load(path, model, [optimizer])
            dist.barrier()
            loads["verified" if verified else "unverified"].append(
                {"total": time.perf_counter() - started, **{p: spent.get(p, 0.0) for p in PHASES}}
            )
    result = {
        "rank": dist.get_rank(),
        "loads": loads,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": sum(f.stat().st_size for f in path.iterdir()),
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"ranks": gathered, "one_core": one_core(path)}))
    dist.barrier()
    release_process_group()


def one_core(path: Path) -> dict[str, float]:
    """GB/s on one core over the largest shard file: CRC-32 of bytes in memory, and the loader's checksum pass."""
    import zlib

    from lightning_fsdp.checkpoint.checksums import hash_file

    largest = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = largest.read_bytes()

    def best(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return len(data) / min(times) / 1e9

    return {
        "file_bytes": len(data),
        "crc32_in_memory_gbps": best(lambda: zlib.crc32(data)),
        "checksum_pass_gbps": best(lambda: hash_file(largest)),
    }


def run(width: int, layers: int, world: int, rounds: int, tmp: Path) -> dict:
    out = tmp / "result.json"
    args = [str(width), str(layers), str(rounds), str(tmp), str(out)]
    return torchrun_json(__file__, world, args, out, {"OMP_NUM_THREADS": "1"}, "the load timing")


def summarise(data: dict) -> dict[str, dict[str, float]]:
    """Per kind of load: medians over rounds of the slowest rank's total and of the mean rank's phases."""
    ranks = data["ranks"]
    out = {}
    for kind in ("verified", "unverified"):
        rounds = len(ranks[0]["loads"][kind])
        per_round = [[r["loads"][kind][i] for r in ranks] for i in range(rounds)]
        out[kind] = {
            "total": statistics.median(max(x["total"] for x in rs) for rs in per_round),
            **{p: statistics.median(statistics.fmean(x[p] for x in rs) for rs in per_round) for p in PHASES},
        }
    return out


def report(results: dict[int, dict], rounds: int) -> str:
    first = next(iter(results.values()))
    r0, core = first["ranks"][0], first["one_core"]
    lines = [
        f"Model: {r0['params'] / 1e6:.2f}M parameters in `nn.Linear` layers, AdamW; checkpoint"
        f" {r0['checkpoint_bytes'] / 1e6:.0f} MB. CPU (gloo, one thread per rank), {rounds} loads of each kind from"
        " the page cache; medians over loads (total: slowest rank; phases: mean rank).",
        "",
        "| ranks | load | total s | checksum pass s | DCP read s | rest s | × unverified | checksum pass ÷ DCP read |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for world, data in results.items():
        s = summarise(data)
        for kind in ("verified", "unverified"):
            row = s[kind]
            rest = row["total"] - row["_checked"] - row["read_into"]
            ratio = f"{row['_checked'] / max(row['read_into'], 1e-9):.2f}" if kind == "verified" else "–"
            lines.append(
                f"| {world} | {kind} | {row['total']:.3f} | {row['_checked']:.3f} | {row['read_into']:.3f} |"
                f" {rest:.3f} | {row['total'] / s['unverified']['total']:.2f}× | {ratio} |"
            )
    lines += [
        "",
        f"One core, over one {core['file_bytes'] / 1e6:.0f} MB shard file: CRC-32 of bytes in memory"
        f" {core['crc32_in_memory_gbps']:.1f} GB/s; the loader's checksum pass (read + CRC-32)"
        f" {core['checksum_pass_gbps']:.1f} GB/s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model at 2 ranks (the smoke test)")
    parser.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    parser.add_argument("--width", type=int, default=None, help="layer width (default 2048; --quick: 64)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=None, help="loads of each kind (default 5; --quick: 2)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        width, layers, rounds, root, out = args.worker
        worker(int(width), int(layers), int(rounds), Path(root), Path(out))
        return
    import tempfile

    worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    width = args.width or (64 if args.quick else 2048)
    rounds = args.rounds or (2 if args.quick else 5)
    results = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp_name:
            results[world] = run(width, args.layers, world, rounds, Path(tmp_name))
    text = report(results, rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "verify_cost_quick" if args.quick else "verify_cost"
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"rounds": rounds, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
