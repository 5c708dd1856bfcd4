"""Checkpoint save and load: ``fsdp_custom``'s verified, atomic checkpoints against plain DCP, in one run.

    python benchmarks/checkpoint_io.py            # 50M and 200M parameters + AdamW at 2 and 4 ranks; results/checkpoint_io.md
    python benchmarks/checkpoint_io.py --quick    # a tiny model at 2 ranks, one round (the smoke test)

The peer is what Lightning's ``ModelParallelStrategy`` runs for a sharded checkpoint: ``torch.distributed.checkpoint``
``save``/``load`` of the model's and optimizer's sharded state dicts into a directory (no checksums, no manifest,
written in place). Ours is :class:`lightning_fsdp.checkpoint.Checkpointer`: staged, checksummed as written (CRC-32C
per entry), fsynced, committed by a manifest and a rename; loaded with every entry checked as it is read, and, for
comparison, with the format-1 way (every file hashed in a pass before the load: ``verify_before_load``).

In fresh processes (``torchrun``, gloo, one thread per rank): a stack of ``nn.Linear`` layers, each sharded with
``fully_shard``, takes one AdamW step (so the optimizer state is twice the model). Each round saves and loads with
every peer, in an order that alternates from round to round; each load runs with the files in the page cache
(warm) and again after ``echo 3 > /proc/sys/vm/drop_caches`` (cold; skipped, and said, where it is not allowed).
Times are the slowest rank's, between barriers; the tables give medians over rounds. Our phases are timed inside
the package: staging and ``meta.pt``, DCP's write (with hashing), the commit; the checks before reading, DCP's read
(with verification), and, summed over the run, the CRC-32C computation and the ``fsync`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

#: name → (width, layers): parameters = width² × layers
MODELS = {"50M": (2048, 12), "200M": (4096, 12), "tiny": (256, 4)}
LOADS = ("ours", "ours_two_pass", "dcp")


class Timers:
    """Seconds spent inside wrapped functions (summed), per name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def worker(model_name: str, rounds: int, root: Path, out: Path) -> None:
    """One rank (started by torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint import Checkpointer, checksums, sharded, sharded_load
    from lightning_fsdp.parallel.process_group import release_process_group

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width, layers = MODELS[model_name]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

    timers = Timers()
    for owner, name, label in [
        (sharded, "stage", "save: staging + meta.pt"), (sharded, "write_shards", "save: DCP write + hashing"),
        (sharded, "commit", "save: commit (manifest, fsync, rename)"),
        (sharded_load, "checks_before_reading", "load: checks before reading"),
        (sharded_load, "read_into", "load: DCP read + verification"),
        (checksums.Crc32c, "update", "CRC-32C"), (os, "fsync", "fsync"),
    ]:
        timers.wrap(owner, name, label)

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def ours_save(path: Path) -> None:
        state = {"state_dict": get_model_state_dict(model),
                 "optimizer_states": [get_optimizer_state_dict(model, optimizer)], "epoch": 0, "global_step": 1}
        Checkpointer().save_sharded(state, path)

    def dcp_save(path: Path) -> None:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(path))

    def ours_load(path: Path, two_pass: bool = False) -> None:
        Checkpointer(verify_before_load=two_pass).load(path, model, [optimizer])

    def dcp_load(path: Path) -> None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])

    rows = []
    cold_allowed = True
    for r in range(rounds):
        order = ["ours", "dcp"] if r % 2 == 0 else ["dcp", "ours"]
        paths = {peer: root / f"r{r}-{peer}" for peer in order}
        for peer in order:
            seconds = timed(lambda peer=peer: (ours_save if peer == "ours" else dcp_save)(paths[peer]))
            rows.append({"round": r, "op": "save", "peer": peer, "seconds": seconds, "phases": timers.take()})
        loads = ["ours", "ours_two_pass", "dcp"] if r % 2 == 0 else ["dcp", "ours_two_pass", "ours"]
        for cache in ("warm", "cold"):
            for peer in loads:
                path = paths["dcp" if peer == "dcp" else "ours"]
                if cache == "cold":
                    dist.barrier()
                    ok = drop_caches() if rank == 0 else True
                    flags = [None] * world
                    dist.all_gather_object(flags, ok)
                    cold_allowed = cold_allowed and all(flags)
                    if not cold_allowed:
                        continue
                load = {"ours": ours_load, "ours_two_pass": lambda p: ours_load(p, True), "dcp": dcp_load}[peer]
                seconds = timed(lambda load=load, path=path: load(path))
                rows.append({"round": r, "op": f"load ({cache})", "peer": peer, "seconds": seconds,
                             "phases": timers.take()})
        dist.barrier()
        if rank == 0:
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        state_bytes = width * width * layers * 4 * 3  # params + exp_avg + exp_avg_sq, fp32, both peers alike
        out.write_text(json.dumps({"ranks": gathered, "cold_allowed": cold_allowed, "bytes": state_bytes}))
    release_process_group()


def summarize(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (op, peer): the median over rounds of the slowest rank's seconds, and rank 0's phases (medians)."""
    by: dict[tuple[str, str], dict[str, list]] = {}
    for rank_rows in result["ranks"]:
        for row in rank_rows:
            entry = by.setdefault((row["op"], row["peer"]), {"seconds": {}, "phases": {}})
            rnd = row["round"]
            entry["seconds"][rnd] = max(entry["seconds"].get(rnd, 0.0), row["seconds"])
            for phase, s in row["phases"].items():
                per_round = entry["phases"].setdefault(phase, {})
                per_round[rnd] = max(per_round.get(rnd, 0.0), s)
    return {
        key: {"seconds": statistics.median(v["seconds"].values()), "rounds": sorted(v["seconds"].values()),
              "phases": {p: statistics.median(s.values()) for p, s in v["phases"].items()}}
        for key, v in by.items()
    }


