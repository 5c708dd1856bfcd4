"""``lightning-fsdp estimate``: the plan for a model on a world size, mesh, precision and offload choice."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any, Optional

from lightning_fsdp.formatting import format_bytes, format_count, parse_bytes
from lightning_fsdp.loss import DEFAULT_CHUNK_TOKENS, check_chunk_tokens
from lightning_fsdp.planner.advice import DEFAULT_HEADROOM, Verdict, verdict
from lightning_fsdp.planner.estimate import OPTIMIZER_STATES, PRECISION_BYTES, Estimate, PlanOptions, estimate
from lightning_fsdp.planner.geometry import GPTDims, ModelSpec, gpt_model_spec
from lightning_fsdp.planner.llama import DEFAULT_LORA_TARGETS, llama_dims, llama_model_spec, load_hf_config, with_lora
from lightning_fsdp.planner.llama import PRESETS as LLAMA_PRESETS
from lightning_fsdp.planner.rollout import GRPOPlan, RolloutEstimate, grpo_estimate
from lightning_fsdp.planner.sources import load_config, spec_from_checkpoint, spec_from_config
from lightning_fsdp.precision import normalize_precision


#: what each DPO reference costs, beside its bytes
REFERENCE_NOTES = {
    "copy": "a frozen copy of the base, sharded: 1/N of its parameters per rank; one more forward per step",
    "adapters_off": "the base with the adapters switched off: no second copy; one more forward per step",
    "precomputed": "log-probabilities scored once before training: no reference model, no extra forward",
}


def format_grpo(rollout: RolloutEstimate, training: Estimate, plan: GRPOPlan, peak: int) -> str:
    """The rollout's part of a GRPO plan, beside the training table above it."""
    how = "every unit gathered once" if plan.mode == "gather_once" else "one unit at a time, as training"
    return "\n".join([
        "",
        f"GRPO: {plan.num_generations} completions of ≤ {plan.completion_length} tokens per prompt, prompts ≤"
        f" {plan.prompt_length} tokens; the table above is the training of those completions",
        "",
        "| rollout (rank 0) | bytes | |",
        "|---|---:|---|",
        f"| sharded state (+ reference) | {format_bytes(rollout.resident)} | as in training |",
        f"| parameters decoded with ({plan.mode}) | {format_bytes(rollout.gathered)} | {how} |",
        f"| key/value cache | {format_bytes(rollout.kv_cache)} | every completion decoded at once, prompt + completion |",
        f"| one step's logits | {format_bytes(rollout.logits)} | |",
        f"| **rollout peak** | **{format_bytes(rollout.peak)}** | |",
        f"| **GRPO step peak** | **{format_bytes(peak)}** | the larger of the rollout and the training ({format_bytes(training.device)}) |",
    ])


