"""Rank 0 of a job launched by Lightning (``devices=N``) is the parent of the other local ranks: it reaps them.

Lightning's own child observer kills every rank as soon as one child exits non-zero. This one lets the failure
relay end things cleanly first, never treats a preemption exit as a failure, and at exit after a failure waits for
the children, then kills what is left, so no rank is orphaned.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import time
from typing import Callable

from lightning_fsdp.resilience.errors import PREEMPTED_EXIT_CODE
from lightning_fsdp.resilience.report import say

CHILD_FAIL_GRACE_S = 5.0  # rank 0's backstop when a spawned rank died without telling anyone (hard crash)
REAP_WAIT_S = 15.0  # how long rank 0 waits for the ranks it spawned before killing them, after a failure
_CLEAN_EXITS = (0, PREEMPTED_EXIT_CODE)


class ChildReaper:
    """Watches the local ranks this process spawned; ``handling`` and ``preempted`` say how this rank is ending."""

    def __init__(self, handling: Callable[[], bool], preempted: Callable[[], bool], end: Callable[[str], None]) -> None:
        self.children: list[subprocess.Popen] = []
        self._handling = handling
        self._preempted = preempted
        self._end = end
        self._registered = False

    def watch(self, children: list[subprocess.Popen]) -> None:
        self.children = children
        if not self._registered:
            atexit.register(self._reap_at_exit)
            self._registered = True
        threading.Thread(target=self._observe, name="lightning-fsdp-child-observer", daemon=True).start()

    def _observe(self) -> None:
        while True:
            time.sleep(0.5)
            codes = [p.poll() for p in self.children]
            if all(c is not None for c in codes) and all(c in _CLEAN_EXITS for c in codes):
                return
            failed = [(i + 1, c) for i, c in enumerate(codes) if c not in (None, *_CLEAN_EXITS)]
            if not failed or self._handling():
                continue
            time.sleep(CHILD_FAIL_GRACE_S)  # normally the failure relay has ended this process by now
            if self._handling():
                continue
            local_rank, code = failed[0]
            self._end(f"local rank {local_rank} exited with code {code} without reporting an error; ending all ranks.")

    def reap(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for spawned ranks to exit, then kill those still running (no orphans)."""
        deadline = time.monotonic() + wait_s
        for p in self.children:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _reap_at_exit(self) -> None:
        if not self._handling() and not self._preempted():
            return  # normal exit: Lightning's behaviour (children finish on their own)
        self.reap(REAP_WAIT_S)
        bad = [(i + 1, p.returncode) for i, p in enumerate(self.children) if p.returncode not in _CLEAN_EXITS]
        if not self._handling() and bad:
            say(f"local ranks {bad} did not exit cleanly after the preemption save.")
            os._exit(1)
