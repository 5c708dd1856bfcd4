"""Running a model's code for a reward, never inside a training process.

:func:`run_python` runs source text in a fresh Python interpreter (``-I``: no user site, no ``PYTHON*`` variables),
in an empty temporary folder, with a wall-clock timeout and resource limits (address space, CPU seconds, file size,
open files, no core files); its whole process group is killed at the timeout, so a completion that loops, forks,
allocates without end or crashes the interpreter costs at most ``timeout`` seconds and is reported as such. It is
not a security sandbox against a determined attacker (the network and the file system outside the folder stay
reachable): run training on untrusted prompts inside a container.

:func:`code_passes_tests` is a reward function with TRL's signature: 1.0 when a completion's code passes the
``tests`` column's assertions, else 0.0; timeouts and crashes score 0, and each outcome is counted through TRL's
``log_metric`` hook (``code/passed``, ``code/failed``, ``code/timeout``, ``code/crashed``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CodeRun", "code_passes_tests", "extract_code", "run_python"]

OUTCOMES = ("passed", "failed", "timeout", "crashed")
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeRun:
    """How one run ended: ``passed`` (exit 0), ``failed`` (an exception, e.g. a failed assertion), ``timeout``
    (killed at the deadline) or ``crashed`` (killed by a signal or a resource limit)."""

    outcome: str
    seconds: float
    stderr: str = ""


#: what the child interpreter runs first: its own resource limits (``sys.argv[2:]``: address space, CPU seconds),
#: then the code file ``sys.argv[1]`` as ``__main__``. Limits set here, not by a ``preexec_fn``: that runs Python
#: between fork and exec, which can deadlock when the parent has threads (the reward runs completions in a pool)
_BOOTSTRAP = """\
import runpy, sys
try:
    import resource
except ImportError:
    resource = None
code, memory, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if resource is not None:
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 << 20),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # a limit the platform does not allow lowering: keep the others
            pass
sys.argv = [code]
runpy.run_path(code, run_name="__main__")
"""


def run_python(source: str, *, timeout: float = 5.0, memory_bytes: int = 512 << 20) -> CodeRun:
    """Run ``source`` in a separate interpreter with limits; never raises for anything the code does."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_fsdp_code_") as folder:
        path = os.path.join(folder, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        limits = [str(memory_bytes), str(max(1, int(timeout) + 1))]
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, path, *limits], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return CodeRun("timeout", time.perf_counter() - started)
    stderr = err.decode("utf-8", "replace")[-2000:]
    if proc.returncode == 0:
        outcome = "passed"
    elif proc.returncode < 0 or "MemoryError" in stderr or not stderr.strip():
        outcome = "crashed"  # a signal (segfault, CPU limit), or out of memory
    else:
        outcome = "failed"
    return CodeRun(outcome, time.perf_counter() - started, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the code's own children too
    except (ProcessLookupError, PermissionError):
        proc.kill()


def extract_code(completion: Any) -> str:
    """The code in a completion: its last fenced block if it has one, else the whole text (a conversational
    completion's last message's content)."""
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    blocks = _FENCE.findall(str(completion))
    return blocks[-1] if blocks else str(completion)


def code_passes_tests(
    prompts: list[Any], completions: list[Any], tests: list[str], timeout: float = 5.0, workers: int = 2,
    log_metric: Optional[Callable[[str, float], None]] = None, **_: Any,
) -> list[float]:
    """1.0 for each completion whose code, followed by its row's ``tests`` (assert statements), exits cleanly."""
    sources = [f"{extract_code(c)}\n\n{t}\n" for c, t in zip(completions, tests)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        runs = list(pool.map(lambda s: run_python(s, timeout=timeout), sources))
    counts = Counter(run.outcome for run in runs)
    if log_metric is not None:
        for outcome in OUTCOMES:
            log_metric(f"code/{outcome}", float(counts.get(outcome, 0)))
    return [1.0 if run.outcome == "passed" else 0.0 for run in runs]
