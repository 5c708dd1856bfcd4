"""The chunked causal-LM loss against the whole logits, side by side in one run: step time and peak memory per rank
at three context lengths, the longest context that fits a memory budget, and the planner's figures for each.

    python benchmarks/long_context.py            # ~10 min on 2 CPU cores; writes results/long_context.{json,md}
    python benchmarks/long_context.py --quick    # small sizes: checks the harness

The model is a tiny-but-wide Hugging Face Llama (vocabulary 65,536, hidden 128, 2 layers), so the logits dominate
memory as they do for Llama-3 or Qwen2.5 at long contexts: at 4096 tokens a rank's fp32 logits are 1 GiB. Its MLP
is wide (2048) so that each token keeps the activations of a deeper model while attention stays cheap on CPU. Each
configuration is a real ``Trainer(strategy="fsdp_custom")`` fit of :class:`lightning_fsdp.models.HFCausalLM` in
fresh processes (``torchrun``, 2 ranks, gloo, one thread per rank), ``loss_chunk=None`` (``self.model(input_ids=x)
.logits`` and ``F.cross_entropy``) or the chunked loss. Per rank: the median step time after the first step, and
the peak RSS above the RSS right after the imports (glibc's mmap threshold fixed at 64 KiB, so freed tensors leave
the RSS, as in ``benchmarks/run.py``), against ``lightning-fsdp estimate``'s per-rank peak for the same
configuration.

The chunk sweep times ``loss_chunk`` of ¼, ½, 1 and 2 × the default at the longest context: the default is chosen
from it. The budget search: for each loss, the longest context (a multiple of 256 tokens) whose measured peak stays within
``--budget`` per rank, found by bisection over real runs, against the planner's ``--max-seq`` answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

WIDE_LLAMA = dict(
    model_type="llama", vocab_size=65536, hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=False,
)
QUICK_LLAMA = {**WIDE_LLAMA, "vocab_size": 4096, "max_position_embeddings": 1024}
WORLD = 2
MIB = 2**20
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
#: tokens to a step of the budget search: the contexts it tries are multiples of this
SEARCH_STEP = 256


def worker(model_dir: Path, out: Path, chunk: Optional[int], context: int, steps: int) -> None:
    """One rank of one configuration (started by torchrun): a Trainer fit of ``steps`` steps of 1 × ``context``."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    import lightning_fsdp  # noqa: F401 - registers the strategy
    from lightning_fsdp.memory import current_rss, local_state_bytes, peak_rss, reset_peak_rss
    from lightning_fsdp.models import HFCausalLM

    reset_peak_rss()  # the high-water mark from here: everything after the imports
    baseline = current_rss()

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.start)

    rank = int(__import__("os").environ["RANK"])
    config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, config["vocab_size"], (1, context), generator=generator)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    measure = Measure()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="fsdp_custom", precision="32-true", max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[measure], num_sanity_val_steps=0,
    )
    model = HFCausalLM(model_dir, loss_chunk=chunk)
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    state = local_state_bytes(trainer.strategy.model, trainer.optimizers)
    row = {
        "peak": peak_rss() - baseline, "state": state.total, "params": state.params,
        "step_seconds": statistics.median(measure.times[1:] or measure.times),
    }
    rows: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(rows, row)
    if trainer.is_global_zero:
        out.write_text(json.dumps(rows))


def planned_peak(config: dict[str, Any], chunk: Optional[int], context: int) -> int:
    """``lightning-fsdp estimate``'s per-rank peak for one configuration of this benchmark."""
    from lightning_fsdp.planner import PlanOptions, estimate
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec

    spec = llama_model_spec(llama_dims(config, seq_len=context))
    options = PlanOptions(world_size=WORLD, batch_size=1, seq_len=context, loss_chunk=chunk)
    return estimate(spec, options).peak


def planned_longest(config: dict[str, Any], chunk: Optional[int], budget: int) -> int:
    """The planner's ``--max-seq`` for one loss: the longest context whose per-rank plan fits ``budget``."""
    from lightning_fsdp.planner import PlanOptions
    from lightning_fsdp.planner.cli import longest_sequence
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec

    spec = llama_model_spec(llama_dims(config, seq_len=1))
    return longest_sequence(spec, PlanOptions(world_size=WORLD, batch_size=1, loss_chunk=chunk), budget, 0.0)


