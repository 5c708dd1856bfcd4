"""How a failure is shown: one line per rank on stderr, and the original traceback printed once.

A rank that fails for a reason another rank reports in full is *marked*: at exit it prints a one-line note instead
of a second copy of the traceback (:func:`mark`). Installing the excepthook is that mark's side effect, and only
then is ``sys.excepthook`` replaced.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Any, Callable, Optional

from lightning_fsdp.parallel.collectives import launch_rank

_NOTE_ATTR = "_lightning_fsdp_note"
_previous_excepthook = sys.excepthook
_uncaught: list[Callable[[BaseException], None]] = []


def say(message: str, rank: Optional[int] = None) -> None:
    """One line on stderr, flushed at once (the process may end right after)."""
    sys.stderr.write(f"[rank {launch_rank() if rank is None else rank}] {message}\n")
    sys.stderr.flush()


def last_words(message: str, rank: int) -> None:
    """:func:`say` as this process's last line, which it is about to end on. Stdout and stderr point at
    /dev/null first, so that nothing another thread prints meanwhile (a C++ warning about the connection that just
    died, a collective's error) can come after the line that says why the rank ended."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        original = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.write(original, f"[rank {rank}] {message}\n".encode(errors="replace"))
    except (OSError, ValueError):
        say(message, rank)


def how_it_ended(returncode: Optional[int]) -> str:
    """How a process ended, from its ``Popen.returncode`` (negative: the signal that killed it)."""
    if returncode is None:
        return "vanished; how it ended is not known"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"was killed by signal {-returncode}"
    return f"was killed by signal {name} ({-returncode})"


def death(who: str, returncode: Optional[int]) -> str:
    """``who`` ended without reporting an error: one sentence saying how (what a signal usually means)."""
    if returncode is None or returncode >= 0:
        return f"{who} {how_it_ended(returncode)}" + ("" if returncode is None else " without reporting an error")
    hint = " (the OOM killer sends SIGKILL)" if returncode == -signal.SIGKILL else ""
    return f"{who} {how_it_ended(returncode)} without a traceback{hint}"


def summary(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def print_traceback(exc: BaseException, rank: int) -> None:
    """The traceback now, in torch's per-rank format: once the peers have ended, a launcher (torchrun's agent,
    ``srun --kill-on-bad-exit``) may kill this process before Python would print it at exit."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n")
    sys.stderr.write("\n".join(f"[rank{rank}]: {line}" for line in text.split("\n")) + "\n")
    sys.stderr.flush()
    mark(exc, f"{summary(exc)} (the traceback above, printed when it was raised)")


def is_marked(exc: BaseException) -> bool:
    return bool(getattr(exc, _NOTE_ATTR, None))


def mark(exc: BaseException, note: str) -> None:
    """At exit, print ``note`` instead of ``exc``'s traceback (already shown, or shown by another rank)."""
    try:
        setattr(exc, _NOTE_ATTR, note)
    except (AttributeError, TypeError):
        return
    _install_excepthook()


def on_uncaught(callback: Callable[[BaseException], None]) -> None:
    """Run ``callback(exc)`` first when an uncaught exception ends the interpreter: a Fabric script's loop runs after
    its launcher returned, outside any ``try`` of ours, so the failure relay hears of the exception here."""
    if callback not in _uncaught:
        _uncaught.append(callback)
    _install_excepthook()


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    for callback in list(_uncaught):
        try:
            callback(exc)
        except Exception:  # noqa: BLE001 - the exception itself must still be shown
            pass
    note = getattr(exc, _NOTE_ATTR, None)
    if note:
        say(note)
        return
    _previous_excepthook(exc_type, exc, tb)


def _install_excepthook() -> None:
    global _previous_excepthook
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