def format_estimate(spec: ModelSpec, est: Estimate, v: Optional[Verdict] = None) -> str:
    o = est.options
    mesh = f"{o.replicate} × {o.shard}" if o.strategy == "fsdp" else f"{o.world_size} replicas"
    if o.context_parallel > 1:
        mesh += f" (of which context {o.context_parallel})"
    trainable = spec.trainable_numel
    lines = [
        f"model {spec.name}: {format_count(spec.numel)} parameters"
        + (f" ({format_count(trainable)} trainable)" if trainable != spec.numel else "")
        + f" in {len(spec.units)} units"
        f" (largest block {format_count(max((u.numel for u in spec.blocks), default=0))}, root {format_count(spec.root.numel)})",
        f"strategy {o.strategy}, world {o.world_size} (mesh replicate × shard = {mesh}), precision {o.precision},"
        f" optimizer {o.optimizer}, cpu_offload={o.cpu_offload}, activation checkpointing={o.activation_checkpointing}"
        + (f", frozen base held in {o.quantize_base}" if o.quantize_base else ""),
        "",
        "| per rank (rank 0, the largest shard) | bytes | |",
        "|---|---:|---|",
        f"| parameters | {format_bytes(est.params)} | |",
        f"| gradients | {format_bytes(est.grads)} | |",
        f"| optimizer state | {format_bytes(est.optimizer)} | {OPTIMIZER_STATES[o.optimizer]} state(s) per parameter |",
        f"| = sharded state | {format_bytes(est.state)} | ideal state / {est.shard} = {format_bytes(est.ideal_state)} |",
        f"| gathered params (root + unit + prefetch{' + the reference root' if o.reference == 'copy' else ''})"
        f" | {format_bytes(est.gathered)} | |",
        f"| unsharded grads before reduce-scatter | {format_bytes(est.unsharded_grads)} | |",
    ]
    if est.dequantized:
        lines.append(f"| one quantized weight dequantized for its matmul | {format_bytes(est.dequantized)} | |")
    if est.all_gather_buffers:
        lines.append(f"| all-gather buffers (the previous unit's output kept into the next all-gather) |"
                     f" {format_bytes(est.all_gather_buffers)} | |")
    if est.comm_buffers:
        lines.append(f"| DDP gradient buckets | {format_bytes(est.comm_buffers)} | |")
    if o.reference is not None:
        lines.append(f"| DPO reference ({o.reference}) | {format_bytes(est.reference)} | {REFERENCE_NOTES[o.reference]} |")
    act_note = "" if spec.has_activation_model else "unknown for this architecture: not included"
    lines.append(f"| activations (batch {o.batch_size}) | {format_bytes(est.activations)} | {act_note} |")
    lines.append(f"| **device peak** | **{format_bytes(est.device)}** | |")
    if est.host:
        lines.append(f"| host (offloaded state) | {format_bytes(est.host)} | |")
    if v is not None:
        lines.append("")
        state = "FITS" if v.fits else "DOES NOT FIT"
        lines.append(f"verdict: {state} — needs {format_bytes(v.needed)} of {format_bytes(v.usable)} usable ({format_bytes(v.budget)} minus headroom)")
        lines += [f"  - {a}" for a in v.advice]
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-fsdp estimate",
        description="Each rank's expected memory for training a model with fsdp_custom (or ddp), before launching.",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--config", help="Hydra model config: a YAML path or `group=option` (e.g. model=gpt_5m)")
    src.add_argument("--checkpoint", help="a sharded checkpoint directory or a .ckpt/.pt/.safetensors file")
    src.add_argument(
        "--hf-config",
        help=f"a Hugging Face Llama-family config.json, its directory, or a preset ({', '.join(sorted(LLAMA_PRESETS))})",
    )
    src.add_argument("--layers", type=int, help="GPT: number of blocks")
    src.add_argument("--width", type=int, help="GPT: d_model")
    src.add_argument("--vocab", type=int, default=None, help="GPT: vocabulary size")
    src.add_argument("--heads", type=int, default=None, help="GPT: attention heads (for activations)")
    src.add_argument("--seq", type=int, default=None, help="sequence length (overrides the model's)")
    src.add_argument("--mlp-ratio", type=float, default=4.0)
    src.add_argument("--untied", action="store_true", help="GPT: LM head not tied to the embedding")
    src.add_argument("--lora-rank", type=int, help="LoRA of this rank on a frozen base (with --hf-config)")
    src.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS), help="LoRA's target projections")
    run = p.add_argument_group("training setup")
    run.add_argument("--world-size", "-n", type=int, default=1)
    run.add_argument("--replicate", type=int, default=1, help="HSDP replicas (mesh replicate × shard)")
    run.add_argument("--cp", type=int, default=1, dest="context_parallel",
                     help="context parallelism: ranks that split each sequence (strategy.context_parallel)")
    run.add_argument("--precision", default="32-true", help=f"one of {sorted(PRECISION_BYTES)}")
    run.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    run.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp", "single"])
    run.add_argument("--cpu-offload", action="store_true")
    run.add_argument("--quantize-base", choices=["nf4"], help="QLoRA: the frozen linear weights of the blocks in NF4")
    run.add_argument("--batch-size", type=int, default=1, help="per rank")
    run.add_argument("--activation-checkpointing", action="store_true")
    run.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    run.add_argument("--loss-chunk", default=None,
                     help="tokens per chunk of the loss (the models' loss_chunk), or 'none' for the whole logits;"
                          f" default: the model's own (--hf-config: {DEFAULT_CHUNK_TOKENS}, as HFCausalLM; --config:"
                          " its loss_chunk; otherwise the GPT example's whole logits)")
    run.add_argument("--max-seq", action="store_true",
                     help="with --device-memory: the longest sequence (per sample) that fits, by bisection")
    run.add_argument("--reference", choices=sorted(REFERENCE_NOTES),
                     help="DPO's reference model: a frozen sharded copy, the base with LoRA off, or precomputed")
    grpo = p.add_argument_group("GRPO (--batch-size counts prompts per rank)")
    grpo.add_argument("--grpo-generations", type=int, help="completions per prompt (num_generations): plan a GRPO step")
    grpo.add_argument("--completion-length", type=int, default=256, help="max_completion_length")
    grpo.add_argument("--prompt-length", type=int, default=512, help="max_prompt_length")
    grpo.add_argument("--rollout-mode", default="gather_once", choices=["gather_once", "stream"])
    run.add_argument("--device-memory", help="per-rank memory to check against, e.g. 80GiB, 24GB, 512MiB")
    run.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="share of device memory kept free")
    run.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def loss_chunk_of(args: argparse.Namespace) -> Optional[int]:
    """``--loss-chunk``, or the loss the described model computes by default."""
    if args.loss_chunk is not None:
        return _loss_chunk(args.loss_chunk)
    if args.hf_config is not None:
        return DEFAULT_CHUNK_TOKENS
    if args.config is not None:
        chunk = load_config(args.config).get("loss_chunk")
        return None if chunk is None else check_chunk_tokens(int(chunk))
    return None


