"""Rank 0 of a job launched by Lightning (``devices=N``) is the parent of the other local ranks: it reaps them.

Lightning's own child observer kills every rank as soon as one child exits non-zero. This one lets the failure
relay end things cleanly first, never treats a preemption exit as a failure, names a rank that died without a word
(killed by a signal: the OOM killer's SIGKILL leaves no traceback) with its global rank, pid and signal, and at exit
after a failure waits for the children, then kills what is left, so no rank is orphaned.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import time
from typing import Callable, Optional

from lightning_fsdp.resilience.errors import PREEMPTED_EXIT_CODE
from lightning_fsdp.resilience.report import death, how_it_ended, say

POLL_S = 0.2  # how often rank 0 looks at the ranks it spawned
CHILD_FAIL_GRACE_S = 5.0  # a spawned rank that exited non-zero may have reported an error: the relay acts on it first
REAP_WAIT_S = 15.0  # how long rank 0 waits for the ranks it spawned before killing them, after a failure
_CLEAN_EXITS = (0, PREEMPTED_EXIT_CODE)


class ChildReaper:
    """Watches the local ranks this process spawned; ``handling`` and ``preempted`` say how this rank is ending, and
    ``end(rank, sentence)`` ends it when spawned rank ``rank`` died without reporting an error."""

    def __init__(
        self, handling: Callable[[], bool], preempted: Callable[[], bool], end: Callable[[int, str], None]
    ) -> None:
        self.children: list[subprocess.Popen] = []
        self.first_rank = 0  # the global rank of this process: its children are the next ones
        self._handling = handling
        self._preempted = preempted
        self._end = end
        self._registered = False

    def watch(self, children: list[subprocess.Popen], first_rank: int) -> None:
        self.children, self.first_rank = children, first_rank
        if not self._registered:
            atexit.register(self._reap_at_exit)
            self._registered = True
        threading.Thread(target=self._observe, name="lightning-fsdp-child-observer", daemon=True).start()

    def dead(self) -> Optional[tuple[int, int, int]]:
        """``(global rank, pid, returncode)`` of the first spawned rank that exited uncleanly, if any."""
        for i, p in enumerate(self.children):
            code = p.poll()
            if code is not None and code not in _CLEAN_EXITS:
                return self.first_rank + i + 1, p.pid, code
        return None

    def describe(self, rank: int, pid: int, code: int) -> str:
        return death(f"rank {rank} (pid {pid})", code)

    def _observe(self) -> None:
        while True:
            time.sleep(POLL_S)
            codes = [p.poll() for p in self.children]
            if all(c is not None for c in codes) and all(c in _CLEAN_EXITS for c in codes):
                return
            failed = self.dead()
            if failed is None or self._handling():
                continue
            if failed[2] > 0:  # it may have printed a traceback and told the relay, which ends this process then
                time.sleep(CHILD_FAIL_GRACE_S)
                if self._handling():
                    continue
            self._end(failed[0], self.describe(*failed))

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
        bad = [
            f"rank {self.first_rank + i + 1} (pid {p.pid}) {how_it_ended(p.returncode)}"
            for i, p in enumerate(self.children)
            if p.returncode not in _CLEAN_EXITS
        ]
        if not self._handling() and bad:
            say(f"spawned ranks did not exit cleanly after the preemption save: {'; '.join(bad)}.")
            os._exit(1)
