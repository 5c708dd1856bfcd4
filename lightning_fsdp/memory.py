"""How many bytes of parameters, gradients and optimizer state each rank really holds, and its peak memory.

Measurement only, for any front end: the Trainer's ``MemoryReport`` callback (:mod:`lightning_fsdp.trainer.memory`)
reports it, a Fabric loop can call it directly, and :mod:`lightning_fsdp.planner` estimates the same numbers before
a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from lightning_fsdp.formatting import format_bytes
from lightning_fsdp.parallel.mesh import local_shard
from lightning_fsdp.sharding import nf4
from lightning_fsdp.sharding.quantize import shard_bytes


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state resident on one rank (its local shards only)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (the local shard of a DTensor; a quantized weight's stored fields)."""
    quantized = shard_bytes(t)
    if quantized is not None:
        return quantized
    local = local_shard(t)
    return local.numel() * local.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], size: Callable[[torch.Tensor], int]) -> StateBytes:
    params = _unique(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    opt_tensors = [
        v for opt in optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return StateBytes(
        params=sum(size(p) for p in params),
        grads=sum(size(g) for g in grads),
        optimizer=sum(size(t) for t in opt_tensors if t.numel() > 1),  # not the scalar `step` counters
    )


def local_state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    """Local bytes of this rank's parameter shards, gradient shards and optimizer state."""
    return _state_bytes(model, optimizers, tensor_bytes)


def unsharded_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` if it were unsharded (its global shape; a quantized weight at its quantized size)."""
    if shard_bytes(t) is not None:
        return int(t.numel() * nf4.bytes_per_element())
    return t.numel() * t.element_size()


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters if they were unsharded (the global shape of each DTensor)."""
    return sum(unsharded_bytes(p) for p in _unique(model.parameters()))


def global_state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    """Bytes of the same state if nothing were sharded (global shapes): what one rank of DDP would hold."""
    return _state_bytes(model, optimizers, unsharded_bytes)


# -- peak memory ---------------------------------------------------------------------------------------------------
def current_rss() -> int:
    """Resident set size of this process in bytes (``/proc`` on Linux, else psutil, else 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def peak_rss() -> int:
    """Peak resident set size of this process in bytes: the kernel's high-water mark, and never below the current RSS
    (some kernels and sandboxes update the high-water mark lazily, or not after a ``clear_refs`` reset)."""
    return max(_high_water_rss(), current_rss())


def _high_water_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux ``clear_refs``); False where unsupported.

    Without a reset, the peak of the whole process (imports, data loading) would hide the peak of training.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # some sandboxes accept the write and ignore it: report a reset only if the mark now sits at the current RSS
    return _high_water_rss() <= current_rss() + 8 * 1024 * 1024


class PeakMemory:
    """Peak memory since :meth:`reset`: the CUDA caching allocator's ``max_memory_allocated`` on a GPU, the peak
    resident set size above the RSS at reset on CPU."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.baseline = 0
        self.peak_was_reset = False

    @property
    def kind(self) -> str:
        return "cuda_max_allocated" if self.device.type == "cuda" else "rss_above_baseline"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.peak_was_reset = True
        else:
            self.peak_was_reset = reset_peak_rss()
            self.baseline = current_rss()

    def peak(self) -> int:
        """Bytes: CUDA peak allocated (absolute), or on CPU the peak RSS minus the RSS at :meth:`reset`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss() - self.baseline)


# -- the runtime report --------------------------------------------------------------------------------------------
RANK_FIELDS = ("params", "grads", "optimizer", "peak")


@dataclass(frozen=True)
class RankMemory(StateBytes):
    """One rank's row of the report: its state (``total``) and its peak."""

    rank: int = 0
    peak: int = 0


def format_memory_table(
    rows: Sequence[RankMemory], unsharded: StateBytes, shard_size: int, peak_kind: str = "rss_above_baseline"
) -> str:
    """The per-rank table printed at the end of fit: local state per rank against the unsharded total and the
    ideal ``total / shard_size``."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}.")
    peak_name = "peak (CUDA allocated)" if peak_kind == "cuda_max_allocated" else "peak RSS above setup"
    ideal_total = unsharded.total / shard_size
    lines = [
        f"| rank | params | grads | optimizer | state | state / ideal | {peak_name} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.total / ideal_total:.3f}" if ideal_total else "-"
        lines.append(
            f"| {r.rank} | {format_bytes(r.params)} | {format_bytes(r.grads)} | {format_bytes(r.optimizer)}"
            f" | {format_bytes(r.total)} | {ratio} | {format_bytes(r.peak)} |"
        )
    lines.append(
        f"| unsharded | {format_bytes(unsharded.params)} | {format_bytes(unsharded.grads)}"
        f" | {format_bytes(unsharded.optimizer)} | {format_bytes(unsharded.total)} | | |"
    )
    lines.append(
        f"| ideal / {shard_size} | {format_bytes(unsharded.params / shard_size)} | {format_bytes(unsharded.grads / shard_size)}"
        f" | {format_bytes(unsharded.optimizer / shard_size)} | {format_bytes(ideal_total)} | 1.000 | |"
    )
    return "\n".join(lines)