def _loss_chunk(text: str) -> Optional[int]:
    if text.lower() in ("none", "null", "whole"):
        return None
    try:
        return check_chunk_tokens(int(text))
    except ValueError as err:
        raise ValueError(f"--loss-chunk {text}: a positive number of tokens, or 'none'.") from err


def longest_sequence(spec: ModelSpec, options: PlanOptions, device_bytes: int, headroom: float,
                     limit: int = 1 << 22) -> int:
    """The largest ``seq_len`` whose plan fits ``device_bytes`` per rank (minus ``headroom``); 0 if none does.
    The plan grows with the sequence, so a bisection finds it."""
    usable = int(device_bytes * (1 - headroom))

    def fits(seq: int) -> bool:
        return estimate(_with_seq(spec, seq), replace(options, seq_len=seq)).device <= usable

    step = 2 * options.context_parallel if options.context_parallel > 1 else 1  # rows split into 2·cp chunks
    if not fits(step):
        return 0
    low, high = 1, 2
    while high * step <= limit and fits(high * step):
        low, high = high, high * 2
    high = min(high, limit // step + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step


def _with_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    if spec.gpt is not None:
        return replace(spec, gpt=replace(spec.gpt, seq_len=seq))
    if spec.llama is not None:
        return replace(spec, llama=replace(spec.llama, seq_len=seq))
    return spec


def resolve_spec(args: argparse.Namespace) -> ModelSpec:
    """The model the command line describes (exactly one source)."""
    sources = [s for s in ("config", "checkpoint", "layers", "hf_config") if getattr(args, s) is not None]
    if len(sources) != 1:
        raise ValueError(
            "Describe the model with exactly one of --config, --checkpoint, --hf-config or --layers/--width/--vocab."
        )
    if args.lora_rank is not None and args.hf_config is None:
        raise ValueError("--lora-rank needs --hf-config (a Llama-family model).")
    if args.hf_config is not None:
        targets = tuple(t for t in args.lora_targets.split(",") if t)
        dims = with_lora(llama_dims(load_hf_config(args.hf_config), args.seq), args.lora_rank, targets)
        lora = f" + LoRA r={args.lora_rank} on {','.join(targets)}" if args.lora_rank else ""
        return llama_model_spec(dims, f"{args.hf_config}{lora}")
    if args.config is not None:
        cfg = load_config(args.config)
        spec = spec_from_config(cfg, name=args.config)
    elif args.checkpoint is not None:
        spec = spec_from_checkpoint(args.checkpoint, args.heads, args.seq)
    else:
        if args.width is None or args.vocab is None:
            raise ValueError("--layers needs --width and --vocab (and --heads, --seq for the activation estimate).")
        heads = args.heads or max(1, args.width // 64)
        gpt_dims = GPTDims(
            n_layer=args.layers, d_model=args.width, n_head=heads, vocab_size=args.vocab,
            seq_len=args.seq or 1024, mlp_ratio=args.mlp_ratio, tie_weights=not args.untied,
        )
        spec = gpt_model_spec(gpt_dims, f"gpt L{args.layers} d{args.width} V{args.vocab}")
    if spec.gpt is not None and args.seq is not None:
        spec = replace(spec, gpt=replace(spec.gpt, seq_len=args.seq))
    return spec


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-fsdp estimate``: print the per-rank plan and, with ``--device-memory``, a verdict and advice."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        spec = resolve_spec(args)
        options = PlanOptions(
            world_size=args.world_size, replicate=args.replicate, precision=normalize_precision(args.precision),
            optimizer=args.optimizer, cpu_offload=args.cpu_offload, strategy=args.strategy,
            batch_size=args.batch_size, seq_len=args.seq, activation_checkpointing=args.activation_checkpointing,
            attention=args.attention, quantize_base=args.quantize_base, loss_chunk=loss_chunk_of(args),
            reference=args.reference, context_parallel=args.context_parallel,
        )
        if args.max_seq:
            if not args.device_memory:
                raise ValueError("--max-seq needs --device-memory.")
            longest = longest_sequence(spec, options, parse_bytes(args.device_memory), args.headroom)
            print(json.dumps({"model": spec.name, "max_seq": longest}) if args.json else
                  f"{spec.name}: the longest sequence that fits {args.device_memory} per rank is"
                  f" {longest if longest else 'none (not even 1 token)'} tokens × batch {options.batch_size}")
            return 0 if longest else 1
        if args.grpo_generations:
            return _grpo_main(args, spec, options)
        est = estimate(spec, options)
        v = verdict(spec, options, parse_bytes(args.device_memory), headroom=args.headroom) if args.device_memory else None
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-fsdp estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out: dict[str, Any] = {"model": spec.name, "numel": spec.numel, **est.as_dict()}
        if v is not None:
            out["verdict"] = asdict(v)
        print(json.dumps(out, indent=2))
    else:
        print(format_estimate(spec, est, v))
    return 0 if v is None or v.fits else 1


def _grpo_main(args: argparse.Namespace, spec: ModelSpec, options: PlanOptions) -> int:
    plan = GRPOPlan(args.grpo_generations, args.completion_length, args.prompt_length, args.rollout_mode)
    training, rollout, peak = grpo_estimate(spec, options, plan)
    budget = parse_bytes(args.device_memory) if args.device_memory else None
    fits = budget is None or peak <= budget * (1 - args.headroom)
    if args.json:
        out = {"model": spec.name, "numel": spec.numel, "training": training.as_dict(),
               "rollout": {**asdict(rollout), "peak": rollout.peak, "mode": plan.mode}, "peak": peak}
        if budget is not None:
            out["fits"] = fits
        print(json.dumps(out, indent=2))
    else:
        print(format_estimate(spec, training) + format_grpo(rollout, training, plan, peak))
        if budget is not None:
            print(f"\nverdict: {'FITS' if fits else 'DOES NOT FIT'} — {format_bytes(peak)} of"
                  f" {format_bytes(int(budget * (1 - args.headroom)))} usable")
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
