"""Context parallelism against whole sequences per rank, side by side in one run: peak memory per rank, tokens/s,
and the longest sequence that fits a per-rank budget, each found by running.

    python benchmarks/context_parallel.py            # writes results/context_parallel_<layers>_layers.{json,md}
    python benchmarks/context_parallel.py --quick    # short sequences: checks the harness
    python benchmarks/context_parallel.py --layers 30 --seqs 16384 --no-search --steps 1   # ..._30_layers_16384.*

The model has SmolLM2-135M's shapes (vocabulary 49,152, hidden 576, MLP 1,536, 9 query and 3 key/value heads, tied
head) with ``--layers`` of its 30 decoder layers (2 by default: a CPU step of a 30-layer model at 8k tokens takes
many minutes, and every per-token figure scales with the depth alike), LoRA r=8 on q/v, activation checkpointing of
every decoder layer, the chunked loss, fp32. Each configuration is a real ``Trainer(strategy="fsdp_custom")`` fit of
:class:`lightning_fsdp.models.HFCausalLM` in fresh processes (``torchrun``, 2 ranks, gloo, one thread per rank):

- ``cp=1``: each rank trains its own row of ``S`` tokens (two rows a step);
- ``cp=2``: both ranks split one row of ``S`` tokens (one row a step), ring attention.

Per rank: the peak RSS above the set-up (the RSS when training starts: model sharded, optimizer built; glibc's mmap
threshold fixed at 64 KiB, as in ``benchmarks/run.py``), the set-up itself above the imports, and the median step
time after the first; tokens/s counts every token of the step. The
budget search: for each, the longest sequence (a multiple of 1,024 tokens) whose measured peak fits ``--budget-mib``,
by bisection over real one-row runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

SMOLLM2_SHAPES = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=65536, tie_word_embeddings=True,
    rope_theta=100000.0,
)
WORLD = 2
MIB = 2**20
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
SEARCH_STEP = 1024
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def worker(model_dir: Path, out: Path, context_parallel: int, seq: int, steps: int, loss_chunk: int) -> None:
    """One rank of one configuration (started by torchrun)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    import lightning_fsdp
    from lightning_fsdp.memory import current_rss, peak_rss, reset_peak_rss
    from lightning_fsdp.models import HFCausalLM

    reset_peak_rss()
    imported = current_rss()

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0
            self.set_up = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.set_up = current_rss()  # the model sharded, the optimizer built: what training adds is above this
            reset_peak_rss()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.start)

    rank = int(os.environ["RANK"])
    reader = rank // context_parallel  # a context-parallel pair reads one row
    generator = torch.Generator().manual_seed(reader)
    rows = [torch.randint(0, 32000, (1, seq), generator=generator) for _ in range(steps)]
    batches = [{"input_ids": ids, "labels": ids.clone()} for ids in rows]
    measure = Measure()
    strategy = lightning_fsdp.FSDPCustomStrategy(context_parallel=context_parallel,
                                                 activation_checkpointing_policy={"LlamaDecoderLayer"})
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[measure], num_sanity_val_steps=0,
    )
    model = HFCausalLM(model_dir, lora=LORA, loss_chunk=loss_chunk)
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    row = {"peak": peak_rss() - measure.set_up, "set_up": measure.set_up - imported,
           "step_seconds": statistics.median(measure.times[1:] or measure.times)}
    gathered: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, row)
    if trainer.is_global_zero:
        out.write_text(json.dumps(gathered))


class Runner:
    """Writes the model once into ``tmp`` and runs configurations of it in fresh processes, keeping every result."""

    def __init__(self, config: dict[str, Any], tmp: Path, steps: int, loss_chunk: int) -> None:
        from lightning_fsdp.models.hf_causal_lm import write_random_model

        self.model_dir = write_random_model(tmp / "smollm2-shapes", config, max_shard_size="200MB")
        self.tmp, self.steps, self.loss_chunk = tmp, steps, loss_chunk
        self.rows: dict[tuple[int, int, int], list[dict[str, Any]]] = {}

    def __call__(self, cp: int, seq: int, steps: int = 0) -> list[dict[str, Any]]:
        steps = steps or self.steps
        key = (cp, seq, steps)
        if key not in self.rows:
            out = self.tmp / f"cp{cp}-{seq}-{steps}.json"
            args = [str(self.model_dir), str(out), str(cp), str(seq), str(steps), str(self.loss_chunk)]
            self.rows[key] = torchrun_json(__file__, WORLD, args, out, ENV, f"cp={cp} at {seq} tokens")
            peak = max(r["peak"] for r in self.rows[key])
            step = max(r["step_seconds"] for r in self.rows[key])
            print(f"  cp={cp} seq={seq} steps={steps}: peak {peak / MIB:.0f} MiB per rank, step {step:.1f} s", flush=True)
        return self.rows[key]

    def peak(self, cp: int, seq: int) -> int:
        return max(r["peak"] for r in self(cp, seq, steps=1))


