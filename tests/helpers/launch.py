"""Run test scripts in fresh processes: Lightning's launcher or torchrun starts the other ranks for real."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
        "PYTHONFAULTHANDLER": "1",  # a rank that dies in C++ (an abort, a segfault) still prints its Python stack
    })
    env.update(extra or {})
    return env


def first_errors(stderr: str, per_rank: int = 1500) -> str:
    """Each rank's first traceback, so a failure names the rank that failed first rather than the peers it took down
    (whose connection errors fill the end of the log)."""
    blocks: dict[str, str] = {}
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line and "Fatal Python error" not in line:
            continue
        fatal = "Fatal Python error" in line  # faulthandler's report: the error, then each thread's stack
        prefix = line.split("Fatal" if fatal else "Traceback")[0]
        if prefix in blocks:
            continue
        if fatal:
            blocks[prefix] = "\n".join(lines[i:i + 30])[:per_rank]
            continue
        block = [l for l in lines[i:i + 80] if l.startswith(prefix)]
        end = next((j for j, l in enumerate(block[1:], 1) if not l[len(prefix):].startswith(" ")), len(block) - 1)
        text = "\n".join(l for l in block[:end + 1] if l[len(prefix):].strip(" ^"))
        blocks[prefix] = text if len(text) <= per_rank else f"{text[:per_rank // 2]}\n...\n{text[-per_rank // 2:]}"
    return "--- first traceback per rank ---\n" + "\n".join(blocks.values()) if blocks else ""


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
    spec_path.with_suffix(".stderr.txt").write_text(proc.stderr)  # whole, beside the run, for a failure's post-mortem
    if check and proc.returncode != 0:
        raise AssertionError(f"training runs {list(specs)} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{first_errors(proc.stderr)}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
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


@contextmanager
def one_rank_gloo_mesh() -> Iterator[Any]:
    """A 1-rank gloo process group in this process and its CPU mesh (skips the test where one exists already)."""
    import tempfile

    import pytest
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()
