"""Activation offloading side by side in one run: none, :class:`ActivationOffload` (a side stream overlapped with
compute) and torch's ``save_on_cpu(pin_memory=True)`` (synchronous copies), with and without activation
checkpointing: the device's peak memory of a training step and its time, as ratios to no offloading.

    python benchmarks/activation_offload.py            # on CUDA: writes results/activation_offload.{json,md}
    python benchmarks/activation_offload.py --quick    # tiny shapes; on CPU through the same pack/unpack path

The model is a Hugging Face ``LlamaForCausalLM`` with SmolLM2-135M's shapes (``--layers`` of its 30 decoder layers),
built from its config on the device in bf16 (fp32 on CPU), trained in full: one row of ``--seq`` tokens, forward
and backward with the model's own loss, no optimizer (the state does not change with offloading). Each
configuration runs ``--steps`` steps after one warm-up in this one process; the step time is the median, the peak is
``torch.cuda.max_memory_allocated`` above what was allocated before the step. Every configuration's loss and
gradients are compared with no offloading's (the copies are exact, so only kernel non-determinism may differ).

On a machine without CUDA nothing is cheaper than where a tensor already is, so :class:`ActivationOffload` runs
with ``copy_on_cpu`` (the same pack and unpack path, with plain copies) and no peak is reported: that checks the
harness, not the method.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_fsdp.sharding.activation_offload import ActivationOffload  # noqa: E402 - after the path

SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=65536, tie_word_embeddings=True, rope_theta=100000.0,
)
QUICK_SHAPES = dict(SMOLLM2_SHAPES, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)
MIB = 2**20
MODES = ("none", "ActivationOffload", "save_on_cpu")


def offloading(mode: str, device: torch.device) -> tuple[Callable[[], Any], Optional[ActivationOffload]]:
    """A fresh context per step for ``mode``, and the :class:`ActivationOffload` kept across steps (one side
    stream; it counts what it moved)."""
    if mode == "ActivationOffload":
        offload = ActivationOffload(copy_on_cpu=device.type == "cpu", min_bytes=0 if device.type == "cpu" else 1 << 20)
        return (lambda: offload), offload
    if mode == "save_on_cpu":
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")), None
    return contextlib.nullcontext, None


def measure(config: dict[str, Any], mode: str, checkpointing: bool, seq: int, steps: int,
            device: torch.device) -> dict[str, Any]:
    """One configuration: the median step time, the peak above the step's start, the last step's loss and grads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(device=device, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, config["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    context, offload = offloading(mode, device)
    times, peaks = [], []
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start_bytes = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        with context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:  # the first step warms up the kernels and the allocator
            times.append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device) - start_bytes)
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    moved = offload.offloaded_bytes / (steps + 1) / MIB if offload is not None else None
    return {"mode": mode, "checkpointing": checkpointing, "step_s": statistics.median(times),
            "peak": max(peaks) if peaks else None, "offloaded_mib_per_step": moved, "loss": loss.item(),
            "grads": grads}


def no_offloading(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    """The row without offloading at ``row``'s checkpointing: what its ratios and differences are against."""
    return next(r for r in rows if r["checkpointing"] == row["checkpointing"] and r["mode"] == "none")


def compare(row: dict[str, Any], baseline: dict[str, Any]) -> float:
    """The largest absolute difference of the loss or any gradient against no offloading."""
    diffs = [abs(row["loss"] - baseline["loss"])]
    diffs += [(row["grads"][n] - g).abs().max().item() for n, g in baseline["grads"].items()]
    return max(diffs)


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Hugging Face Llama with {meta['shapes']}, {meta['layers']} layers, one row of {meta['seq']} tokens,"
        f" {meta['dtype']}, forward and backward, full fine-tune (no optimizer); {meta['device']}; median of"
        f" {meta['steps']} steps after a warm-up. Peak: the device's allocated high-water mark above the step's"
        " start; moved: what ActivationOffload copied to the host per step. Ratios against no offloading at the same"
        " checkpointing; max diff: the loss's and gradients' largest difference from no offloading.",
        "",
        "| checkpointing | offloading | peak MiB | peak / none | step s | step / none | moved MiB | max diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = no_offloading(rows, row)
        peak = "n/a" if row["peak"] is None else f"{row['peak'] / MIB:.0f}"
        peak_ratio = "n/a" if row["peak"] is None else f"{row['peak'] / base['peak']:.2f}"
        moved = "" if row["offloaded_mib_per_step"] is None else f"{row['offloaded_mib_per_step']:.3g}"
        lines.append(f"| {'yes' if row['checkpointing'] else 'no'} | {row['mode']} | {peak} | {peak_ratio} |"
                     f" {row['step_s']:.3f} | {row['step_s'] / base['step_s']:.2f} | {moved} | {row['max_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (checks the harness)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; --quick 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens in the row (default 8192; --quick 64)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = QUICK_SHAPES if args.quick else SMOLLM2_SHAPES
    layers = args.layers or (2 if args.quick else 30)
    seq = args.seq or (64 if args.quick else 8192)
    config = dict(shapes, num_hidden_layers=layers)
    rows = []
    for checkpointing in (False, True):
        for mode in MODES:
            row = measure(config, mode, checkpointing, seq, args.steps, device)
            rows.append(row)
            print(f"  checkpointing={checkpointing} {mode}: step {row['step_s']:.3f} s"
                  + (f", peak {row['peak'] / MIB:.0f} MiB" if row["peak"] is not None else ""), flush=True)
    for row in rows:
        base = no_offloading(rows, row)
        row["max_diff"] = compare(row, base)
    for row in rows:
        del row["grads"]
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (copy_on_cpu)",
            "shapes": "tiny shapes" if args.quick else "SmolLM2-135M's shapes", "layers": layers, "seq": seq,
            "steps": args.steps, "torch": torch.__version__, "dtype": "bf16" if device.type == "cuda" else "fp32"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "activation_offload" + ("_quick" if args.quick else "") + ("_cpu" if device.type == "cpu" else "")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = report(rows, meta)
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
