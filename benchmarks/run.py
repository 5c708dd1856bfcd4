"""Side-by-side benchmarks: ``fsdp_custom`` against Lightning's own ways to train the same model.

    python benchmarks/run.py            # CPU/gloo: 3 model sizes × world sizes 1, 2, 4 (~26 min on 2 cores)
    python benchmarks/run.py --quick    # tiny model, 1-2 ranks, 2 steps: checks the harness (~30 s)
    python benchmarks/run.py --gpu      # CUDA: adds Lightning's FSDP1, reports tokens/s, MFU, max allocated

Every configuration runs in its own fresh processes (``benchmarks/worker.py`` under Lightning's launcher) with
the same model, seed, data, batch and thread settings. Configurations of one (model, world size) run back to
back, in a rotating peer order, so background load on a shared machine falls on all peers alike. Results go to
``--out`` (default ``benchmarks/results``): ``raw.json``, ``RESULTS.md``, ``headline.md`` and the PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "worker.py"
sys.path.insert(0, str(REPO))

#: GPT shapes of the package's presets (``lightning_fsdp.models.PRESETS``), sequence length set per mode
MODELS: dict[str, dict[str, int]] = {
    "gpt-tiny": {"n_layer": 2, "n_head": 2, "d_model": 64},
    "gpt-5m": {"n_layer": 6, "n_head": 8, "d_model": 256},
    "gpt-50m": {"n_layer": 10, "n_head": 10, "d_model": 640},
    "gpt-200m": {"n_layer": 16, "n_head": 16, "d_model": 1024},
}
CPU_PEERS = ("fsdp_custom", "fsdp_custom_offload", "mp_fsdp2", "ddp")
GPU_PEERS = ("fsdp_custom", "fsdp_custom_offload", "mp_fsdp2", "fsdp1", "ddp")
#: the compile comparison: this package compiled and eager, against the hand-written peer eager and hand-compiled
COMPILE_PEERS = ("fsdp_custom", "fsdp_custom_compiled", "mp_fsdp2", "mp_fsdp2_compiled")
GPU_COMPILE_PEERS = (*COMPILE_PEERS, "fsdp_custom_offload", "fsdp_custom_offload_compiled")
#: peers whose sharded checkpoint save/load is timed (ours against Lightning's ModelParallelStrategy)
CHECKPOINT_PEERS = ("fsdp_custom", "mp_fsdp2")
# glibc keeps freed heap pages resident (its mmap threshold grows to 32 MiB); a fixed threshold makes RSS follow
# live tensors, the CPU counterpart of torch.cuda.max_memory_allocated. Set for every peer alike.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclass
class Mode:
    """What one invocation runs."""

    name: str
    device: str
    precision: str
    models: list[str]
    worlds: list[int]
    peers: list[str]
    seq_len: int
    batch: int
    warmup: int
    steps: int
    vocab_size: int = 256
    threads: int = 1
    #: (model, world) pairs to skip (too slow or too large for the machine)
    skip: set[tuple[str, int]] = field(default_factory=set)
    budget_bytes: Optional[int] = None
    budget_template: Optional[dict[str, int]] = None
    budget_world: int = 4
    budget_batch: int = 1
    timeout_s: float = 900.0
    #: save/load rounds per checkpointed configuration (the best of them is reported)
    checkpoint_rounds: int = 3
    #: per-model changes to the settings above (e.g. fewer steps for the largest model)
    per_model: dict[str, dict[str, int]] = field(default_factory=dict)
    #: (model, world) → how many times the step-time pair (fsdp_custom, mp_fsdp2) runs in total, alternating
    #: which goes first; the median is reported
    pair_repeats: dict[tuple[str, int], int] = field(default_factory=dict)


def cpu_mode() -> Mode:
    return Mode(
        name="cpu",
        device="cpu",
        precision="32-true",
        models=["gpt-5m", "gpt-50m", "gpt-200m"],
        worlds=[1, 2, 4],
        peers=list(CPU_PEERS),
        seq_len=128,
        batch=1,
        warmup=2,
        steps=4,
        # 200M parameters at 1-2 ranks add ~5 min on 2 cores and nothing the 4-rank runs and the single-process
        # reference do not already show
        skip={("gpt-200m", 1), ("gpt-200m", 2)},
        # a 200M step takes ~10-20 s at 4 ranks on 2 cores: fewer steps
        per_model={"gpt-200m": {"warmup": 1, "steps": 3, "checkpoint_rounds": 2}},
        # the step-time target compares these two; one extra process on the 2 cores skews a single run by up to 2x
        pair_repeats={("gpt-5m", 2): 3, ("gpt-5m", 4): 3, ("gpt-50m", 2): 3, ("gpt-50m", 4): 3},
        budget_bytes=512 * 1024**2,
        budget_template={"n_head": 10, "d_model": 640},  # the width of gpt-50m; depth is what the budget decides
    )


def quick_mode() -> Mode:
    return Mode(
        name="quick",
        device="cpu",
        precision="32-true",
        models=["gpt-tiny"],
        worlds=[2],
        peers=["fsdp_custom", "mp_fsdp2", "ddp"],
        seq_len=32,
        batch=2,
        warmup=1,
        steps=2,
        timeout_s=240.0,
        checkpoint_rounds=1,
    )


def gpu_mode(world: int) -> Mode:
    """Sized to finish within 10 minutes on one GPU: 2 models × 6 configurations × ~25 s."""
    return Mode(
        name="gpu",
        device="cuda",
        precision="bf16-mixed",
        models=["gpt-50m", "gpt-200m"],
        worlds=[world],
        peers=list(GPU_PEERS),
        seq_len=1024,
        batch=8,
        warmup=5,
        steps=15,
        timeout_s=300.0,
    )


def compile_mode(gpu: bool) -> Mode:
    """compile=True against eager and against ModelParallelStrategy eager and hand-compiled. CPU: the GPT-5M at 2
    ranks (inductor gives no speed-up on small matmul-bound CPU blocks: the figures are reported as measured). GPU:
    world size 1, with and without CPU offload, sized for 8 minutes on one GPU."""
    if gpu:
        return Mode(name="gpu-compile", device="cuda", precision="bf16-mixed", models=["gpt-200m"], worlds=[1],
                    peers=list(GPU_COMPILE_PEERS), seq_len=1024, batch=8, warmup=5, steps=15, timeout_s=240.0)
    return Mode(name="compile", device="cpu", precision="32-true", models=["gpt-5m"], worlds=[2],
                peers=list(COMPILE_PEERS), seq_len=128, batch=1, warmup=3, steps=6, timeout_s=600.0,
                checkpoint_rounds=1)


# -- running configurations -------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free rendezvous port (torchrun's static rendezvous cannot pick one itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_json(script: str, world: int, args: list[str], out: Path, env: dict[str, str], what: str) -> Any:
    """Run ``script --worker ARGS`` on ``world`` local ranks with ``torchrun``; returns the JSON it wrote to ``out``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={free_port()}",
           script, "--worker", *args]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} at {world} ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _env(threads: int) -> dict[str, str]:
    drop = ("MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "PL_", "SLURM_", "TORCHELASTIC_", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
        **ALLOCATOR_ENV,
    })
    return env