def report(results: dict[str, dict[str, Any]], rounds: int) -> str:
    lines = [
        f"CPU, gloo, one thread per rank; {rounds} round(s), the order of the peers alternating; medians of the slowest"
        " rank's seconds. `dcp`: torch.distributed.checkpoint save/load (what ModelParallelStrategy runs: no checksums,"
        " no commit). `ours`: verified as read (one read per byte); `ours_two_pass`: every file hashed first.",
        "",
        "| model, ranks | checkpoint | op | ours s | two-pass s | dcp s | ours × dcp | two-pass × dcp | rounds (ours) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, result in results.items():
        summary = summarize(result)
        gib = result["bytes"] / 2**30
        for op in ("save", "load (warm)", "load (cold)"):
            if (op, "ours") not in summary:
                lines.append(f"| {name} | {gib:.2f} GiB | {op} | — | — | — | page cache could not be dropped | | |")
                continue
            ours, dcp = summary[(op, "ours")]["seconds"], summary[(op, "dcp")]["seconds"]
            two = summary.get((op, "ours_two_pass"), {}).get("seconds")
            rounds_text = " / ".join(f"{s:.2f}" for s in summary[(op, "ours")]["rounds"])
            lines.append(
                f"| {name} | {gib:.2f} GiB | {op} | {ours:.2f} | {'' if two is None else f'{two:.2f}'} | {dcp:.2f} |"
                f" {ours / dcp:.2f}× | {'' if two is None else f'{two / dcp:.2f}×'} | {rounds_text} |"
            )
    lines += ["", "Where our time goes (rank 0, medians, seconds):", "",
              "| model, ranks | op | phases |", "|---|---|---|"]
    for name, result in results.items():
        summary = summarize(result)
        for op in ("save", "load (warm)", "load (cold)"):
            if (op, "ours") in summary:
                phases = ", ".join(f"{p} {s:.2f}" for p, s in sorted(summary[(op, "ours")]["phases"].items()))
                lines.append(f"| {name} | {op} | {phases} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model at 2 ranks, one round (the smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="50M,200M")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), Path(args.worker[2]), Path(args.worker[3]))
        return
    import tempfile

    models = ["tiny"] if args.quick else args.models.split(",")
    worlds = [2] if args.quick else [int(w) for w in args.worlds.split(",")]
    rounds = 1 if args.quick else args.rounds
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        for model in models:
            for world in worlds:
                out = tmp / f"{model}-{world}.json"
                env = {"OMP_NUM_THREADS": "1"}
                results[f"{model}, {world}"] = torchrun_json(
                    __file__, world, [model, str(rounds), str(tmp), str(out)], out, env, f"checkpoint I/O {model}"
                )
    text = report(results, rounds)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "checkpoint_io_quick" if args.quick else "checkpoint_io"
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
