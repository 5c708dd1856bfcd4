"""``lightning-fsdp estimate --grpo-generations`` against a measured GRPO run at 2 ranks.

    python benchmarks/grpo_plan.py [--steps 4]

Runs ``experiment=grpo`` (SmolLM2-135M-Instruct, LoRA r=16 on q/k/v/o, 2 prompts × 4 completions ≤ 32 tokens per
rank) with ``MALLOC_MMAP_THRESHOLD_=65536`` (so RSS follows live tensors, as in ``benchmarks/run.py``), reads each
rank's peak RSS above set-up from the job's memory report, and plans the same step: the longest prompt of the data
and ``max_completion_length`` (the widest batch a step can hold). Results: ``results/grpo_plan.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS, GENERATIONS, COMPLETION, LORA_RANK = 2, 4, 32, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from lightning_fsdp.data.expressions import write_expression_prompts
    from lightning_fsdp.hf.gguf import resolve_model_source
    from lightning_fsdp.hf.packaged import packaged_model_path

    work = Path(tempfile.mkdtemp(prefix="grpo-plan-"))
    model_dir = Path(resolve_model_source(packaged_model_path("SmolLM2-135M-Instruct")))
    data = Path(write_expression_prompts(work / "prompts"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    longest = max(len(tokenizer.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"])
                  for line in (data / "train.jsonl").read_text().splitlines())
    command = [sys.executable, "-m", "lightning_fsdp", "train", "experiment=grpo", f"model.model_dir={model_dir}",
               f"data.path={data / 'train.jsonl'}", "data.val_path=null", "data.val_fraction=0.0",
               f"data.batch_size={PROMPTS}", f"model.num_generations={GENERATIONS}",
               f"model.max_completion_length={COMPLETION}", f"model.lora.r={LORA_RANK}",
               f"trainer.max_steps={args.steps}", "callbacks.held_out_rewards=null", "callbacks.reward_curve=null",
               "export.formats=[]", f"paths.output_dir={work / 'run'}", f"paths.log_dir={work}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    subprocess.run(command, cwd=work, env=env, check=True, capture_output=True, text=True)
    summary = json.loads((work / "run" / "summary.json").read_text())
    measured = max(rank["peak"] for rank in summary["memory"]["ranks"])
    plan = subprocess.run(
        [sys.executable, "-m", "lightning_fsdp.planner.cli", "--hf-config", str(model_dir), "--lora-rank",
         str(LORA_RANK), "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "-n", "2", "--batch-size", str(PROMPTS),
         "--grpo-generations", str(GENERATIONS), "--completion-length", str(COMPLETION), "--prompt-length",
         str(longest), "--json"], capture_output=True, text=True, check=True, env=env)
    planned = json.loads(plan.stdout)
    result = {"measured_peak": measured, "planned_peak": planned["peak"], "ratio": measured / planned["peak"],
              "rollout_peak": planned["rollout"]["peak"], "training_peak": planned["training"]["device"],
              "longest_prompt": longest, "ranks": summary["memory"]["ranks"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grpo_plan.json").write_text(json.dumps(result, indent=1))
    mib = 2 ** 20
    table = (f"# A GRPO step planned and measured (2 CPU ranks)\n\nSmolLM2-135M-Instruct, LoRA r={LORA_RANK} on q/k/v/o,"
             f" {PROMPTS} prompts × {GENERATIONS} completions ≤ {COMPLETION} tokens per rank, prompts ≤ {longest}"
             f" tokens, fp32, `MALLOC_MMAP_THRESHOLD_=65536`, {args.steps} steps.\n\n"
             "| | MiB |\n|---|---:|\n"
             f"| planned rollout peak | {planned['rollout']['peak'] / mib:.0f} |\n"
             f"| planned training peak | {planned['training']['device'] / mib:.0f} |\n"
             f"| **planned step peak** | **{planned['peak'] / mib:.0f}** |\n"
             f"| **measured peak RSS above set-up (largest rank)** | **{measured / mib:.0f}** |\n"
             f"| measured / planned | {result['ratio']:.3f} |\n")
    (args.out / "grpo_plan.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
