"""Launching ``ckpt_train.py`` jobs from the checkpoint tests (each job gets its own rendezvous port)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from tests.helpers.launch import REPO, child_env

SCRIPT = REPO / "tests" / "scripts" / "ckpt_train.py"

#: the global batch every world size shares (12 = 1×12 = 2×6 = 3×4 = 4×3) and the data set size (4 steps/epoch)
GLOBAL_BATCH = 12
N_SAMPLES = 48


def write_spec(spec: dict[str, Any], tmp_path: Path, name: str) -> Path:
    spec = {"data": {"n": N_SAMPLES}, **spec, "root_dir": str(tmp_path)}
    spec.setdefault("batch_size", GLOBAL_BATCH // spec.get("devices", 2))
    spec.setdefault("out", str(tmp_path / f"{name}.json"))
    path = tmp_path / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    return path


def job(
    spec: dict[str, Any],
    tmp_path: Path,
    name: str,
    *,
    timeout: float = 180,
    check: bool = True,
    env: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Run one job to completion; returns rank 0's result (``params`` loaded) and the process (``proc``)."""
    spec_path = write_spec(spec, tmp_path, name)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"job {name!r} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
        )
    result: dict[str, Any] = {"proc": proc}
    out = Path(json.loads(spec_path.read_text())["out"])
    if out.exists() and proc.returncode == 0:
        result.update(json.loads(out.read_text()))
        result["params"] = torch.load(result["params_path"], weights_only=True)
    return result


def start(spec: dict[str, Any], tmp_path: Path, name: str, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start a job in its own session (so the test can end every rank); stdout/stderr go to files."""
    spec_path = write_spec(spec, tmp_path, name)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(spec_path)],
        stdout=open(tmp_path / f"{name}.stdout", "w"),
        stderr=open(tmp_path / f"{name}.stderr", "w"),
        env=child_env(env),
        cwd=REPO,
        start_new_session=True,
    )


def wait_for(condition: Callable[[], Any], timeout: float, what: str, proc: Optional[subprocess.Popen] = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def end_session(proc: subprocess.Popen, timeout: float = 60) -> int:
    """Wait for the job; if it does not end in time, kill its whole session. Returns the exit code."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def errors_by_rank(error_dir: Path) -> dict[int, str]:
    return {int(p.stem.removeprefix("rank")): p.read_text() for p in sorted(Path(error_dir).glob("rank*.txt"))}