def longest_within(run: Runner, cp: int, budget: int, start: int) -> int:
    """The longest multiple of :data:`SEARCH_STEP` whose one-step peak fits ``budget``: doubling from ``start``,
    then bisection."""
    low, high = 0, max(1, start // SEARCH_STEP)
    while run.peak(cp, high * SEARCH_STEP) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if run.peak(cp, mid * SEARCH_STEP) <= budget else (low, mid)
    return low * SEARCH_STEP


def report(config: dict[str, Any], table: list[dict[str, Any]], search: list[dict[str, Any]], budget: int,
           steps: int, loss_chunk: int) -> str:
    lines = [
        f"Model: SmolLM2-135M's shapes with {config['num_hidden_layers']} of its 30 layers, LoRA r={LORA['r']} on"
        f" q/v, activation checkpointing, chunked loss ({loss_chunk} tokens a chunk), fp32. {WORLD} ranks"
        f" (`fsdp_custom`), CPU, gloo, one thread per rank; {steps} steps, median after the first. Peak: RSS"
        " high-water mark above the set-up (the RSS when training starts), largest rank. cp=1: a row of S tokens"
        " per rank; cp=2: one row of S tokens split over both ranks.",
        "",
        "| S | cp=1 peak MiB | cp=2 peak MiB | peak cp=2 / cp=1 | cp=1 tokens/s | cp=2 tokens/s | tokens/s cp=2 / cp=1 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table:
        lines.append(
            f"| {row['seq']} | {row['peak'][1] / MIB:.0f} | {row['peak'][2] / MIB:.0f} |"
            f" {row['peak'][2] / row['peak'][1]:.2f} | {row['tokens_per_s'][1]:.0f} | {row['tokens_per_s'][2]:.0f} |"
            f" {row['tokens_per_s'][2] / row['tokens_per_s'][1]:.2f} |"
        )
    if search:
        lines += [
            "",
            f"Longest sequence within {budget / MIB:.0f} MiB per rank (one-step runs, multiples of {SEARCH_STEP}):",
            "",
            "| cp | longest S | × cp=1 |",
            "|---:|---:|---:|",
        ]
        first = search[0]["longest"]
        for row in search:
            ratio = f"{row['longest'] / first:.2f}" if first else "—"
            lines.append(f"| {row['cp']} | {row['longest']} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences (the smoke test)")
    parser.add_argument("--seqs", default=None, help="comma-separated tokens per row (default 4096,8192)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget-mib", type=int, default=None, help="per-rank peak of the search (default 1024)")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--loss-chunk", type=int, default=None,
                        help="tokens per chunk of the loss, on both sides (default: the model's, 512)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_dir, out, cp, seq, steps, loss_chunk = args.worker
        worker(Path(model_dir), Path(out), int(cp), int(seq), int(steps), int(loss_chunk))
        return
    import tempfile

    from lightning_fsdp.models.hf_causal_lm import DEFAULT_CHUNK_TOKENS

    config = {**SMOLLM2_SHAPES, "num_hidden_layers": args.layers}
    loss_chunk = args.loss_chunk or DEFAULT_CHUNK_TOKENS
    seqs = [int(s) for s in (args.seqs or ("512,1024" if args.quick else "4096,8192")).split(",")]
    budget, steps = (args.budget_mib or (128 if args.quick else 512)) * MIB, 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp_name:
        run, table = Runner(config, Path(tmp_name), steps, loss_chunk), []
        for seq in seqs:
            peaks, rates = {}, {}
            for cp in (1, 2):
                rows = run(cp, seq)
                peaks[cp] = max(r["peak"] for r in rows)
                rows_per_step = WORLD // cp
                rates[cp] = rows_per_step * seq / max(r["step_seconds"] for r in rows)
            table.append({"seq": seq, "peak": peaks, "tokens_per_s": rates})
        search = [] if args.no_search else [{"cp": cp, "longest": longest_within(run, cp, budget, seqs[0])}
                                            for cp in (1, 2)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (f"context_parallel_{args.layers}_layers" + (f"_{'_'.join(map(str, seqs))}" if args.seqs else "")
            + (f"_loss_chunk_{args.loss_chunk}" if args.loss_chunk else ""))
    (out / f"{name}.json").write_text(json.dumps({"config": config, "table": table, "search": search,
                                                  "budget": budget, "steps": steps, "loss_chunk": loss_chunk},
                                                 indent=1))
    text = report(config, table, search, budget, steps, loss_chunk)
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
