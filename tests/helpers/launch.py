"""Run test scripts in fresh processes: Lightning's launcher or torchrun starts the other ranks for real."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"


def free_port() -> int:
    """A free rendezvous port. Under pytest-xdist each worker draws from its own range below the kernel's ephemeral
    ports (32768 and up), so parallel jobs never pick the same port and no outgoing connection is given it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = 12000 + 2000 * (int(worker[2:]) % 10)
    for _ in range(100):
        port = random.randrange(low, low + 2000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + 2000}")


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """A clean environment for a child job: its own rendezvous port, one thread per rank, repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "PL_", "SLURM_", "TORCHELASTIC_", "GROUP_RANK"))}
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def run_python(args: list[str], *, timeout: float = 240, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=child_env(env), cwd=cwd or REPO
    )


def train(
    spec: dict[str, Any],
    tmp_path: Path,
    name: str = "run",
    *,
    timeout: float = 240,
    check: bool = True,
    env: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Run ``tests/scripts/train.py`` with ``spec``; returns rank 0's result with the full params loaded."""
    return train_many({name: spec}, tmp_path, timeout=timeout, check=check, env=env)[name]


def train_many(
    specs: dict[str, dict[str, Any]],
    tmp_path: Path,
    *,
    timeout: float = 240,
    check: bool = True,
    env: Optional[dict[str, str]] = None,
) -> dict[str, dict[str, Any]]:
    """Several runs of ``tests/scripts/train.py`` one after another in one process start (single-process runs, or
    one multi-rank run): results by name."""
    full = {name: {**spec, "out": str(tmp_path / f"{name}.json"), "root_dir": str(tmp_path)} for name, spec in specs.items()}
    spec_path = tmp_path / f"{'+'.join(specs)}.spec.json"
    spec_path.write_text(json.dumps(list(full.values()) if len(full) > 1 else next(iter(full.values()))))
    proc = run_python([str(SCRIPTS / "train.py"), str(spec_path)], timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"training runs {list(specs)} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    results = {}
    for name, spec in full.items():
        if not check and not Path(spec["out"]).exists():  # the run failed before writing its result
            results[name] = {"proc": proc}
            continue
        result = json.loads(Path(spec["out"]).read_text())
        result["params"] = torch.load(result["params_path"], weights_only=True)
        result["proc"] = proc
        results[name] = result
    return results
