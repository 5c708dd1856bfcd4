"""``lightning-fsdp check``: the self-check to run first on a new node or cluster, on the ranks it is launched with.

Launched with ``-n N`` local processes, or under torchrun/SLURM (every rank runs it). It prints one table and exits
1 if a check failed:

- backend and the devices every rank sees;
- collective bandwidth: all-gather and reduce-scatter of a buffer as FSDP2 issues them (bus GB/s);
- parity: two optimizer steps of a tiny GPT sharded over the ranks against the same model unsharded on one rank
  (the same global batch), at the precision's tolerances;
- bf16 and ``torch.compile`` on this device (reported; a missing one is not a failure);
- training steps of a chosen GPT preset at the configured mesh (``--cp`` for context parallelism): tokens/s, and
  the model FLOPs utilisation where the device's peak is known;
- the planner's per-rank peak for that run against the measured one (on a GPU a plan more than 25% short fails).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fsdp.commands import arguments, command_parser, fail


@dataclass
class Row:
    check: str
    result: str
    ok: Optional[bool] = True  # None: reported only


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("check", __doc__)
    parser.add_argument("-n", "--devices", type=int, default=1, metavar="N",
                        help="local processes (ignored under torchrun/SLURM, which start the ranks)")
    parser.add_argument("--model", default=None, help="GPT preset of the throughput run (default gpt-5m on CPU,"
                        " gpt-200m on GPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel rank and step")
    parser.add_argument("--steps", type=int, default=4, help="measured steps after one warm-up step")
    parser.add_argument("--cp", type=int, default=1, dest="context_parallel", help="context-parallel ranks")
    parser.add_argument("--precision", default=None, help="Fabric precision (default bf16-mixed on GPU, else 32-true)")
    parser.add_argument("--bandwidth-mib", type=float, default=None,
                        help="MiB each rank contributes to the timed collectives (default 1024 on GPU, 32 on CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak, for MFU")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile check")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = arguments(build_parser(), argv)
    try:
        _check_arguments(args)
    except ValueError as err:
        return fail("check", err)
    import lightning as L
    import torch

    from lightning_fsdp.fabric import FSDPCustomFabricStrategy

    gpu = torch.cuda.is_available()
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    args.model = args.model or ("gpt-200m" if gpu else "gpt-5m")
    fabric = L.Fabric(accelerator="cuda" if gpu else "cpu", devices=args.devices, precision=args.precision,
                      strategy=FSDPCustomFabricStrategy(context_parallel=args.context_parallel))
    fabric.launch()
    rows = [_devices(fabric), *_bandwidth(fabric, args), _parity(fabric, args), *_support(fabric, args),
            *_throughput(fabric, args)]
    if fabric.global_rank == 0:
        print(format_rows(rows, fabric))
    return 1 if any(row.ok is False for row in rows) else 0


def _check_arguments(args: argparse.Namespace) -> None:
    """What can be refused before any process starts."""
    from lightning_fsdp.models.gpt_config import PRESETS
    from lightning_fsdp.parallel.mesh import check_context_parallel

    check_context_parallel(args.context_parallel)
    launched = "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", args.devices)))
    if world % args.context_parallel:
        raise ValueError(f"--cp {args.context_parallel} does not divide the {world} ranks"
                         f"{'' if launched else ' (-n)'}; choose a divisor of {world}.")
    if args.model is not None and args.model not in PRESETS:
        raise ValueError(f"--model {args.model!r} is not a GPT preset; choose one of {sorted(PRESETS)}.")
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError("--steps and --batch-size must be at least 1.")


def format_rows(rows: list[Row], fabric: Any) -> str:
    width = max(len(r.check) for r in rows)
    mark = {True: "ok", False: "FAILED", None: "--"}
    lines = [f"lightning-fsdp check: {fabric.world_size} rank(s)", "", f"| {'check':<{width}} | status | result |",
             f"|{'-' * (width + 2)}|--------|--------|"]
    lines += [f"| {r.check:<{width}} | {mark[r.ok]:<6} | {r.result} |" for r in rows]
    failed = [r.check for r in rows if r.ok is False]
    lines += ["", f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "every check passed"]
    return "\n".join(lines)


def _devices(fabric: Any) -> Row:
    import torch
    import torch.distributed as dist

    device = fabric.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    names: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(names, name)
    distinct = sorted(set(names))
    return Row("backend and devices", f"{dist.get_backend()}, {fabric.world_size} × " + " / ".join(distinct),
               len(distinct) == 1 or None)


def _bandwidth(fabric: Any, args: argparse.Namespace) -> list[Row]:
    """Bus bandwidth of FSDP2's two collectives: ``size × (N - 1) / N / seconds`` per rank, the median of 5."""
    import torch
    import torch.distributed as dist

    world = fabric.world_size
    if world == 1:
        return [Row("all-gather / reduce-scatter", "one rank: nothing to measure", None)]
    mib = args.bandwidth_mib or (1024.0 if fabric.device.type == "cuda" else 32.0)
    numel = int(mib * 2**20 / 4) // world * world
    send = torch.ones(numel // world, device=fabric.device)
    full = torch.empty(numel, device=fabric.device)
    rows = []
    # the names FSDP2 calls in torch 2.13 (the older ones warn that they are deprecated)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for name, op in (("all-gather", lambda: gather(full, send)), ("reduce-scatter", lambda: scatter(send, full))):
        times = []
        for _ in range(6):
            _synchronize(fabric)
            start = time.perf_counter()
            op()
            _synchronize(fabric)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        rate = numel * 4 * (world - 1) / world / seconds / 1e9
        rows.append(Row(f"{name} bandwidth", f"{rate:.2f} GB/s ({mib:.0f} MiB, {seconds * 1e3:.1f} ms)"))
    return rows


def _synchronize(fabric: Any) -> None:
    import torch

    if fabric.device.type == "cuda":
        torch.cuda.synchronize(fabric.device)
    fabric.barrier()


def _parity(fabric: Any, args: argparse.Namespace) -> Row:
    """Two SGD steps of a tiny GPT, sharded, against an unsharded copy on every rank fed the whole global batch."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_fsdp.models.gpt import GPT
    from lightning_fsdp.models.gpt_config import get_preset

    torch.manual_seed(0)
    config = get_preset("gpt-tiny", vocab_size=64, seq_len=32)
    reference = GPT(config).to(fabric.device)
    sharded = fabric.setup_module(copy.deepcopy(reference).cpu())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(sharded.parameters(), lr=0.5))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    dp = fabric.world_size // args.context_parallel
    reader = fabric.global_rank // args.context_parallel
    autocast = _autocast(fabric, args.precision)
    worst = 0.0
    for _ in range(2):
        data = torch.randint(0, 64, (2 * dp, config.seq_len + 1), generator=generator).to(fabric.device)
        x, y = data[:, :-1], data[:, 1:]
        with fabric.strategy.sequence_split((x[2 * reader:2 * reader + 2], y[2 * reader:2 * reader + 2])) as part:
            loss = F.cross_entropy(sharded(part[0]).flatten(0, 1).float(), part[1].flatten())
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with autocast:
            ref_loss = F.cross_entropy(reference(x).flatten(0, 1).float(), y.flatten())
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
        worst = max(worst, abs(float(mean) - float(ref_loss.detach())))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    gathered = {k: v for k, v in get_model_state_dict(sharded, options=options).items() if isinstance(v, torch.Tensor)}
    rtol, atol = (1.3e-6, 1e-5) if args.precision in ("32-true", "32") else (2e-2, 1e-3)
    problems = [name for name, value in reference.state_dict().items()
                if name in gathered and not torch.allclose(gathered[name].to(value), value, rtol=rtol, atol=atol)]
    verdict = torch.tensor([float(bool(problems)), worst], device=fabric.device)
    verdict = fabric.all_reduce(verdict, reduce_op="max")
    ok = verdict[0].item() == 0 and verdict[1].item() <= atol + rtol * abs(float(ref_loss.detach()))
    detail = f"2 steps, losses within {verdict[1].item():.1e}" + (f"; differing: {', '.join(problems[:3])}" if problems else "")
    return Row("parity: sharded vs one device", detail, ok)


def _autocast(fabric: Any, precision: str) -> Any:
    import contextlib

    import torch

    if precision.startswith("bf16") or precision.startswith("16"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return torch.autocast(fabric.device.type, dtype=dtype)
    return contextlib.nullcontext()


def _support(fabric: Any, args: argparse.Namespace) -> list[Row]:
    import torch

    device = fabric.device
    try:
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        bf16 = bool((a @ a).float().mean().item() == 64.0)
        if device.type == "cuda":
            bf16 = bf16 and torch.cuda.is_bf16_supported()
    except RuntimeError:
        bf16 = False
    rows = [Row("bf16", "supported" if bf16 else "not supported", None)]
    if args.no_compile:
        return [*rows, Row("torch.compile", "skipped (--no-compile)", None)]
    from lightning_fsdp._torch_compat import compile_errors

    errors: tuple[type[BaseException], ...] = (*compile_errors(), RuntimeError, OSError)
    try:
        start = time.perf_counter()
        compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
        x = torch.randn(256, device=device)
        works = bool(torch.allclose(compiled(x), torch.nn.functional.gelu(x) * 2 + 1, atol=1e-5))
        result = f"works ({time.perf_counter() - start:.1f} s to compile)" if works else "wrong results"
    except errors as err:
        works, result = False, f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return [*rows, Row("torch.compile", result, None)]


def _throughput(fabric: Any, args: argparse.Namespace) -> list[Row]:
    """``--steps`` AdamW steps of the preset at the configured mesh: tokens/s, MFU and the planner's peak."""
    import torch
    import torch.nn.functional as F

    from lightning_fsdp.memory import PeakMemory
    from lightning_fsdp.models.gpt import GPT
    from lightning_fsdp.models.gpt_config import count_params, get_preset
    from lightning_fsdp.planner import PlanOptions, estimate, gpt_flops_per_token, gpt_model_spec, package_gpt
    from lightning_fsdp.planner.hardware import peak_tflops

    config = get_preset(args.model, **({"seq_len": args.seq} if args.seq else {}))
    seq, cp = config.seq_len, args.context_parallel
    dp = fabric.world_size // cp
    tracker = PeakMemory(fabric.device)
    tracker.reset()
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(fabric.global_rank // cp)
    times = []
    for _ in range(args.steps + 1):
        data = torch.randint(0, config.vocab_size, (args.batch_size, seq + 1), generator=generator).to(fabric.device)
        _synchronize(fabric)
        start = time.perf_counter()
        with fabric.strategy.sequence_split((data[:, :-1], data[:, 1:])) as (x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        _synchronize(fabric)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    tokens_per_s = dp * args.batch_size * seq / step
    measured = int(fabric.all_reduce(torch.tensor(float(tracker.peak()), device=fabric.device), reduce_op="max"))
    dims = package_gpt(config.n_layer, config.d_model, config.n_head, config.vocab_size, seq,
                       mlp_ratio=float(config.mlp_ratio), tie_weights=config.tie_weights)
    options = PlanOptions(world_size=fabric.world_size, precision=args.precision, batch_size=args.batch_size,
                          seq_len=seq, context_parallel=cp)
    planned = estimate(gpt_model_spec(dims, args.model), options).peak
    name = torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else "cpu"
    peak = args.peak_tflops or peak_tflops(name)
    mfu = (f"{gpt_flops_per_token(dims) * tokens_per_s / (peak * 1e12 * fabric.world_size):.1%} of"
           f" {peak:.0f} TFLOP/s per device") if peak else "unknown peak (pass --peak-tflops)"
    size = f"{args.model} ({count_params(config) / 1e6:.1f}M), {dp} × {args.batch_size} × {seq} tokens, cp={cp}"
    what = "peak allocated" if fabric.device.type == "cuda" else "peak RSS above the start"
    ratio = measured / planned if planned else float("nan")
    # on a GPU the allocator's peak is what the plan predicts, and a plan 25% short would run out of memory; on CPU
    # the RSS also holds the allocator's and the libraries' own memory, so the comparison is reported only
    judged: Optional[bool] = (ratio <= 1.25) if fabric.device.type == "cuda" else None
    return [
        Row("step throughput", f"{tokens_per_s:,.0f} tokens/s, {step:.3f} s/step: {size}"),
        Row("model FLOPs utilisation", mfu, None),
        Row("planner vs measured", f"{what} {measured / 2**20:,.0f} MiB, planned {planned / 2**20:,.0f} MiB"
            f" ({ratio:.2f}×)", judged),
    ]


if __name__ == "__main__":
    sys.exit(main())
