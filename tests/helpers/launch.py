"""Run test scripts in fresh processes: Lightning's launcher or torchrun starts the other ranks for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def train(spec: dict[str, Any], tmp_path: Path, name: str = "run", *, timeout: float = 240, check: bool = True) -> dict[str, Any]:
    """Run ``tests/scripts/train.py`` with ``spec``; returns rank 0's result with the full params loaded."""
    spec = {**spec, "out": str(tmp_path / f"{name}.json"), "root_dir": str(tmp_path)}
    spec_path = tmp_path / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = run_python([str(SCRIPTS / "train.py"), str(spec_path)], timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training run {name!r} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    result = json.loads(Path(spec["out"]).read_text())
    result["params"] = torch.load(result["params_path"], weights_only=True)
    result["proc"] = proc
    return result
