"""Agreement between ranks when something goes wrong, so that a sharded job ends promptly or resumes exactly.

A sharded step is a chain of collectives: when one rank stops taking part (an exception, a signal, a NaN it
alone saw, one batch fewer), the others wait in the next collective until the process-group timeout — 30
minutes by default — and a scheduler burns the allocation. Every mechanism here makes the ranks *agree* first:

- **Failures** (:class:`FailureGuard`): the failing rank prints its traceback at once (a launcher may kill it as
  soon as its peers are gone) and writes an abort record into the rendezvous store: the c10d ``TCPStore`` every
  rank is already connected to, so no collective is needed and it works while the others are blocked in one. It
  does so in the launcher, before any ``on_exception`` hook can block. A daemon thread on every rank polls that
  key and ends its process with :data:`PEER_FAILED_EXIT_CODE` and one line naming the failed rank: the original
  traceback is shown once. Ending the process is the one thing that reliably releases a rank blocked inside a
  gloo *or* nccl collective (``torch.distributed`` has no portable abort for gloo, and nccl does not notice a
  dead peer before its timeout). Rank 0 of a job launched by Lightning (``devices=N``) also reaps the ranks it
  spawned, so none is left behind.
- **Collectives after a failure**: while a rank handles an exception, a collective (e.g. a checkpoint save in an
  ``on_exception`` hook) runs only if *every* rank failed together; otherwise it raises
  :class:`PartialFailureError` instead of hanging. :class:`SafeOnExceptionCheckpoint` turns that into "not saved".
- **Preemption** (:class:`Preemption`): SIGTERM/SIGUSR1 only set a flag; after the next optimizer step the ranks
  all-reduce it, all save to the ``last`` checkpoint through the strategy's atomic path and exit with
  :data:`PREEMPTED_EXIT_CODE`, which the SLURM script and ``torchrun --max-restarts`` treat as "requeue".
- **Non-finite steps** (:class:`NonFiniteGuard`): after backward, a NaN/inf loss on any rank or a non-finite global
  gradient norm makes every rank drop its gradients, so the optimizer leaves weights and state untouched.
- **Uneven data** (:func:`check_equal_batches`, :class:`AgreedLoader`): ranks compare their batch counts at the
  start of each epoch (or, for loaders without a length, before each batch) and all raise
  :class:`UnevenBatchesError` together.
- **Timeouts** (:meth:`Resilience.named`): a timed-out collective is re-raised as :class:`CollectiveTimeoutError`
  naming the operation, the rank and the configured timeout. The timeout applies to every group, HSDP's
  sub-groups included; joining the process group at start-up may take longer (a slow start is not a hang).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh

#: Exit status after a preemption save: "temporary failure, try again" (sysexits ``EX_TEMPFAIL``). The SLURM
#: script requeues on it; ``torchrun --max-restarts=N`` restarts on any non-zero status.
PREEMPTED_EXIT_CODE = 75
#: Exit status of a rank ended because another rank failed.
PEER_FAILED_EXIT_CODE = 1

POLL_INTERVAL_S = 0.2  # how often every rank looks for an abort record
PEER_GRACE_S = 1.0  # a rank that sees an abort waits this long in case it is failing too (then it joins the save)
ACK_WAIT_S = 3.0  # the failing rank keeps the store alive this long so every peer can read why
AGREE_WAIT_S = 5.0  # how long a failing rank waits for the others before a collective after a failure
SHUTDOWN_DEADLINE_S = 20.0  # a failing rank still alive this long after the failure is ended (stuck in teardown)
STORE_LOSS_S = 3.0  # the store unreachable this long means the process hosting it is gone
CHILD_FAIL_GRACE_S = 5.0  # rank 0's backstop when a spawned rank died without telling anyone (hard crash)
REAP_WAIT_S = 15.0  # how long rank 0 waits for the ranks it spawned before killing them, after a failure

_NOTE_ATTR = "_lightning_fsdp_note"


# -- errors -----------------------------------------------------------------------------------------------------------
class AgreedError(RuntimeError):
    """Raised by every rank at the same point (they agreed on it): only rank 0 prints the traceback."""


class UnevenBatchesError(AgreedError):
    """Ranks have different numbers of batches: some would wait forever in a collective the others never join."""


class NonFiniteStepsError(AgreedError):
    """Too many consecutive optimizer steps had a NaN/inf loss or gradient norm."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process-group timeout; the message names the operation."""


