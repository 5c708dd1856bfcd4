"""Run failure-injection jobs (``fail_train.py``) in their own session and inspect how they ended.

Every job is started with ``start_new_session=True``: all its processes (the ranks Lightning's launcher spawns,
torchrun's agents and workers) share one session id, so after the job's main process exits, any process still in
that session is an orphan. The tests assert there are none, and measure the time from the injected fault
(written by the failing rank) to the end of the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tests.helpers.launch import REPO, SCRIPTS, child_env, free_port

FAIL_TRAIN = SCRIPTS / "fail_train.py"


@dataclass
class Job:
    """How a job ended: exit codes of its top-level processes, combined output, timings, leftover processes."""

    returncodes: list[int]
    output: str
    started: float
    ended: float
    orphans: list[str] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    fault_time: Optional[float] = None
    last_ended: Optional[float] = None  # when the job's last process ended (a rank can outlive the top process)

    @property
    def seconds_after_fault(self) -> float:
        assert self.fault_time is not None, "the fault never fired:\n" + self.output[-4000:]
        return max(self.ended, self.last_ended or self.ended) - self.fault_time

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.log]

    def count(self, text: str) -> int:
        return self.output.count(text)


def session_processes(sid: int) -> list[str]:
    """``pid cmdline`` of every live (non-zombie) process whose session id is ``sid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            state, session = fields[0], int(fields[3])
            if session == sid and state != "Z":
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"{entry.name} {cmd}")
        except (OSError, ValueError, IndexError):
            continue
    return found


def _orphans_after(sids: list[int], grace: float = 3.0) -> tuple[list[str], Optional[float]]:
    """Processes still in the sessions ``grace`` s after the top-level ones ended, and when the last one ended."""
    deadline = time.monotonic() + grace
    while True:
        left = [p for sid in sids for p in session_processes(sid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for sid in sids:  # never leave anything behind, whatever the assertion says
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return left, (None if left else time.time())


def write_spec(spec: dict[str, Any], tmp_path: Path, name: str) -> tuple[Path, dict[str, Any]]:
    spec = {
        **spec,
        "log": str(tmp_path / f"{name}.log.jsonl"),
        "root_dir": str(tmp_path),
        "done": str(tmp_path / f"{name}.done.json"),
    }
    if "inject" in spec:
        spec["inject"] = {**spec["inject"], "stamp": str(tmp_path / f"{name}.fault")}
    path = tmp_path / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    return path, spec


def _finish(procs: list[subprocess.Popen], started: float, timeout: float, spec: dict[str, Any], logs: list[Path]) -> Job:
    sids = [p.pid for p in procs]
    ended = started
    try:
        for p in procs:
            p.wait(timeout=max(1.0, started + timeout - time.time()))
            ended = max(ended, time.time())
    except subprocess.TimeoutExpired:
        _orphans_after(sids, grace=0)
        outputs = "\n".join(Path(f).read_text(errors="replace")[-6000:] for f in logs)
        raise AssertionError(f"job did not end within {timeout} s (it hangs):\n{outputs}") from None
    orphans, last_ended = _orphans_after(sids)
    output = "\n".join(Path(f).read_text(errors="replace") for f in logs)
    log_path = Path(spec["log"])
    rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    stamp = Path(spec.get("inject", {}).get("stamp", "/nonexistent"))
    fault = float(stamp.read_text()) if stamp.exists() else None
    return Job([p.returncode for p in procs], output, started, ended, orphans, rows, fault, last_ended)


def run_lightning(spec: dict[str, Any], tmp_path: Path, name: str, *, timeout: float = 240, on_start=None) -> Job:
    """``python fail_train.py`` with ``devices=N``: rank 0 is this process's child and spawns the other ranks."""
    spec_path, spec = write_spec(spec, tmp_path, name)
    out = tmp_path / f"{name}.out"
    with open(out, "w") as f:
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(FAIL_TRAIN), str(spec_path)],
            stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO, start_new_session=True,
        )
        if on_start is not None:
            on_start(proc, spec)
        return _finish([proc], started, timeout, spec, [out])


def run_torchrun(
    spec: dict[str, Any], tmp_path: Path, name: str, *, nnodes: int = 1, nproc_per_node: int = 2, timeout: float = 240,
    script: Path = FAIL_TRAIN, extra_env: Optional[dict[str, str]] = None,
) -> Job:
    """``torchrun`` once per "node", all on this machine over loopback, with c10d rendezvous."""
    spec_path, spec = write_spec(spec, tmp_path, name)
    port = free_port()
    procs, outs = [], []
    started = time.time()
    for node in range(nnodes):
        out = tmp_path / f"{name}.node{node}.out"
        outs.append(out)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
            "--max-restarts=0", "--monitor-interval=0.5",
            str(script), str(spec_path),
        ]
        with open(out, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(extra_env), cwd=REPO, start_new_session=True))
    return _finish(procs, started, timeout, spec, outs)