def run_config(spec: dict[str, Any], workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one configuration in fresh processes; a failure (error, out of memory, timeout) is recorded, not raised."""
    name = spec["name"]
    spec = {**spec, "out": str(workdir / f"{name}.json"), "root_dir": str(workdir / name)}
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
            env=_env(spec["threads"]), cwd=REPO, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's rank processes share this new session
            proc.wait()
            code = "timeout"
    wall = time.perf_counter() - t0
    out = Path(spec["out"])
    if code == 0 and out.is_file():
        result = json.loads(out.read_text())
        result["process_wall_s"] = wall
    else:
        tail = log_path.read_text()[-3000:] if log_path.is_file() else ""
        result = {"spec": spec, "ok": False, "error": f"exit {code}", "log_tail": tail, "process_wall_s": wall}
    # results are committed: keep this machine's paths out of them
    result["spec"] = {k: v for k, v in result["spec"].items() if k not in ("out", "root_dir")}
    if "log_tail" in result:
        result["log_tail"] = result["log_tail"].replace(str(workdir), "<workdir>").replace(str(REPO), "<repo>")
    return result


def make_spec(mode: Mode, model: str, peer: str, world: int, *, shape: Optional[dict[str, int]] = None,
              checkpoint: bool = False, tag: str = "", batch: Optional[int] = None) -> dict[str, Any]:
    dims = {**(shape or MODELS[model]), "vocab_size": mode.vocab_size, "seq_len": mode.seq_len}
    custom = mode.per_model.get(model, {})
    return {
        "name": f"{tag}{model}-w{world}-{peer}",
        "model_name": model,
        "peer": peer,
        "world": world,
        "device": mode.device,
        "precision": mode.precision,
        "model": dims,
        "batch": batch or mode.batch,
        "warmup": custom.get("warmup", mode.warmup),
        "steps": custom.get("steps", mode.steps),
        "seed": 0,
        "threads": mode.threads,
        "checkpoint": checkpoint,
        "checkpoint_rounds": custom.get("checkpoint_rounds", mode.checkpoint_rounds),
        "tag": tag,
    }


def plan_configs(mode: Mode, repeats: int = 1) -> list[dict[str, Any]]:
    """Configurations in run order: grouped by (model, world size); within a group each repeat runs every peer
    once, in an order rotated from one repeat and group to the next, so drifting background load on a shared
    machine falls on all peers alike."""
    specs: list[dict[str, Any]] = []
    peers = [p for p in mode.peers if p != "single"]
    turn = 0
    for model in mode.models:
        for rep in range(repeats):
            specs.append(make_spec(mode, model, "single", 1, tag=f"r{rep}-"))  # the compute-only reference
        for world in mode.worlds:
            if (model, world) in mode.skip:
                continue
            for rep in range(repeats):
                shift = turn % len(peers)
                turn += 1
                for peer in peers[shift:] + peers[:shift]:
                    checkpoint = peer in CHECKPOINT_PEERS and world == max(mode.worlds) > 1 and rep == 0
                    specs.append(make_spec(mode, model, peer, world, checkpoint=checkpoint, tag=f"r{rep}-"))
            pair = [p for p in ("mp_fsdp2", "fsdp_custom") if p in peers]
            for extra in range(1, mode.pair_repeats.get((model, world), 1)):
                for peer in pair if extra % 2 else pair[::-1]:
                    specs.append(make_spec(mode, model, peer, world, tag=f"p{extra}-"))
    return specs


def plan_budget(mode: Mode) -> dict[str, Any]:
    """The deepest model of the template width that the planner fits in the per-rank budget (minus the planner's
    headroom) at ``budget_world`` ranks, for fsdp_custom and for DDP."""
    from lightning_fsdp import planner

    assert mode.budget_bytes is not None and mode.budget_template is not None
    t = mode.budget_template
    template = planner.package_gpt(1, t["d_model"], t["n_head"], mode.vocab_size, mode.seq_len)
    usable = int(mode.budget_bytes * (1 - planner.DEFAULT_HEADROOM))
    found: dict[str, Any] = {"budget_bytes": mode.budget_bytes, "usable_bytes": usable, "world": mode.budget_world,
                             "batch": mode.budget_batch, "template": t}
    for peer, strategy in (("fsdp_custom", "fsdp"), ("ddp", "ddp")):
        options = planner.PlanOptions(world_size=mode.budget_world, strategy=strategy, batch_size=mode.budget_batch)
        dims = planner.largest_gpt(template, options, usable)
        found[peer] = None if dims is None else {
            "n_layer": dims.n_layer, "numel": planner.gpt_param_count(dims),
            "planned_peak": planner.estimate(planner.gpt_model_spec(dims), options).peak,
        }
    return found


def budget_search(mode: Mode, plan: dict[str, Any], workdir: Path, report) -> list[dict[str, Any]]:
    """Confirm the plan with real runs: start at the planned depth, then one block deeper while it fits or one
    shallower while it does not (at most three runs per peer). The largest depth that fits is the answer."""
    results: list[dict[str, Any]] = []
    t = mode.budget_template or {}
    for peer in ("fsdp_custom", "ddp"):
        if not plan.get(peer):
            continue
        n_layer, seen = plan[peer]["n_layer"], {}
        for _ in range(3):
            shape = {"n_layer": n_layer, "n_head": t["n_head"], "d_model": t["d_model"]}
            spec = make_spec(mode, f"gpt-d{t['d_model']}-L{n_layer}", peer, mode.budget_world, shape=shape, tag="budget-",
                             batch=mode.budget_batch)
            result = run_config(spec, workdir, mode.timeout_s)
            results.append(result)
            report(spec, result)
            fits = bool(result.get("ok")) and max(r["peak"] for r in result["per_rank"]) <= plan["budget_bytes"]
            seen[n_layer] = fits
            following = n_layer + 1 if fits else n_layer - 1
            if following < 1 or following in seen:  # the boundary is found
                break
            n_layer = following
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="tiny model, 1-2 ranks, 2 steps (smoke test)")
    which.add_argument("--gpu", action="store_true", help="CUDA comparison, adds Lightning's FSDP1")
    parser.add_argument("--compile", action="store_true", help="compile=True against eager and the hand-compiled "
                        "ModelParallelStrategy (with --gpu: world size 1, with and without offload, < 8 min)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--models", help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--worlds", help="comma-separated world sizes")
    parser.add_argument("--peers", help="comma-separated subset of " + ", ".join(GPU_PEERS))
    parser.add_argument("--steps", type=int, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, help="steps before measuring")
    parser.add_argument("--repeats", type=int, default=1, help="run every configuration this many times")
    parser.add_argument("--no-budget", action="store_true", help="skip the largest-model-within-budget runs")
    parser.add_argument("--peak-tflops", type=float, help="GPU peak dense TFLOP/s per device, for MFU")
    parser.add_argument("--keep-logs", action="store_true", help="keep per-configuration logs in OUT/logs")
    args = parser.parse_args(argv)

    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu needs CUDA, and torch.cuda.is_available() is False.", file=sys.stderr)
            return 2
        mode = compile_mode(gpu=True) if args.compile else gpu_mode(torch.cuda.device_count())
    elif args.compile:
        mode = compile_mode(gpu=False)
    else:
        mode = quick_mode() if args.quick else cpu_mode()
    if args.models:
        mode.models = args.models.split(",")
        unknown = [m for m in mode.models if m not in MODELS]
        if unknown:
            parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.worlds:
        mode.worlds = [int(w) for w in args.worlds.split(",")]
    if args.peers:
        mode.peers = args.peers.split(",")
    mode.steps = args.steps or mode.steps
    mode.warmup = args.warmup if args.warmup is not None else mode.warmup

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    specs = plan_configs(mode, args.repeats)
    budget = plan_budget(mode) if mode.budget_bytes and not args.no_budget else None
    logs = args.out / "logs" if args.keep_logs else None
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lightning-fsdp-bench-") as tmp:
        workdir = Path(tmp)

        def report(spec: dict[str, Any], result: dict[str, Any]) -> None:
            done.append(spec["name"])
            status = f"{result['median_step_s']:.3f} s/step" if result.get("ok") else result.get("error")
            print(f"[{len(done)}/{len(specs)}+] {spec['name']}: {status} ({result['process_wall_s']:.0f} s)", flush=True)
            if logs is not None:
                logs.mkdir(exist_ok=True)
                src = workdir / f"{spec['name']}.log"
                if src.is_file():
                    (logs / src.name).write_text(src.read_text())

        done: list[str] = []
        for spec in specs:
            results.append(run_config(spec, workdir, mode.timeout_s))
            report(spec, results[-1])
        if budget is not None:
            results += budget_search(mode, budget, workdir, report)
    from benchmarks.report import environment, write_report

    meta = {
        "mode": mode.name,
        "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_s": time.time() - started,
        "environment": environment(),
        "budget": budget,
        "peak_tflops": args.peak_tflops,
        "settings": {k: getattr(mode, k) for k in ("device", "precision", "seq_len", "batch", "warmup", "steps", "threads",
                                                   "vocab_size", "per_model", "checkpoint_rounds")},
    }
    if mode.name.endswith("compile"):
        from benchmarks.report import write_compile_report

        (args.out / f"{mode.name}.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        write_compile_report(meta, results, args.out / f"{mode.name}.md")
    else:
        (args.out / "raw.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        write_report(meta, results, args.out)
    failed = [r["spec"]["name"] for r in results if not r.get("ok")]
    print(f"results: {args.out} ({len(results) - len(failed)} ok, {len(failed)} failed, {meta['wall_s'] / 60:.1f} min)")
    return 1 if failed and (args.quick or len(failed) == len(results)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
