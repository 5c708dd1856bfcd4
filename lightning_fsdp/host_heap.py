"""What a process does with its host heap while it trains: the policy both front ends share (``release_host_memory``).

glibc's allocator keeps pages that freed tensors gave back, and raises its mmap threshold as large blocks are freed;
a CPU training process (or one offloading to CPU) then grows step after step with pages that hold nothing. The
policy trims the heap after an optimizer step once RSS has grown past where the first step left it, and, for a
full fine-tune, gives large blocks their own mappings. Measurement lives in :mod:`lightning_fsdp.memory`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Optional

from torch import nn

from lightning_fsdp.memory import current_rss

__all__ = ["HeapTrimAfterGrowth", "HostHeapPolicy", "map_large_host_blocks", "release_freed_host_memory",
           "trains_most_weights"]


@functools.lru_cache(maxsize=None)
def _glibc(name: str, argtypes: tuple[type, ...]) -> Optional[Callable[..., int]]:
    """A glibc allocator function, or None where the C library has none (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function


def release_freed_host_memory() -> bool:
    """Return the host heap's free pages to the OS (glibc ``malloc_trim(0)``); False where unsupported.

    glibc keeps memory that tensors below its mmap threshold (which it raises as large blocks are freed) gave back,
    so a CPU training process grows step after step with pages holding nothing: +1.1 GiB per rank over 4 steps of a
    135M-parameter full fine-tune at 2 ranks. Called after each optimizer step, RSS at the start of a step equals
    the live state, for about 0.1 s on a 3 GiB heap.
    """
    trim = _glibc("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimAfterGrowth:
    """Trim the host heap after an optimizer step (:func:`release_freed_host_memory`) only once this process's RSS
    has grown ``slack`` bytes past where the first step left it.

    Every page a trim returns that the next step needs again is faulted in and zeroed again: trimming after every
    step cost a full fine-tune of SmolLM2 at 2 CPU ranks 0.5 s of its 6 s step. Where the heap does not grow (FSDP's
    buffers handed on, large blocks mapped), RSS creeps by ~12 MiB a step, so a trim comes about every 20 steps;
    where it does (LoRA, trim-only: ~0.2 GiB a step otherwise), after nearly every step, as before.
    """

    def __init__(self, slack: int = 256 * 1024 * 1024) -> None:
        self.slack = slack
        self.ceiling: Optional[int] = None
        self.trims = 0

    def after_step(self) -> bool:
        """Called after each optimizer step; whether it trimmed."""
        rss = current_rss()
        if self.ceiling is None:
            self.ceiling = rss + self.slack
        if rss <= self.ceiling or not release_freed_host_memory():
            return False
        self.trims += 1
        return True


LARGE_HOST_BLOCK_BYTES = 4 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def map_large_host_blocks(threshold: int = LARGE_HOST_BLOCK_BYTES) -> bool:
    """Give every host block of ``threshold`` bytes or more its own mapping, returned to the OS as soon as it is freed
    (glibc ``mallopt(M_MMAP_THRESHOLD)``); False where unsupported or where the environment already sets it.

    glibc raises its mmap threshold up to 32 MiB as large blocks are freed, so after the first step FSDP's per-unit
    buffers (gathered parameters, gradients to reduce-scatter: a few MiB to tens of MiB) come from the heap, where a
    full fine-tune's new gradient shards, kept until the optimizer step, land between a step's short-lived blocks:
    rank 0 of a 135M-parameter full fine-tune at 2 ranks peaked at 3.4 GiB for about 2.7 GiB live. A fixed 4 MiB
    threshold brings that peak to 2.9 GiB at the same step time (1 MiB: 2.8 GiB, more page faults; 16 MiB: no
    gain). ``MALLOC_MMAP_THRESHOLD_`` or a ``glibc.malloc.mmap_threshold`` tunable in the environment wins.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1


def trains_most_weights(model: nn.Module) -> bool:
    """Whether most parameters (by count) are trained: a full fine-tune, where each step's gradient shards fragment
    the host heap, not adapters on a frozen base, where mapping FSDP's gathered parameters on their own would only
    add page faults (LoRA at 2 ranks: ~10 % slower steps, for a peak already 0.8x TRL's)."""
    params = list({id(p): p for p in model.parameters()}.values())
    trained = sum(p.numel() for p in params if p.requires_grad)
    return 2 * trained > sum(p.numel() for p in params)


class HostHeapPolicy:
    """``release_host_memory`` for one run: ``None`` turns it on where parameters live in host memory (a CPU run,
    or ``cpu_offload``). The front end calls :meth:`training_starts` once the model is sharded and :meth:`step_done`
    after each optimizer step."""

    def __init__(self, release_host_memory: Optional[bool] = None) -> None:
        self.requested = release_host_memory
        self.trim = HeapTrimAfterGrowth()

    def applies(self, params_on_host: bool) -> bool:
        return bool(self.requested) if self.requested is not None else params_on_host

    def training_starts(self, model: nn.Module, params_on_host: bool) -> None:
        if self.applies(params_on_host) and trains_most_weights(model):
            map_large_host_blocks()  # every step from here: FSDP's per-unit buffers, gradient shards

    def step_done(self, params_on_host: bool) -> None:
        if self.applies(params_on_host):
            self.trim.after_step()
