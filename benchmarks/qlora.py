"""Full fine-tune, LoRA and QLoRA of the same Hugging Face Llama, side by side in one run (2 ranks, CPU, gloo).

    python benchmarks/qlora.py            # a ~250 MB (fp32) Llama; writes results/qlora.md
    python benchmarks/qlora.py --quick    # a tiny Llama (the smoke test)
    python benchmarks/qlora.py --llama-70b-slice   # QLoRA of 2 of Llama-2-70B's 80 layers at their real shapes

Each peer runs in fresh processes (``torchrun``): the model is built on the meta device, PEFT LoRA wraps it (LoRA,
QLoRA), and :func:`lightning_fsdp.preparation.prepare_model` shards it and reads the pretrained directory straight
into the shards — with ``quantize_base="nf4"`` for QLoRA, quantizing each rank's rows as they arrive. Then AdamW
trains the trainable parameters for a few steps on random tokens.

Per rank: parameter bytes (local shards; NF4 counted by its stored fields), the peak RSS added while building and
loading the model (the kernel's high-water mark, reset right before), the load time, the peak RSS added while
training, and the median step time. QLoRA pays for dequantizing every quantized weight in each forward and backward:
the step-time ratio against LoRA says how much.

``--llama-70b-slice`` trains QLoRA only, on a slice of Llama-2-70B at its real geometry (hidden 8192, MLP 28672, 64
heads, 8 KV heads, vocabulary 32000; 2 of its 80 layers: 2.2B parameters, 4.5 GB of bf16 safetensors; ~17 GB of
memory and ~10 minutes on 2 cores), and sets the planner's per-rank parameter, optimizer and peak figures for that
exact configuration beside the measured ones: the shapes the README's 70B rows are planned from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

#: ~63.6M parameters (254 MB in fp32): projections split into whole NF4 blocks at 2 ranks; embedding and head are a
#: quarter of the model, as in small real models
LLAMA_250MB = dict(
    vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False,
)
LLAMA_TINY = dict(
    vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
)
#: Llama-2-70B's published config.json, 2 of its 80 decoder layers
LLAMA_70B_SLICE = dict(
    vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=2, num_attention_heads=64,
    num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
PEERS = ("full", "lora", "qlora")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmHWM")


def worker(peer: str, model_dir: Path, out: Path, steps: int, batch: int, seq: int) -> None:
    """One rank of one peer (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp.memory import local_state_bytes
    from lightning_fsdp.parallel.process_group import release_process_group
    from lightning_fsdp.preparation import Preparation, prepare_model
    from lightning_fsdp.sharding import ShardingPlan, parameters_on_meta

    start_rss = _status_bytes("VmRSS")  # after the imports: the baseline of the whole-run peak
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = AutoConfig.from_pretrained(model_dir)
    with parameters_on_meta():  # fp32 master weights, as training needs (the files are bf16, like the Hub's)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if peer != "full":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**LORA))
    plan = ShardingPlan(quantize_base="nf4" if peer == "qlora" else None)
    dist.barrier()
    before = _reset_peak()
    start = time.perf_counter()
    prepare_model(model, mesh, Preparation(plan, torch.device("cpu"), model_dir))
    dist.barrier()
    load_seconds = time.perf_counter() - start
    load_peak = _status_bytes("VmHWM") - before
    params = local_state_bytes(model).params
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())
    times = []
    before = _reset_peak()
    for _ in range(steps):
        x = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    train_peak = _status_bytes("VmHWM") - before
    peak_total = _status_bytes("VmHWM") - start_rss  # state and all: what the planner's per-rank peak counts
    state = local_state_bytes(model, [optimizer])
    row = {"params": params, "grads": state.grads, "optimizer": state.optimizer, "load_peak": load_peak,
           "load_seconds": load_seconds, "train_peak": train_peak, "peak_total": peak_total, "step_seconds": statistics.median(times[1:])}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    del model, optimizer
    release_process_group()