class PartialFailureError(RuntimeError):
    """A collective was requested while handling an exception, but not every rank failed: it would hang."""


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved; the process exits with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


# -- small pure helpers -----------------------------------------------------------------------------------------------
def is_timeout_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective timeout: a ``torch.distributed`` error saying so, gloo's "Timed out
    waiting 1800000ms for recv operation" or the nccl watchdog's "collective operation timeout" (not any error
    that mentions a timeout, e.g. a user's HTTP request in a step)."""
    import torch.distributed as dist

    text = str(error)
    dist_error = getattr(dist, "DistError", ())
    if isinstance(error, dist_error) and re.search(r"timed out|timeout", text, flags=re.IGNORECASE):
        return True
    return bool(re.search(r"Timed out waiting \d+ ?ms|collective operation timeout|gloo.*timed out", text, re.I | re.S))


def timeout_message(operation: str, rank: int, timeout: timedelta, original: BaseException) -> str:
    """The error a timed-out collective becomes: what hung, where, after how long, and what to do."""
    seconds = timeout.total_seconds()
    return (
        f"Collective timed out on rank {rank}: {operation} did not complete within timeout={seconds:g} s.\n"
        "Another rank is not taking part: it is stuck or slow (a long data load, a rank-dependent code path), it"
        " failed without reaching the store, or the ranks ran different numbers of batches."
        " Check the other ranks' output. If the operation is merely slow, raise the strategy's `timeout=`"
        f" (seconds).\nOriginal error: {type(original).__name__}: {str(original).strip()[:500]}"
    )


def uneven_batches_message(stage: str, counts: Sequence[Any]) -> Optional[str]:
    """``None`` if every rank reported the same batch counts for ``stage``, else an error message listing them."""
    if all(c == counts[0] for c in counts):
        return None
    listing = ", ".join(f"rank {r}: {_fmt_count(c)}" for r, c in enumerate(counts))
    return f"Ranks have different numbers of {stage} batches ({listing}). {_UNEVEN_FIX}"


_UNEVEN_FIX = (
    "A rank that runs out early would leave the others waiting in a collective until the timeout. Let Lightning"
    " shard the data (the default `use_distributed_sampler=True` pads every rank to the same length), use"
    " `drop_last=True`, or give every rank the same number of batches."
)


def _fmt_count(count: Any) -> str:
    if isinstance(count, (list, tuple)):
        return "[" + ", ".join(_fmt_count(c) for c in count) + "]"
    return "no length (iterable)" if count is None or count == float("inf") or count == -1 else str(int(count))


def nonfinite_message(consecutive: int, limit: int, step: int, detail: str) -> str:
    return (
        f"{consecutive} consecutive optimizer steps had a non-finite loss or gradient norm (limit"
        f" max_nonfinite_steps={limit}; last at global step {step}: {detail}); every rank skipped them, and training"
        " is stopped now rather than continuing without progress. Lower the learning rate, enable gradient clipping"
        " (`gradient_clip_val`), use bf16 rather than fp16, check the data for NaN/inf, or raise `max_nonfinite_steps`."
    )


def last_checkpoint_path(trainer: pl.Trainer) -> Optional[str]:
    """The path ``ckpt_path="last"`` will find: the ``last`` file of the first ``ModelCheckpoint`` with a directory.

    A ``ModelCheckpoint`` with ``save_last`` is preferred; the name follows its ``CHECKPOINT_NAME_LAST`` pattern.
    """
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not callbacks:
        return None
    callbacks.sort(key=lambda cb: not cb.save_last)
    cb = callbacks[0]
    metrics = dict(trainer.callback_metrics)
    metrics.update(epoch=torch.tensor(trainer.current_epoch), step=torch.tensor(trainer.global_step))
    return cb.format_checkpoint_name(metrics, cb.CHECKPOINT_NAME_LAST)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def _say(message: str, rank: Optional[int] = None) -> None:
    """One line on stderr, flushed at once (the process may end right after)."""
    sys.stderr.write(f"[rank {_rank() if rank is None else rank}] {message}\n")
    sys.stderr.flush()


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    """Print the one-line note instead of a traceback for errors another rank already reports in full."""
    note = getattr(exc, _NOTE_ATTR, None)
    if note:
        _say(note)
        return
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook


def _install_excepthook() -> None:
    global _previous_excepthook
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _summary(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _mark(exc: BaseException, note: str) -> None:
    try:
        setattr(exc, _NOTE_ATTR, note)
    except (AttributeError, TypeError):
        return
    _install_excepthook()


# -- failures ---------------------------------------------------------------------------------------------------------
class FailureGuard:
    """Tells every rank about a failure through the rendezvous store, and ends the ranks that did not fail.

    Store keys (per Trainer stage): ``abort`` (first failing rank and its error, set with compare-and-set so the
    first failure wins), ``failing`` (how many ranks are handling an exception), ``acks`` (how many ranks read the
    abort record and are ending), ``done`` (how many ranks finished the stage normally).
    """

    def __init__(self) -> None:
        self.store: Optional[Store] = None
        self.rank = 0
        self.world_size = 1
        self.handling: Optional[BaseException] = None  # this rank's own exception, while it is being handled
        self._agreed = False
        self._active = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._deadline: Optional[threading.Timer] = None
        self._children: list[subprocess.Popen] = []
        self._reaper_registered = False
        self.preempted = False
        self._exiting = False

    # lifecycle -------------------------------------------------------------------------------------------------------
    def start(self, rank: int, world_size: int) -> None:
        """Begin watching (after the process group exists). Without a reachable store, failures are not relayed."""
        import torch.distributed as dist

        self._stop.set()  # a previous stage's watcher, if its teardown never ran
        self.rank, self.world_size = rank, world_size
        self.handling, self._agreed = None, False
        if world_size < 2:
            return
        try:
            base = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            rank_zero_warn("lightning_fsdp: no rendezvous store found; a failing rank will not stop the others early.")
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
        if self.store is not None and self.handling is None and self._active:
            self._active = False
            try:
                self.store.add("done", 1)
                deadline = time.monotonic() + 60.0
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
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=POLL_INTERVAL_S + 5.0)

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
                    self._exit(
                        f"lost contact with the rendezvous store for {STORE_LOSS_S:g} s: the process hosting it"
                        " (rank 0, or the launcher agent) has died. Ending this rank instead of waiting for the"
                        " collective timeout."
                    )
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
            failed_rank, _, error = record.partition("|")
            self._exit(
                f"stopping: rank {failed_rank} failed with {error} (its traceback is in its output)."
                f" Ending this rank now (exit {PEER_FAILED_EXIT_CODE}) instead of waiting for the collective timeout."
            )

    def _exit(self, message: str, code: int = PEER_FAILED_EXIT_CODE) -> None:
        self._exiting = True
        _say(message, self.rank)
        self.reap_children(wait_s=ACK_WAIT_S)
        os._exit(code)

    # this rank failed -------------------------------------------------------------------------------------------------
    def on_exception(self, exc: BaseException) -> None:
        """Called first on the failing rank (before any ``on_exception`` hook). Never raises."""
        if isinstance(exc, Preempted):
            self.preempted = True
            return
        if self._exiting:  # the watcher is ending this process: a collective error here is only its echo
            threading.Event().wait()
        if self.handling is not None:
            return
        self.handling = exc
        self._arm_deadline()
        if self.store is None:
            return  # failed before the process group existed: nobody to tell, Python prints it as usual
        try:
            self.store.add("failing", 1)
            if isinstance(exc, AgreedError):
                if self.rank == 0:
                    self._report(exc)
                else:
                    _mark(exc, f"{type(exc).__name__} (raised on every rank; rank 0 prints the traceback): {exc}")
                return
            mine = f"{self.rank}|{_summary(exc)}"
            current = self.store.compare_set("abort", "", mine).decode(errors="replace")
            if current != mine:
                failed_rank, _, error = current.partition("|")
                note = f"{type(exc).__name__} here is a consequence of rank {failed_rank} failing first with {error}."
                _mark(exc, note)
                return
            self._report(exc)
            deadline = time.monotonic() + ACK_WAIT_S
            while time.monotonic() < deadline:
                if int(self.store.add("acks", 0)) + int(self.store.add("failing", 0)) >= self.world_size:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is unreachable: its host died first; keep the traceback
            pass

    def _report(self, exc: BaseException) -> None:
        """Print the traceback now, in torch's per-rank format: once the peers have ended, a launcher (torchrun's
        agent, ``srun --kill-on-bad-exit``) may kill this process before Python would print it at exit."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n")
        sys.stderr.write("\n".join(f"[rank{self.rank}]: {line}" for line in text.split("\n")) + "\n")
        sys.stderr.flush()
        _mark(exc, f"{_summary(exc)} (the traceback above, printed when it was raised)")

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
            " `lightning_fsdp.resilience.SafeOnExceptionCheckpoint` to save on exception when possible."
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
        if exc is not None and not getattr(exc, _NOTE_ATTR, None):
            self._report(exc)
        self._exit(
            f"still shutting down {SHUTDOWN_DEADLINE_S:g} s after the failure (probably blocked in a collective"
            " in an on_exception hook or in teardown); ending now."
        )

    # Lightning's launcher: rank 0 is the parent of the other local ranks ------------------------------------------
    def watch_children(self, children: list[subprocess.Popen]) -> None:
        """Replace Lightning's child observer: same backstop (kill all if a child died), but it lets the store
        protocol end things cleanly first and never treats a preemption exit as a failure."""
        self._children = children
        if not self._reaper_registered:
            atexit.register(self._reap_at_exit)
            self._reaper_registered = True
        threading.Thread(target=self._observe_children, name="lightning-fsdp-child-observer", daemon=True).start()

    def _observe_children(self) -> None:
        while True:
            time.sleep(0.5)
            codes = [p.poll() for p in self._children]
            if all(c is not None for c in codes) and all(c in (0, PREEMPTED_EXIT_CODE) for c in codes):
                return
            failed = [(i + 1, c) for i, c in enumerate(codes) if c not in (None, 0, PREEMPTED_EXIT_CODE)]
            if not failed or self.handling is not None:
                continue
            time.sleep(CHILD_FAIL_GRACE_S)  # normally the store protocol has ended this process by now
            if self.handling is not None:
                continue
            local_rank, code = failed[0]
            self._exit(f"local rank {local_rank} exited with code {code} without reporting an error; ending all ranks.")

    def reap_children(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for spawned ranks to exit, then kill those still running (no orphans)."""
        deadline = time.monotonic() + wait_s
        for p in self._children:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _reap_at_exit(self) -> None:
        if self.handling is None and not self.preempted:
            return  # normal exit: Lightning's behaviour (children finish on their own)
        self.reap_children(REAP_WAIT_S)
        clean = (0, PREEMPTED_EXIT_CODE)
        bad = [(i + 1, p.returncode) for i, p in enumerate(self._children) if p.returncode not in clean]
        if self.handling is None and bad:
            _say(f"local ranks {bad} did not exit cleanly after the preemption save.", self.rank)
            os._exit(1)


class ResilientLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, plus: a rank's exception is reported to every rank before any hook runs, and
    rank 0 reaps the ranks it spawned. Used for torchrun/SLURM too (then it spawns nothing)."""

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, guard: FailureGuard
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._guard = guard

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._guard.watch_children(self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as exc:
            self._guard.on_exception(exc)
            raise


class SafeOnExceptionCheckpoint(OnExceptionCheckpoint):
    """``OnExceptionCheckpoint`` that never hangs: it saves only when every rank failed together (e.g. the same
    error everywhere, Ctrl+C); when one rank failed alone the others are mid-collective and the save is skipped
    with a message. Preemption already saved to ``last``, so it is not saved again here."""

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        exception = args[1] if len(args) > 1 else kwargs.get("exception")
        if isinstance(exception, Preempted):
            return
        try:
            super().on_exception(trainer, *args, **kwargs)
        except PartialFailureError as err:
            _say(f"on-exception checkpoint not saved: {err}")


# -- preemption -------------------------------------------------------------------------------------------------------
class Preemption:
    """SIGTERM / SIGUSR1 set a flag (no collective in a signal handler); the ranks agree on it at step boundaries."""

    def __init__(self, failing: Callable[[], bool] = lambda: False) -> None:
        self.requested: int = 0
        self._previous: dict[int, Any] = {}
        self._failing = failing  # a rank already ending after an error (e.g. torchrun's SIGTERM to it) saves nothing

    def install(self, signals: Iterable[int]) -> None:
        """Take over ``signals`` (after Lightning registered its handlers, whose SIGTERM handler would run a
        broadcast on the signalled rank only). Main thread only; idempotent."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signals:
            if signum in self._previous:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self._failing():
            return
        if not self.requested:
            _say(f"received {signal.Signals(signum).name}: saving a checkpoint after the current step, then exiting.")
        self.requested = signum

    def agree(self, device: torch.device) -> int:
        """All ranks: the largest signal number any rank received (0: none). One tiny all-reduce."""
        import torch.distributed as dist

        flag = torch.tensor([self.requested], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


_PREEMPTION: Optional[Preemption] = None


def preemption_requested() -> bool:
    """Whether this process received a preemption signal (SIGTERM/SIGUSR1) that training has not yet acted on.

    Long loops inside a step (e.g. generation) may poll it to return early; the save happens at the step's end.
    """
    return bool(_PREEMPTION is not None and _PREEMPTION.requested)


def _requeue_at_exit() -> None:
    """Requeue as the process's last act: SLURM answers a requeue by sending SIGTERM to the job, which is then
    ignored, so this rank still ends with ``PREEMPTED_EXIT_CODE`` rather than "terminated"."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _requeue_slurm_job()


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this job, as Lightning's own SLURM handler does."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        _say("scontrol not found: the job is not requeued (requeue it from the batch script on exit code 75).")
        return
    _say(f"requeued SLURM job {job_id}" if result == 0 else f"`scontrol requeue {job_id}` failed with {result}")


# -- non-finite steps -------------------------------------------------------------------------------------------------
class NonFiniteGuard:
    """Skip an optimizer step on every rank when any rank's loss, or the global gradient norm, is NaN/inf."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0

    def wrap(
        self,
        closure: Callable[[], Any],
        optimizer: torch.optim.Optimizer,
        trainer: Optional[pl.Trainer],
        check_grads: bool,
    ) -> Callable[[], Any]:
        """The closure Lightning passes to ``optimizer.step``: forward+backward, then the agreed check.

        Grads are set to ``None`` on a skip: torch optimizers then leave those parameters (and their state, e.g.
        Adam's step count and moments) untouched, unlike zero gradients, which still decay and move momentum.
        """

        def guarded() -> Any:
            loss = closure()
            self.check(loss, optimizer, trainer, check_grads)
            return loss

        return guarded

    def check(
        self, loss: Any, optimizer: torch.optim.Optimizer, trainer: Optional[pl.Trainer], check_grads: bool
    ) -> bool:
        """Returns True if the step was skipped. Collective: every rank calls it at the same step."""
        import torch.distributed as dist

        from lightning_fsdp.precision import total_grad_norm

        params = [p for group in optimizer.param_groups for p in group["params"]]
        local_bad = isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all())
        norm = total_grad_norm(params) if check_grads else torch.tensor(0.0)
        # the communication device (params may be CPU-offloaded while the backend is nccl)
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        flags = torch.tensor([float(local_bad), 0.0 if torch.isfinite(norm) else 1.0], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_bad, norm_bad = bool(flags[0] > 0), bool(flags[1] > 0)
        if not (loss_bad or norm_bad):
            self.consecutive = 0
            return False
        optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.consecutive += 1
        step = trainer.global_step if trainer is not None else -1
        parts = (("loss is NaN/inf on at least one rank", loss_bad), (f"grad norm = {float(norm)}", norm_bad))
        detail = ", ".join(part for part, bad in parts if bad)
        if _rank() == 0:
            _say(f"skipped optimizer step at global step {step} on every rank: {detail} (so far: {self.skipped})")
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepsError(nonfinite_message(self.consecutive, self.max_consecutive, step, detail))
        return True


# -- uneven data ------------------------------------------------------------------------------------------------------
def check_equal_batches(stage: str, count: Any) -> None:
    """All ranks: raise :class:`UnevenBatchesError` on every rank if their batch counts for ``stage`` differ."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    normalized = _normalize_count(count)
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, normalized)
    message = uneven_batches_message(stage, counts)
    if message is not None:
        raise UnevenBatchesError(message)


def _normalize_count(count: Any) -> Any:
    if isinstance(count, (list, tuple)):
        return [_normalize_count(c) for c in count]
    return -1 if count is None or count == float("inf") else int(count)


class AgreedLoader:
    """Wraps a rank's dataloader: resumable mid-epoch, and, without a length, agreed batch by batch.

    - ``state_dict``/``load_state_dict`` record how many batches of the epoch were trained on, so a run resumed
      from a mid-epoch checkpoint (e.g. a preemption save) fast-forwards past them and continues with the same
      batches it would have seen; Lightning otherwise restarts the epoch from its first batch. Fast-forwarding
      reads and discards those batches. A loader that is already resumable keeps its own state.
    - A loader without ``__len__`` (an iterable dataset) cannot be compared up front: before each batch every rank
      all-reduces "I have one", so a rank that runs out is seen by all at once (:class:`UnevenBatchesError`).
    """

    _OWN = ("_loader", "_progress", "_skip", "_device", "_stage")

    def __init__(
        self, loader: Any, progress: Callable[[], tuple[int, Any]], device: torch.device, stage: str = "training"
    ) -> None:
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_progress", progress)
        object.__setattr__(self, "_skip", 0)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_stage", stage)

    @property
    def wrapped(self) -> Any:
        return self._loader

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)  # e.g. Lightning's worker_init_fn

    def _sized(self) -> bool:
        try:
            len(self._loader)
        except (TypeError, NotImplementedError):
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Generator[Any, None, None]:
        # a generator: the wrapped iterator (and its sampler) is created at the first `next`, after Lightning has
        # called `set_epoch` on the sampler, exactly as with a plain DataLoader
        skip, self._skip = self._skip, 0
        iterator = iter(self._loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                return
        agree = not self._sized()
        count = skip
        for batch in iterator:
            if agree:
                self._agree(True, count)
            count += 1
            yield batch
        if agree:
            self._agree(False, count)

    def _agree(self, has_batch: bool, count: int) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        flags = torch.tensor([float(has_batch), -float(has_batch)], device=self._device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        lowest, highest = float(flags[0]), -float(flags[1])
        if lowest != highest:
            raise UnevenBatchesError(
                f"Ranks ran out of {self._stage} batches at different times: after {count} batches of this epoch some"
                f" ranks have another and some do not (this rank {'does' if has_batch else 'does not'}). {_UNEVEN_FIX}"
            )

    def state_dict(self) -> dict[str, Any]:
        if _is_stateful(self._loader):
            return {"wrapped": self._loader.state_dict()}
        done, total = self._progress()
        exhausted = total is not None and total != float("inf") and done >= total
        return {"batches_done": 0 if exhausted else int(done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "wrapped" in state and _is_stateful(self._loader):
            self._loader.load_state_dict(state["wrapped"])
        else:
            self._skip = int(state.get("batches_done", 0))


_END = object()


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


# -- the facade the strategy delegates to -----------------------------------------------------------------------------
class Resilience:
    """Everything :class:`~lightning_fsdp.strategy.FSDPCustomStrategy` delegates about failures, in one object."""

    def __init__(self, timeout: timedelta, skip_nonfinite_steps: bool, max_nonfinite_steps: int) -> None:
        global _PREEMPTION
        self.timeout = timeout
        self.guard = FailureGuard()
        self.preemption = Preemption(failing=lambda: self.guard.handling is not None)
        _PREEMPTION = self.preemption
        self.nonfinite = NonFiniteGuard(max_nonfinite_steps) if skip_nonfinite_steps else None

    @property
    def failing(self) -> bool:
        """This rank is handling its own exception (collectives and group teardown could wait on peers)."""
        return self.guard.handling is not None

    def make_launcher(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int
    ) -> ResilientLauncher:
        return ResilientLauncher(cluster_environment, num_processes, num_nodes, self.guard)

    @property
    def rendezvous_timeout(self) -> timedelta:
        """How long ranks may take to *join* the process group: at least PyTorch's 30-minute default, so that a
        short collective ``timeout`` (to detect hangs early) does not fail a job whose processes start slowly."""
        return max(self.timeout, timedelta(minutes=30))

    def start(self, mesh: Optional[DeviceMesh]) -> None:
        """After the process group and mesh exist: give every group the collective timeout, start watching."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        apply_timeout(dist.group.WORLD, mesh, self.timeout)
        self.guard.start(dist.get_rank(), dist.get_world_size())

    def attach(self, trainer: pl.Trainer) -> None:
        """Add the callback that runs the step-boundary agreements (once per Trainer)."""
        if not any(isinstance(cb, _ResilienceCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(_ResilienceCallback(self))

    def teardown(self) -> None:
        self.preemption.uninstall()
        self.guard.finish()

    def process_dataloader(self, dataloader: Any, trainer: Optional[pl.Trainer], device: torch.device) -> Any:
        if isinstance(dataloader, AgreedLoader) or trainer is None:
            return dataloader

        def progress() -> tuple[int, Any]:
            return trainer.fit_loop.epoch_loop.batch_progress.current.processed, trainer.num_training_batches

        stage = trainer.state.stage
        names = {"train": "training", "val": "validation", "test": "test", "predict": "predict"}
        name = names.get(getattr(stage, "dataloader_prefix", None) or "", "training")
        return AgreedLoader(dataloader, progress, device, stage=name)

    @contextmanager
    def named(self, operation: str) -> Generator[None, None, None]:
        """Re-raise a collective timeout inside the block as :class:`CollectiveTimeoutError` naming ``operation``."""
        try:
            yield
        except (CollectiveTimeoutError, PartialFailureError, AgreedError):
            raise
        except Exception as err:  # noqa: BLE001 - only timeouts are translated; everything else passes unchanged
            if is_timeout_error(err):
                raise CollectiveTimeoutError(timeout_message(operation, _rank(), self.timeout, err)) from err
            raise

    def gate(self, operation: str) -> None:
        self.guard.gate(operation)

    def wrap_closure(
        self, closure: Callable[[], Any], optimizer: Any, trainer: Optional[pl.Trainer], has_scaler: bool
    ) -> Callable[[], Any]:
        """With a loss scaler (16-mixed), inf gradients are expected and the scaler skips those steps itself: only
        the loss is checked then."""
        if self.nonfinite is None:
            return closure
        return self.nonfinite.wrap(closure, optimizer, trainer, check_grads=not has_scaler)


def apply_timeout(world: Any, mesh: Optional[DeviceMesh], timeout: timedelta) -> None:
    """Give the default group and every mesh dimension's group the configured timeout. ``init_device_mesh``
    creates HSDP's sub-groups with PyTorch's 30-minute default, whatever the default group's timeout is."""
    groups = [world] + ([mesh.get_group(dim) for dim in range(mesh.ndim)] if mesh is not None else [])
    for group in groups:
        if hasattr(group, "set_timeout"):
            group.set_timeout(timeout)


class _ResilienceCallback(Callback):
    """Step- and epoch-boundary agreements, added by the strategy. Every rank runs each hook at the same point."""

    def __init__(self, resilience: Resilience) -> None:
        self.resilience = resilience
        self._last_step = -1

    @property
    @override
    def state_key(self) -> str:
        return "lightning_fsdp.resilience"

    def _signals(self, trainer: pl.Trainer) -> list[int]:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        signals = [signal.SIGTERM, signal.SIGUSR1]
        env = trainer.strategy.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            signals.append(int(env.requeue_signal))
        return sorted(set(int(s) for s in signals))

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resilience.preemption.install(self._signals(trainer))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resilience.preemption.install(self._signals(trainer))
        self._last_step = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("training", trainer.num_training_batches)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        check_equal_batches("validation", counts)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("test", trainer.num_test_batches)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_equal_batches("predict", trainer.num_predict_batches)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self.resilience.nonfinite
        if guard is not None:
            pl_module.log("nonfinite_steps_skipped", float(guard.skipped), on_step=True, on_epoch=False, prog_bar=False)
        if trainer.global_step == self._last_step:
            return  # mid-accumulation: stop only at an optimizer-step boundary
        self._last_step = trainer.global_step
        signum = self.resilience.preemption.agree(trainer.strategy.root_device)
        if signum:
            self._save_and_exit(trainer, signum)

    def _save_and_exit(self, trainer: pl.Trainer, signum: int) -> None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        name = signal.Signals(signum).name
        path = last_checkpoint_path(trainer)
        if path is None:
            rank_zero_warn(
                f"Preempted by {name}, but no ModelCheckpoint with a directory is configured: nothing was saved."
                " Add `ModelCheckpoint(dirpath=..., save_last=True)` to resume with `ckpt_path='last'`."
            )
        else:
            for cb in trainer.checkpoint_callbacks:  # before saving: the saved callback state then owns `last`
                if isinstance(cb, ModelCheckpoint) and cb.dirpath and path.startswith(str(cb.dirpath)):
                    cb.last_model_path = path
            trainer.save_checkpoint(path, weights_only=False)
        self.resilience.preemption.requested = 0
        env = trainer.strategy.cluster_environment
        if trainer.is_global_zero and isinstance(env, SLURMEnvironment) and env.auto_requeue:
            atexit.register(_requeue_at_exit)
        message = (
            f"preempted by {name} at global step {trainer.global_step}: checkpoint saved to {path}; exiting with"
            f" {PREEMPTED_EXIT_CODE} so the job is requeued; resume with ckpt_path='last'."
        )
        _say(message)
        raise Preempted(message)