class Runner:
    """Runs configurations in fresh processes and keeps every measurement (the search re-uses the table's)."""

    def __init__(self, model_dir: Path, tmp: Path, steps: int) -> None:
        self.model_dir, self.tmp, self.steps = model_dir, tmp, steps
        self.rows: dict[tuple[Optional[int], int], list[dict[str, Any]]] = {}

    def __call__(self, chunk: Optional[int], context: int, steps: Optional[int] = None) -> list[dict[str, Any]]:
        """The per-rank rows of one configuration (``steps``: of a new run; 2 suffice for a peak: the second
        step's backward runs with the optimizer state allocated)."""
        key = (chunk, context)
        if key not in self.rows:
            out = self.tmp / f"{chunk}-{context}.json"
            args = [str(self.model_dir), str(out), str(chunk or 0), str(context), str(steps or self.steps)]
            self.rows[key] = torchrun_json(__file__, WORLD, args, out, ENV, f"loss_chunk={chunk} at {context} tokens")
            peak = max(r["peak"] for r in self.rows[key])
            print(f"  loss_chunk={chunk} context={context}: peak {peak / MIB:.0f} MiB per rank", flush=True)
        return self.rows[key]

    def peak(self, chunk: Optional[int], context: int) -> int:
        return max(r["peak"] for r in self(chunk, context, steps=2))


def longest_within(run: Runner, chunk: Optional[int], budget: int, low: int, high: int) -> int:
    """Bisection over real runs: the longest multiple of ``SEARCH_STEP`` in ``[low, high]`` whose peak fits
    ``budget`` (``low`` is assumed to fit; ``high`` is where the search stops)."""
    low, high = low // SEARCH_STEP, high // SEARCH_STEP
    while run.peak(chunk, high * SEARCH_STEP) > budget and high - low > 1:
        mid = (low + high) // 2
        if run.peak(chunk, mid * SEARCH_STEP) <= budget:
            low = mid
        else:
            high = mid
    return (high if run.peak(chunk, high * SEARCH_STEP) <= budget else low) * SEARCH_STEP