def prepare(model_dir: Path, config: dict) -> dict:
    """The pretrained directory (bf16, several shards, as from the Hub), built in bf16 (half the memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(model_dir, max_shard_size="50MB" if config["hidden_size"] < 4096 else "2GB")
    return {"params": sum(p.numel() for p in model.parameters()),
            "file_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))}


def report(meta: dict, results: dict, world: int, batch: int, seq: int) -> str:
    mib = 2**20
    lora = results["lora"]
    lines = [
        f"Model: Llama-style, {meta['params'] / 1e6:.1f}M parameters ({meta['params'] * 4 / mib:.0f} MiB in fp32),"
        f" {meta['file_bytes'] / mib:.0f} MiB of bf16 safetensors. {world} ranks, CPU, gloo, one thread per rank;"
        f" batch {batch} × {seq} tokens per rank; LoRA r={LORA['r']} on {', '.join(LORA['target_modules'])}."
        " Peaks: RSS high-water mark added, per rank (the largest rank shown).",
        "",
        "| peer | params per rank MiB | × LoRA | + grads + optimizer MiB | load peak MiB | load s | train peak MiB |"
        " step s | step × LoRA |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for peer in PEERS:
        rows = results[peer]

        def top(key: str, rows: list = rows) -> float:
            return max(r[key] for r in rows)

        lines.append(
            f"| {peer} | {top('params') / mib:.1f} | {top('params') / max(r['params'] for r in lora):.2f}× |"
            f" {(top('grads') + top('optimizer')) / mib:.1f} | {top('load_peak') / mib:.0f} | {top('load_seconds'):.2f}"
            f" | {top('train_peak') / mib:.0f} | {top('step_seconds'):.3f} |"
            f" {top('step_seconds') / max(r['step_seconds'] for r in lora):.2f}× |"
        )
    return "\n".join(lines) + "\n"


def planned(config: dict, world: int, batch: int, seq: int) -> dict:
    """``lightning-fsdp estimate``'s per-rank figures for the benchmark's QLoRA configuration."""
    from lightning_fsdp.planner import PlanOptions, estimate
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec, with_lora

    spec = llama_model_spec(with_lora(llama_dims(config, seq), LORA["r"], LORA["target_modules"]))
    plan = estimate(spec, PlanOptions(world_size=world, batch_size=batch, seq_len=seq, quantize_base="nf4",
                                      loss_chunk=None))  # the worker calls model(..., labels=x).loss: whole logits
    return {"params": plan.params, "optimizer": plan.optimizer, "peak": plan.peak}


def slice_report(meta: dict, rows: list, plan: dict, world: int, batch: int, seq: int) -> str:
    mib = 2**20
    measured = {"params": max(r["params"] for r in rows), "optimizer": max(r["optimizer"] for r in rows),
                "peak": max(r["peak_total"] for r in rows)}
    lines = [
        f"Llama-2-70B slice: its real layer geometry, 2 of 80 layers, {meta['params'] / 1e9:.2f}B parameters,"
        f" {meta['file_bytes'] / 2**30:.2f} GiB of bf16 safetensors. QLoRA (NF4 base quantized as it loads, fp32"
        f" LoRA r={LORA['r']} on {', '.join(LORA['target_modules'])}, AdamW), {world} ranks, CPU, gloo; batch"
        f" {batch} × {seq} tokens per rank. Load {max(r['load_seconds'] for r in rows):.0f} s, step"
        f" {max(r['step_seconds'] for r in rows):.1f} s. Peak: RSS high-water mark above the RSS after the imports,"
        " largest rank.",
        "",
        "| per rank | measured MiB | planner MiB | planner / measured |",
        "|---|---:|---:|---:|",
    ]
    for key in ("params", "optimizer", "peak"):
        lines.append(f"| {key} | {measured[key] / mib:.1f} | {plan[key] / mib:.1f} | {plan[key] / measured[key]:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Llama (the smoke test)")
    parser.add_argument("--llama-70b-slice", action="store_true", help="QLoRA of 2 layers of Llama-2-70B")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        peer, model_dir, out, steps, batch, seq = args.worker
        worker(peer, Path(model_dir), Path(out), int(steps), int(batch), int(seq))
        return
    import tempfile

    world, steps, batch, seq = (2, 3, 2, 32) if args.quick else (2, 4, 2, 128)
    config = LLAMA_TINY if args.quick else LLAMA_250MB
    peers = PEERS
    if args.llama_70b_slice:
        steps, batch, seq, config, peers = 3, 1, 64, LLAMA_70B_SLICE, ("qlora",)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "llama"
        meta = prepare(model_dir, config)
        env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        results = {}
        for peer in peers:
            out = tmp / f"{peer}.json"
            worker_args = [peer, str(model_dir), str(out), str(steps), str(batch), str(seq)]
            results[peer] = torchrun_json(__file__, world, worker_args, out, env, peer)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.llama_70b_slice:
        plan = planned(config, world, batch, seq)
        text = slice_report(meta, results["qlora"], plan, world, batch, seq)
        name, payload = "qlora_70b_slice", {"meta": meta, "config": config, "results": results, "planner": plan}
    else:
        text = report(meta, results, world, batch, seq)
        name, payload = ("qlora_quick" if args.quick else "qlora"), {"meta": meta, "results": results}
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    print(text)


if __name__ == "__main__":
    main()
