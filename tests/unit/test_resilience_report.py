"""How a rank that died without a traceback is described: the exit-status wording, and a spawned rank reading how
the rank that spawned it ended (real processes: the kernel is what is being read)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fsdp.resilience.parent import LAUNCHER_ENV
from lightning_fsdp.resilience.report import death, how_it_ended
from tests.helpers.launch import REPO, child_env


@pytest.mark.parametrize(
    ("code", "how"),
    [
        (0, "exited with code 0"),
        (1, "exited with code 1"),
        (75, "exited with code 75"),
        (-9, "was killed by signal SIGKILL (9)"),
        (-15, "was killed by signal SIGTERM (15)"),
        (-200, "was killed by signal 200"),
        (None, "vanished; how it ended is not known"),
    ],
)
def test_how_a_process_ended(code, how):
    assert how_it_ended(code) == how


def test_death_sentences_name_the_process_and_what_a_signal_means():
    who = "rank 1 (pid 1234)"
    assert death(who, -9) == (
        "rank 1 (pid 1234) was killed by signal SIGKILL (9) without a traceback (the OOM killer sends SIGKILL)"
    )
    assert death(who, -11) == "rank 1 (pid 1234) was killed by signal SIGSEGV (11) without a traceback"
    assert death(who, 3) == "rank 1 (pid 1234) exited with code 3 without reporting an error"
    assert death(who, None) == "rank 1 (pid 1234) vanished; how it ended is not known"


_CHILD = """
import os, sys, threading
from pathlib import Path
from lightning_fsdp.resilience.parent import ParentWatch, launching_rank
pid, rank = launching_rank()
told = threading.Event()
def on_death(sentence):
    Path(sys.argv[1] + ".tmp").write_text(sentence)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    told.set()
ParentWatch(pid, rank, on_death=on_death)
Path(sys.argv[2]).write_text("watching")
told.wait(60)
"""

_PARENT = f"""
import os, signal, subprocess, sys, time
from pathlib import Path
env = {{**os.environ, "{LAUNCHER_ENV}": f"{{os.getpid()}}:0"}}  # what launching(0) gives the ranks it starts
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], env=env)
while not Path(sys.argv[3]).exists():
    time.sleep(0.02)
if sys.argv[4] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(int(sys.argv[4]))
"""


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        return tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


@pytest.mark.parametrize(
    ("how", "reaped_at_once", "expected"),
    [
        ("sigkill", True, "was killed by signal SIGKILL (9) without a traceback"),
        ("3", False, "exited with code 3 without reporting an error"),
    ],
    ids=["killed-and-reaped-at-once", "exited-and-left-a-zombie"],
)
def test_a_spawned_rank_reads_how_its_launching_rank_ended(tmp_path, how, reaped_at_once, expected):
    """Reaped at once, only the pidfd's exit information (Linux >= 6.15) still knows the status; left a zombie
    (its parent still reads the pipes), ``/proc/<pid>/stat`` does."""
    out, ready = tmp_path / "sentence", tmp_path / "ready"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD, str(out), str(ready), how], env=child_env(), cwd=REPO,
        start_new_session=True,
    )
    try:
        if reaped_at_once:
            parent.wait(timeout=120)
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert out.exists(), "the spawned process never said that its parent ended"
        sentence = out.read_text()
        assert sentence.startswith(f"rank 0 (pid {parent.pid}, the launching process) "), sentence
        if reaped_at_once and not _kernel_at_least(6, 15):  # the zombie may be gone before it is read
            assert expected in sentence or "how it ended is not known" in sentence, sentence
        else:
            assert expected in sentence, sentence
    finally:
        parent.wait(timeout=120)
        try:
            os.killpg(parent.pid, 9)
        except ProcessLookupError:
            pass
