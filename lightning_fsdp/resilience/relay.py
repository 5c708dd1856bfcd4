"""The failure relay: a rank's exception reaches every rank through the rendezvous store, within seconds.

A sharded step is a chain of collectives: when one rank stops taking part, the others wait in the next collective
until the process-group timeout. The failing rank prints its traceback at once and writes an abort record into the
c10d store every rank is already connected to (no collective needed, so it works while the others are blocked in
one). A watcher thread on every rank polls that key and ends its process with :data:`PEER_FAILED_EXIT_CODE` and one
line naming the failed rank. Ending the process is the one thing that reliably releases a rank blocked inside a
gloo *or* nccl collective.

While a rank handles an exception, a collective (e.g. a checkpoint save in an ``on_exception`` hook) runs only if
*every* rank failed together (:meth:`FailureRelay.gate`); otherwise it raises :class:`PartialFailureError`.

A rank that dies without a traceback (a signal: the OOM killer's SIGKILL) cannot write that record. Its parent
(:mod:`.children`) or its children (:mod:`.parent`) see it at once and end with one line naming it, its pid and the
signal, and write the record for it when the store is still up. Another rank's collective error caused by that death
("Connection closed by peer") is an echo: it waits briefly for the death to be known, and never prints after it.

Store keys (per Trainer stage): ``abort`` (first failing rank and its error, set with compare-and-set so the first
failure wins; ``rank|died|sentence`` for a death), ``failing`` (ranks handling an exception), ``acks`` (ranks that
read the abort record and are ending), ``done`` (ranks that finished the stage normally).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Optional

from lightning_fsdp._torch_compat import default_store
from lightning_fsdp.resilience.children import ChildReaper
from lightning_fsdp.resilience.errors import PEER_FAILED_EXIT_CODE, AgreedError, PartialFailureError, Preempted
from lightning_fsdp.resilience.parent import ParentWatch, launching_rank
from lightning_fsdp.resilience.report import is_marked, last_words, mark, print_traceback, summary

if TYPE_CHECKING:
    from torch.distributed import Store

POLL_INTERVAL_S = 0.2  # how often every rank looks for an abort record
PEER_GRACE_S = 1.0  # a rank that sees an abort waits this long in case it is failing too (then it joins the save)
ACK_WAIT_S = 3.0  # the failing rank keeps the store alive this long so every peer can read why
AGREE_WAIT_S = 5.0  # how long a failing rank waits for the others before a collective after a failure
SHUTDOWN_DEADLINE_S = 20.0  # a failing rank still alive this long after the failure is ended (stuck in teardown)
STORE_LOSS_S = 3.0  # the store unreachable this long means the process hosting it is gone
FINISH_WAIT_S = 60.0  # at a normal stage end, how long a rank waits (store-side) for the others to finish
ECHO_WAIT_S = 2.0  # a connection lost in a collective: how long to wait for the peer's death to become known
PARENT_FIRST_S = 0.5  # of that, how long only the parent is looked at
_DIED = "died|"  # an abort record written for a rank that died without reporting
#: how gloo and nccl say a peer's connection went away (the usual echo of a rank that died)
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "connection refused", "remote worker crash")


def _describe(record: str) -> tuple[str, str]:
    """``(rank, what happened to it)`` from an abort record."""
    rank, _, error = record.partition("|")
    if error.startswith(_DIED):
        return rank, error[len(_DIED) :]
    return rank, f"rank {rank} failed with {error} (its traceback is in its output)"


def _is_peer_lost(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(fragment in text for fragment in _PEER_LOST)


class FailureRelay:
    """Tells every rank about a failure through the rendezvous store, and ends the ranks that did not fail."""

    def __init__(self) -> None:
        self.store: Optional[Store] = None
        self.rank = 0
        self.world_size = 1
        self.handling: Optional[BaseException] = None  # this rank's own exception, while it is being handled
        self.preempted = False
        self.children = ChildReaper(
            handling=lambda: self.handling is not None, preempted=lambda: self.preempted, end=self._end_for_death
        )
        self.parent: Optional[ParentWatch] = None
        self._agreed = False
        self._active = False
        self._in_stage = False  # from launch to the stage's end: the launching rank cannot end normally meanwhile
        self._exiting = False
        self._exit_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._deadline: Optional[threading.Timer] = None

    # lifecycle -------------------------------------------------------------------------------------------------------
    def start(self, rank: int, world_size: int) -> None:
        """Begin watching (after the process group exists). Without a reachable store, failures are not relayed."""
        import torch.distributed as dist

        self._stop.set()  # a previous stage's watcher, if its teardown never ran
        self.rank, self.world_size = rank, world_size
        self.handling, self._agreed = None, False
        if world_size < 2:
            return
        base = default_store()
        if base is None:
            return
        # the stage number comes from the store, not this process: it restarts with a new process group (where fresh
        # ranks start counting at 1 too) and agrees across ranks however many stages this process ran before
        stage = int(base.add(f"lightning_fsdp/resilience/stage/rank{rank}", 1))
        self.store = dist.PrefixStore(f"lightning_fsdp/resilience/{stage}/", base)
        self._stop = threading.Event()
        self._active = True
        self._thread = threading.Thread(target=self._watch, name="lightning-fsdp-failure-watch", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """End of a stage. On the normal path, wait (store-side) for every rank, so that the process hosting the
        store (rank 0 under Lightning's launcher) cannot exit while another rank still watches it."""
        self._in_stage = False  # first: the launching rank may exit as soon as every rank added "done"
        if self.store is not None and self.handling is None and self._active:
            self._active = False
            try:
                self.store.add("done", 1)
                deadline = time.monotonic() + FINISH_WAIT_S
                while time.monotonic() < deadline:
                    if int(self.store.add("done", 0)) >= self.world_size or self.store.check(["abort"]):
                        break
                    time.sleep(0.05)
            except Exception:  # noqa: BLE001 - the store is gone; nothing left to coordinate
                pass
        self._active = False
        self._stop.set()
        self.disarm_deadline()
        # join the watcher: a daemon thread still inside a C++ store call when the interpreter exits makes the
        # runtime abort ("terminate called without an active exception")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=POLL_INTERVAL_S + 5.0)

    def watch_children(self, children: list[subprocess.Popen], rank: int) -> None:
        """On the rank that spawned ``children`` (global ``rank``; theirs follow it)."""
        self.children.watch(children, rank)

    def watch_parent(self, rank: int) -> None:
        """At launch on every rank that did not spawn ranks: if its parent is the rank that did, watch it."""
        if self.parent is None:
            parent = launching_rank()
            if parent is None:
                return
            self.parent = ParentWatch(*parent, on_death=self._parent_died)
        self.rank = rank  # until the process group says so: a death during the rendezvous names this rank too
        self._in_stage = True
        sentence = self.parent.ended()
        if sentence is not None:
            self._parent_died(sentence)

    def _parent_died(self, sentence: str) -> None:
        if self._in_stage and self.handling is None and self.parent is not None:
            self._end_for_death(self.parent.rank, sentence, ending="this rank")

    def _end_for_death(self, rank: int, sentence: str, ending: str = "all ranks") -> None:
        """Rank ``rank`` died without reporting: tell the other ranks through the store, then end. Rank 0 hosts the
        store under Lightning's launcher: when it is the one that died, there is no store left to write to."""
        if self.store is not None and rank != 0:
            try:
                self.store.compare_set("abort", "", f"{rank}|{_DIED}{sentence}")
            except Exception:  # noqa: BLE001 - the store is gone as well
                pass
        self._exit(f"{sentence}; ending {ending}.")

    def _end_if_a_peer_died(self, wait_s: float) -> None:
        """This rank's own exception may be the echo of a peer's death: if that death is known within ``wait_s``
        (or the store's host is gone too), end with the line that names it instead of handling the exception."""
        deadline = time.monotonic() + wait_s
        # a dead parent shows within milliseconds: ask the store (whose loss torch logs with a C++ stack) after that
        store_from = time.monotonic() + (min(wait_s, PARENT_FIRST_S) if self.parent is not None else 0.0)
        while True:
            child = self.children.dead()
            if child is not None:
                self._end_for_death(child[0], self.children.describe(*child))
            if self.parent is not None and self.parent.ended() is not None:
                self._end_for_death(self.parent.rank, self.parent.ended() or "", ending="this rank")
            if time.monotonic() < store_from:
                time.sleep(0.01)
                continue
            try:
                if self.store is not None and self.store.check(["abort"]):
                    record = self.store.get("abort").decode(errors="replace")
                    if record.partition("|")[2].startswith(_DIED):
                        self._stop_for(record)  # the record of a death: this exception is its echo
                    return  # a rank reported first: the usual path says this is a consequence of it
                store_lost = False
            except Exception:  # noqa: BLE001 - the store's host is gone (the parent, if it is one: wait to see)
                store_lost = True
            out_of_time = time.monotonic() >= deadline
            if store_lost and (self.parent is None or out_of_time):
                self._exit(self._store_lost_message("is unreachable"))
            if out_of_time:
                return
            time.sleep(0.05)

    def _store_lost_message(self, how: str) -> str:
        import torch.distributed as dist

        if self.parent is not None and self.parent.ended() is not None:
            return f"{self.parent.ended()}; ending this rank."
        host = "the torchrun agent hosting it" if dist.is_torchelastic_launched() else "rank 0, which hosts it,"
        return (
            f"the rendezvous store {how}: {host} has died (how it ended is not known on this rank). Ending this"
            " rank instead of waiting for the collective timeout."
        )

    # the watcher -----------------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        assert self.store is not None
        lost_since: Optional[float] = None
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                flagged = self.store.check(["abort"])
                lost_since = None
            except Exception:  # noqa: BLE001 - connection refused/reset: the store's host process is gone
                if self.handling is not None or not self._active:
                    continue
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since >= STORE_LOSS_S:
                    self._exit(self._store_lost_message(f"has been unreachable for {STORE_LOSS_S:g} s"))
                continue
            if not flagged or self.handling is not None:
                continue
            if self._stop.wait(PEER_GRACE_S) or self.handling is not None:
                continue  # this rank is failing as well: it handles its own exception (and may join a save)
            try:
                record = self.store.get("abort").decode(errors="replace")
                self.store.add("acks", 1)
            except Exception:  # noqa: BLE001
                record = "?|(the failing rank's store is gone)"
            self._stop_for(record)

    def _stop_for(self, record: str) -> None:
        self._exit(
            f"stopping: {_describe(record)[1]}. Ending this rank now (exit {PEER_FAILED_EXIT_CODE}) instead of"
            " waiting for the collective timeout."
        )

    def _exit(self, message: str, code: int = PEER_FAILED_EXIT_CODE) -> None:
        """Say why, as this rank's last line, and end. The first thread to get here does; any other waits for it."""
        if not self._exit_lock.acquire(blocking=False):
            threading.Event().wait()
        self._exiting = True
        last_words(message, self.rank)
        self.children.reap(wait_s=ACK_WAIT_S)
        os._exit(code)

    # this rank failed -------------------------------------------------------------------------------------------------
    def on_exception(self, exc: BaseException) -> None:
        """Called first on the failing rank (before any ``on_exception`` hook). Never raises."""
        if isinstance(exc, Preempted):
            self.preempted = True
            return
        if self._exiting:  # another thread is ending this process: a collective error here is only its echo
            threading.Event().wait()
        if self.handling is not None:
            return
        self.handling = exc
        watched = self.parent is not None or bool(self.children.children)  # a death shows here within milliseconds
        if self.world_size > 1 or watched:
            try:
                self._end_if_a_peer_died(ECHO_WAIT_S if watched and _is_peer_lost(exc) else 0.0)
            except Exception:  # noqa: BLE001 - handle it as this rank's own failure
                pass
        self._arm_deadline()
        if self.store is None:
            return  # failed before the process group existed: nobody to tell, Python prints it as usual
        try:
            self.store.add("failing", 1)
            if isinstance(exc, AgreedError):
                if self.rank == 0:
                    print_traceback(exc, self.rank)
                else:
                    mark(exc, f"{type(exc).__name__} (raised on every rank; rank 0 prints the traceback): {exc}")
                return
            mine = f"{self.rank}|{summary(exc)}"
            current = self.store.compare_set("abort", "", mine).decode(errors="replace")
            if current != mine:
                failed_rank, _, error = current.partition("|")
                if error.startswith(_DIED):
                    self._stop_for(current)
                mark(exc, f"{type(exc).__name__} here is a consequence of rank {failed_rank} failing first with {error}.")
                return
            print_traceback(exc, self.rank)
            deadline = time.monotonic() + ACK_WAIT_S
            while time.monotonic() < deadline:
                if int(self.store.add("acks", 0)) + int(self.store.add("failing", 0)) >= self.world_size:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is unreachable: its host died first; keep the traceback
            pass

    def gate(self, operation: str) -> None:
        """Before a collective: if this rank is handling an exception, go ahead only if every rank failed too."""
        if self.handling is None or self._agreed or self.world_size < 2:
            return
        failing = 1
        if self.store is not None:
            deadline = time.monotonic() + AGREE_WAIT_S
            try:
                while time.monotonic() < deadline:
                    failing = int(self.store.add("failing", 0))
                    if failing >= self.world_size:
                        self._agreed = True
                        self.disarm_deadline()  # every rank takes part: the collective completes or times out
                        return
                    if int(self.store.add("acks", 0)) > 0:
                        break  # some rank is already ending: it will never join
                    time.sleep(0.05)
            except Exception:  # noqa: BLE001
                pass
        raise PartialFailureError(
            f"{operation} was skipped on rank {self.rank}: it is a collective, and only {failing} of"
            f" {self.world_size} ranks are handling an exception; the others cannot join it (they are blocked in"
            " the step's collectives), so it would hang until the timeout. Use"
            " `lightning_fsdp.SafeOnExceptionCheckpoint` to save on exception when possible."
        )

    def _arm_deadline(self) -> None:
        self.disarm_deadline()
        self._deadline = threading.Timer(SHUTDOWN_DEADLINE_S, self._deadline_hit)
        self._deadline.daemon = True
        self._deadline.start()

    def disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_hit(self) -> None:
        exc = self.handling
        if exc is not None and not is_marked(exc):
            print_traceback(exc, self.rank)
        self._exit(
            f"still shutting down {SHUTDOWN_DEADLINE_S:g} s after the failure (probably blocked in a collective"
            " in an on_exception hook or in teardown); ending now."
        )
