"""lm-eval requests per second on the shards at 2 ranks against lm-eval's own Hugging Face backend in one process.

    python benchmarks/eval_peer.py [--rounds 2] [--limit 60]

Both score the same tasks on SmolLM2-135M-Instruct (the main job's model): ``python_docstring_choice`` (log-likelihood
requests, four per question) and ``python_docs`` (greedy generation, up to 48 tokens). Ours: ``evaluate_tasks`` in
2 Fabric ranks of 1 thread each, the model sharded; the peer: ``lm_eval.simple_evaluate(model=HFLM(...))`` in one
process with 2 threads, the whole model. The same total threads; each side timed around its evaluation call only
(model loading excluded), the best of ``--rounds``. Results: ``results/eval_peer.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TASKS = ["python_docstring_choice", "python_docs"]

_OURS = r"""
import json, sys, time
import lightning as L
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from lightning_fsdp.evaluation.harness import evaluate_tasks
from lightning_fsdp.fabric import FSDPCustomFabricStrategy
model_dir, limit, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FSDPCustomFabricStrategy(pretrained_weights=model_dir))
fabric.launch()
with fabric.init_module(empty_init=True):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
model = fabric.setup_module(model).module
tokenizer = AutoTokenizer.from_pretrained(model_dir)
started = time.perf_counter()
results = evaluate_tasks(model, model, tokenizer, %r, limit=limit, batch_size=8)
seconds = time.perf_counter() - started
if fabric.global_rank == 0:
    json.dump({"seconds": seconds, "requests": results["n-samples"], "results": results["results"]}, open(out, "w"))
"""

_PEER = r"""
import json, sys, time
import torch
torch.set_num_threads(2)
import lm_eval
from lm_eval.models.huggingface import HFLM
from lightning_fsdp.evaluation.harness import task_manager
model_dir, limit, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lm = HFLM(pretrained=model_dir, device="cpu", batch_size=8)
started = time.perf_counter()
results = lm_eval.simple_evaluate(model=lm, tasks=%r, limit=limit, task_manager=task_manager(tasks=%r),
                                  bootstrap_iters=0)
seconds = time.perf_counter() - started
json.dump({"seconds": seconds, "requests": results["n-samples"], "results": results["results"]}, open(out, "w"))
"""


def _run(code: str, model_dir: Path, limit: int, threads: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="eval-peer-"))
    out, script = work / "out.json", work / "run.py"  # a file: Fabric's launcher starts the other rank by re-running it
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(limit), str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated (default: both)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    from lightning_fsdp.hf.gguf import resolve_model_source
    from lightning_fsdp.hf.packaged import packaged_model_path

    model_dir = Path(resolve_model_source(packaged_model_path("SmolLM2-135M-Instruct")))
    tasks = args.tasks.split(",")
    rows: dict[str, list[dict[str, Any]]] = {"ours": [], "hf": []}
    for _ in range(args.rounds):
        rows["ours"].append(_run(_OURS % (tasks,), model_dir, args.limit, threads=1))
        rows["hf"].append(_run(_PEER % (tasks, tasks), model_dir, args.limit, threads=2))
    requests = args.limit * (4 * ("python_docstring_choice" in tasks) + ("python_docs" in tasks))
    best = {name: min(r["seconds"] for r in runs) for name, runs in rows.items()}
    scores = {name: {task: {k: v for k, v in values.items() if "," in k and "stderr" not in k}
                     for task, values in runs[0]["results"].items()} for name, runs in rows.items()}
    summary = {"model": "SmolLM2-135M-Instruct", "tasks": tasks, "limit": args.limit, "requests": requests,
               "seconds": best, "requests_per_second": {k: requests / v for k, v in best.items()},
               "ratio_ours_over_hf": best["hf"] / best["ours"], "scores": scores, "rounds": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval_peer.json").write_text(json.dumps(summary, indent=2))
    lines = ["| backend | ranks × threads | seconds | requests/s | ratio |", "|---|---|---:|---:|---:|",
             f"| ours (`evaluate_tasks`, sharded) | 2 × 1 | {best['ours']:.1f} | {requests / best['ours']:.1f} |"
             f" {summary['ratio_ours_over_hf']:.2f}× |",
             f"| lm-eval `--model hf` | 1 × 2 | {best['hf']:.1f} | {requests / best['hf']:.1f} | 1.00× |"]
    same = scores["ours"] == scores["hf"]
    lines.append(f"\n{requests} requests over {', '.join(tasks)} ({args.limit} examples each; four log-likelihoods per"
                 f" multiple-choice question); the same scores: {same}.")
    (args.out / "eval_peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
