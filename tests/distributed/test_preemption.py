"""Preemption: a SIGTERM to one rank mid-epoch → every rank finishes the step, saves ``last``, exits for requeue;
the next start with ``ckpt_path="last"`` continues exactly where the uninterrupted run would have been.

Also the node-loss recovery path: a checkpoint saved at 4 ranks resumes at 2 (resharded on load).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lightning_fsdp.resilience import PREEMPTED_EXIT_CODE
from tests.scripts.fail_jobs import run_lightning

STEPS = 12  # 8 steps per epoch (64 samples, global batch 8): the signal lands in epoch 0, the run ends in epoch 1


def _spec(tmp_path: Path, devices: int = 2, **extra):
    return {
        "devices": devices,
        "batch_size": 8 // devices,
        "max_steps": STEPS,
        "record_params": True,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        **extra,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted-and-resumed run must reproduce."""
    path = tmp_path_factory.mktemp("reference")
    job = run_lightning(_spec(path), path, "ref")
    assert job.returncodes == [0], job.output[-4000:]
    assert [r["step"] for r in job.log] == list(range(1, STEPS + 1))
    return job


def _send_signal_when_ready(signum: int):
    """The faulty rank writes its pid when it is inside a step; the signal then arrives mid-step, from outside."""

    def on_start(proc, spec):
        marker = Path(spec["inject"]["marker"])
        deadline = time.monotonic() + 120
        while not marker.exists() or not marker.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signum)

    return on_start


def assert_same_run(rows, reference_rows):
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor([r["loss"] for r in reference_rows]))
    torch.testing.assert_close(torch.tensor(rows[-1]["params"]), torch.tensor(reference_rows[-1]["params"]))


@pytest.mark.parametrize(
    ("signum", "rank"),
    [(signal.SIGTERM, 1), pytest.param(signal.SIGUSR1, 0, marks=pytest.mark.slow)],
    ids=["sigterm-rank1", "sigusr1-rank0"],
)
def test_signal_to_one_rank_saves_and_resume_reproduces_the_run(tmp_path, reference, signum, rank):
    run = tmp_path / "run"
    marker = str(_mkdir(run) / "pid")
    inject = {"kind": "wait_signal", "rank": rank, "step": 3, "marker": marker}
    first = run_lightning(_spec(run, inject=inject), run, "first", on_start=_send_signal_when_ready(signum))
    assert first.returncodes == [PREEMPTED_EXIT_CODE], first.output[-6000:]
    assert not first.orphans
    assert first.count("Traceback") == 0, first.output[-6000:]
    name = signal.Signals(signum).name
    for r in (0, 1):  # every rank agreed, finished step 3 (global step 3 -> 4) and saved
        assert f"[rank {r}] preempted by {name} at global step 4: checkpoint saved to" in first.output
    assert (run / "ckpt" / "last.ckpt").exists()
    assert [r["step"] for r in first.log] == [1, 2, 3, 4]

    second = run_lightning(_spec(run, ckpt_path="last"), run, "second")
    assert second.returncodes == [0], second.output[-6000:]
    assert_same_run(first.log + second.log, reference.log)


@pytest.mark.slow
def test_node_loss_resume_at_half_the_ranks(tmp_path, reference):
    """Saved at 4 ranks, resumed at 2 (a lost node): the sharded checkpoint reshards on load."""
    run = _mkdir(tmp_path / "run")
    periodic = {"checkpoint_kwargs": {"every_n_train_steps": 2}}  # `last` at step 4, mid-epoch
    first = run_lightning(_spec(run, devices=4, max_steps=4, **periodic), run, "first")
    assert first.returncodes == [0], first.output[-6000:]
    second = run_lightning(_spec(run, devices=2, ckpt_path="last", **periodic), run, "second")
    assert second.returncodes == [0], second.output[-6000:]
    assert_same_run(first.log + second.log, reference.log)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