def report(config: dict[str, Any], chunk: int, table: list[dict[str, Any]], sweep: list[dict[str, Any]],
           search: list[dict[str, Any]], budget: int, steps: int) -> str:
    lines = [
        f"Model: Hugging Face Llama, vocabulary {config['vocab_size']:,}, hidden {config['hidden_size']},"
        f" {config['num_hidden_layers']} layers, untied head; full fine-tune, fp32, AdamW. {WORLD} ranks"
        f" (`fsdp_custom`), CPU, gloo, one thread per rank; batch 1 × context per rank; {steps} steps, median of"
        " the steps after the first. Peak: RSS high-water mark above the RSS after the imports, largest rank.",
        "",
        f"| context | logits MiB | whole: step s | chunked ({chunk}): step s | step × | whole: peak MiB |"
        " chunked: peak MiB | saved / logits | planner whole | planner chunked |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table:
        lines.append(
            f"| {row['context']} | {row['logits_bytes'] / MIB:.0f} | {row['whole_step']:.3f} |"
            f" {row['chunked_step']:.3f} | {row['step_ratio']:.2f}× | {row['whole_peak'] / MIB:.0f} |"
            f" {row['chunked_peak'] / MIB:.0f} | {row['saved_over_logits']:.2f} |"
            f" {row['whole_planned'] / row['whole_peak']:.2f}× | {row['chunked_planned'] / row['chunked_peak']:.2f}× |"
        )
    lines += [
        "",
        "Planner columns: the planner's per-rank peak over the measured one.",
        "",
        f"The chunk size at {sweep[0]['context']} tokens per rank (step time against the whole logits' step):",
        "",
        "| loss_chunk | step s | step × whole | peak MiB | planner / measured |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in sweep:
        lines.append(f"| {row['chunk']} | {row['step']:.3f} | {row['step_ratio']:.2f}× | {row['peak'] / MIB:.0f} |"
                     f" {row['planned'] / row['peak']:.2f}× |")
    lines += [
        "",
        f"Longest context within {budget / MIB:.0f} MiB per rank (bisection over real runs, steps of"
        f" {SEARCH_STEP} tokens, against `lightning-fsdp estimate --max-seq`):",
        "",
        "| loss | measured | planner | planner / measured |",
        "|---|---:|---:|---:|",
    ]
    for row in search:
        lines.append(f"| {row['loss']} | {row['measured']} | {row['planned']} | {row['planned'] / row['measured']:.2f}× |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small vocabulary and short contexts (the smoke test)")
    parser.add_argument("--contexts", default=None, help="comma-separated tokens per rank (default 1024,2048,4096)")
    parser.add_argument("--chunk", type=int, default=None, help="loss_chunk of the chunked peer (default: HFCausalLM's)")
    parser.add_argument("--budget-mib", type=int, default=None, help="per-rank peak of the search (default 1280)")
    parser.add_argument("--no-search", action="store_true", help="skip the longest-context search")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_dir, out, chunk, context, steps = args.worker
        worker(Path(model_dir), Path(out), int(chunk) or None, int(context), int(steps))
        return
    import tempfile

    from lightning_fsdp.loss import DEFAULT_CHUNK_TOKENS
    from lightning_fsdp.models.hf_causal_lm import write_random_model

    config = QUICK_LLAMA if args.quick else WIDE_LLAMA
    chunk = args.chunk or (128 if args.quick else DEFAULT_CHUNK_TOKENS)
    contexts = [int(c) for c in (args.contexts or ("256,512" if args.quick else "1024,2048,4096")).split(",")]
    budget = (args.budget_mib or (256 if args.quick else 1280)) * MIB
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_random_model(tmp / "wide-llama", config, max_shard_size="200MB")
        run = Runner(model_dir, tmp, steps)
        table = []
        for context in contexts:
            whole, chunked = run(None, context), run(chunk, context)
            logits = context * config["vocab_size"] * 4
            whole_peak, chunked_peak = max(r["peak"] for r in whole), max(r["peak"] for r in chunked)
            whole_step = max(r["step_seconds"] for r in whole)
            chunked_step = max(r["step_seconds"] for r in chunked)
            table.append({
                "context": context, "logits_bytes": logits, "whole_step": whole_step, "chunked_step": chunked_step,
                "step_ratio": chunked_step / whole_step, "whole_peak": whole_peak, "chunked_peak": chunked_peak,
                "saved_over_logits": (whole_peak - chunked_peak) / logits,
                "whole_planned": planned_peak(config, None, context),
                "chunked_planned": planned_peak(config, chunk, context),
                "state": max(r["state"] for r in chunked),
            })
        # the default chunk, chosen by measurement: step time and peak at the longest context, chunk by chunk
        longest = contexts[-1]
        whole_step = next(r["whole_step"] for r in table if r["context"] == longest)
        sweep = []
        for c in sorted({chunk // 4, chunk // 2, chunk, chunk * 2}):
            rows = run(c, longest)
            step = max(r["step_seconds"] for r in rows)
            sweep.append({"chunk": c, "context": longest, "step": step, "step_ratio": step / whole_step,
                          "peak": max(r["peak"] for r in rows), "planned": planned_peak(config, c, longest)})
        search = []
        if not args.no_search:
            for loss, c in (("whole logits", None), (f"chunked ({chunk})", chunk)):
                planned = planned_longest(config, c, budget)
                # from the longest measured context that fits to 1.5× the planner's answer (where a user starts)
                low = max([t for t in contexts if run.peak(c, t) <= budget], default=SEARCH_STEP)
                high = min(16384, max(low + SEARCH_STEP, -(-3 * planned // (2 * SEARCH_STEP)) * SEARCH_STEP))
                measured = longest_within(run, c, budget, low, high)
                search.append({"loss": loss, "chunk": c, "measured": measured, "planned": planned})
    text = report(config, chunk, table, sweep, search, budget, steps)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "long_context_quick" if args.quick else "long_context"
    (out_dir / f"{name}.md").write_text(text)
    payload = {"config": config, "chunk": chunk, "budget": budget, "table": table, "sweep": sweep, "search": search,
               "runs": {f"{c}-{t}": rows for (c, t), rows in run.rows.items()}}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    print(text)


if __name__ == "__main__":
    main()
