"""A rank spawned by Lightning's launcher watches the rank that spawned it (local rank 0 of its node).

When that process dies without a word (SIGKILL from the OOM killer leaves no traceback and no abort record, and on
rank 0 it takes the rendezvous store with it), this rank learns it at once from a pidfd, without waiting for a store
that is gone, and says which rank stopped and how. How is read from the kernel: from the zombie's
``/proc/<pid>/stat`` (field 52, ``exit_code``, Linux >= 3.5) while its own parent has not reaped it yet, else from the
pidfd's exit information (``PIDFD_GET_INFO``, Linux >= 6.15), which outlives the reaping. Without either, the message
says that how it ended is not known. Nothing here raises: a watch that cannot be set up is simply not there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import threading
import time
from collections.abc import Iterator
from typing import Callable, Optional

from lightning_fsdp.resilience.report import death

#: ``"pid:rank"`` of the process starting the local ranks, in their environment only while it starts them: a rank
#: whose parent has that pid knows its parent is that rank (not a user's shell, torchrun's agent or slurmstepd).
LAUNCHER_ENV = "LIGHTNING_FSDP_LAUNCHER"
_STATUS_WAIT_S = 0.2  # how long to keep trying to read the exit status once the parent is gone
_PPID_POLL_S = 0.1  # without a pidfd: how often to compare the parent pid

# <linux/pidfd.h>: ioctl(pidfd, PIDFD_GET_INFO, struct pidfd_info) with PIDFD_INFO_EXIT; the first 64 bytes of the
# struct (PIDFD_INFO_SIZE_VER0) hold ``mask`` at offset 0 and ``exit_code`` (a wait status) at offset 60
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, ...)


@contextlib.contextmanager
def launching(rank: int) -> Iterator[None]:
    """Around starting the local ranks: they inherit this process's pid and global ``rank`` in their environment."""
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{rank}"
    try:
        yield
    finally:
        os.environ.pop(LAUNCHER_ENV, None)


def launching_rank() -> Optional[tuple[int, int]]:
    """``(pid, global rank)`` of the rank that started this process, or ``None`` if its parent is not a rank."""
    pid, _, rank = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not (pid.isdigit() and rank.isdigit()) or int(pid) != os.getppid():
        return None
    return int(pid), int(rank)


def _stat_fields(pid: int) -> Optional[list[str]]:
    """``/proc/<pid>/stat`` from field 3 (``state``) on: index ``i`` is field ``i + 3``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        return text[text.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _returncode(status: int) -> Optional[int]:
    """A wait status as ``Popen.returncode`` gives it (negative: the signal that killed the process)."""
    try:
        return os.waitstatus_to_exitcode(status)
    except ValueError:
        return None


class ParentWatch:
    """Calls ``on_death(sentence)`` once, from its own thread, when the parent process ``pid`` (``rank``) ends."""

    def __init__(self, pid: int, rank: int, on_death: Callable[[str], None]) -> None:
        self.pid, self.rank = pid, rank
        self._on_death = on_death
        fields = _stat_fields(pid)
        self._starttime = fields[19] if fields and len(fields) > 19 else None  # field 22: tells a reused pid apart
        self._fd: Optional[int] = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfd before Linux 5.3: compare the parent pid
            self._fd = os.pidfd_open(pid)
        self._lock = threading.Lock()
        self._sentence: Optional[str] = None
        threading.Thread(target=self._watch, name="lightning-fsdp-parent-watch", daemon=True).start()

    def ended(self) -> Optional[str]:
        """The sentence saying how the parent ended, once it has; ``None`` while it runs. Does not block."""
        if self._sentence is None and self._gone(block=False):
            self._conclude()
        return self._sentence

    def _watch(self) -> None:
        try:
            self._gone(block=True)
            self._conclude()
            assert self._sentence is not None
            self._on_death(self._sentence)
        except Exception:  # noqa: BLE001 - a watch that fails must not take the rank with it
            pass

    def _gone(self, block: bool) -> bool:
        if self._fd is not None:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            while True:
                if poller.poll(None if block else 0):
                    return True
                if not block:
                    return False
        while os.getppid() == self.pid:  # reparented: the parent died
            if not block:
                return False
            time.sleep(_PPID_POLL_S)
        return True

    def _conclude(self) -> None:
        with self._lock:
            if self._sentence is None:
                who = f"rank {self.rank} (pid {self.pid}, the launching process)"
                self._sentence = death(who, self._exit_code())

    def _exit_code(self) -> Optional[int]:
        deadline = time.monotonic() + _STATUS_WAIT_S
        while True:
            fields = _stat_fields(self.pid)
            if fields and fields[0] == "Z" and len(fields) > 49 and fields[19] == self._starttime:
                return _returncode(int(fields[49]))  # field 52: the zombie's exit status
            status = self._pidfd_status()
            if status is not None or time.monotonic() > deadline:
                return status
            time.sleep(0.01)

    def _pidfd_status(self) -> Optional[int]:
        if self._fd is None:
            return None
        buf = bytearray(_PIDFD_INFO_SIZE)
        struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(self._fd, _PIDFD_GET_INFO, buf, True)
        except OSError:  # before Linux 6.15, or not reaped yet on some kernels
            return None
        (mask,) = struct.unpack_from("=Q", buf, 0)
        (status,) = struct.unpack_from("=i", buf, 60)
        return _returncode(status) if mask & _PIDFD_INFO_EXIT else None
