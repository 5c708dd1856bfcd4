"""One rank fails, stalls, sees a NaN or runs out of data: every rank must end promptly and say why, once.

Each test launches a real 2-rank job (gloo, the real Trainer) in its own session and asserts on how it ended:
exit status, time from the injected fault to the end of the job (the process-group timeout stays at its default
of 1800 s unless the test is about the timeout), the traceback printed once, and no process left behind.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from lightning_fsdp import resilience
from tests.scripts.fail_jobs import run_lightning

TRACEBACK = "Traceback (most recent call last)"
BASE = {"devices": 2, "max_steps": 6}


def assert_ended_promptly(job, within: float = 30.0) -> None:
    assert all(code != 0 for code in job.returncodes), f"exit codes {job.returncodes}:\n{job.output[-4000:]}"
    assert job.seconds_after_fault < within, f"ended {job.seconds_after_fault:.1f} s after the fault:\n{job.output[-4000:]}"
    assert not job.orphans, f"processes left behind: {job.orphans}"


# -- exceptions -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "rank", "message"),
    [
        # CI: the launcher failing, and a hook failing (the step and the data loader cover the relay by default)
        pytest.param("raise_step", 0, "ValueError: injected failure in training_step on rank 0", marks=pytest.mark.slow),
        ("raise_step", 1, "ValueError: injected failure in training_step on rank 1"),
        pytest.param("raise_hook", 1, "RuntimeError: injected failure in on_train_batch_start on rank 1",
                     marks=pytest.mark.slow),
        ("raise_data", 1, "OSError: injected failure reading sample 8 on rank 1"),
    ],
    ids=["step-rank0", "step-rank1", "hook-rank1", "dataloader-rank1"],
)
def test_exception_on_one_rank_ends_every_rank(tmp_path, kind, rank, message):
    job = run_lightning({**BASE, "inject": {"kind": kind, "rank": rank, "step": 2}}, tmp_path, "job")
    assert_ended_promptly(job)
    assert job.count(TRACEBACK) == 1, job.output[-6000:]
    assert job.count(message) >= 1
    survivor = 1 - rank
    assert f"[rank {survivor}]" in job.output and f"rank {rank} failed" in job.output, job.output[-3000:]


@pytest.mark.parametrize("rank", [0, 1], ids=["launcher-rank0", "spawned-rank1"])
def test_rank_killed_by_a_signal_is_named_by_the_survivor(tmp_path, rank):
    """SIGKILL (the OOM killer's signal) leaves no traceback and no abort record; rank 0 also takes the store with
    it. The survivor's last line must still say which rank stopped and how, not gloo's "Connection reset by peer"."""
    job = run_lightning({**BASE, "max_steps": 4, "inject": {"kind": "sigkill", "rank": rank, "step": 2}}, tmp_path, "job")
    assert_ended_promptly(job, within=60)
    lines = [line for line in job.output.splitlines() if line.strip()]
    survivor = 1 - rank
    assert lines and lines[-1].startswith(f"[rank {survivor}] rank {rank} (pid "), job.output[-3000:]
    assert "was killed by signal SIGKILL (9)" in lines[-1], job.output[-3000:]
    assert TRACEBACK not in job.output, job.output[-6000:]


def test_exception_in_a_later_stage_ends_every_rank(tmp_path):
    """``fit`` finished, then ``validate`` fails on rank 1: the relay works in every Trainer stage, not only the first."""
    spec = {**BASE, "max_steps": 2, "validate_after": True, "limit_val_batches": 4,
            "inject": {"kind": "raise_validate", "rank": 1, "step": 2}}
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job)
    assert job.count(TRACEBACK) == 1, job.output[-6000:]
    assert job.count("ValueError: injected failure in validation_step on rank 1") >= 1
    assert "[rank 0]" in job.output and "rank 1 failed" in job.output, job.output[-3000:]


def test_safe_on_exception_checkpoint_does_not_hang_when_one_rank_fails(tmp_path):
    """Lightning's OnExceptionCheckpoint would start a collective save on the failing rank alone and hang."""
    spec = {**BASE, "inject": {"kind": "raise_step", "rank": 1, "step": 2}, "on_exception_dir": str(tmp_path / "exc")}
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job)
    assert "on-exception checkpoint not saved" in job.output
    assert not (tmp_path / "exc" / "on_exception.ckpt").exists()


def test_on_exception_checkpoint_is_saved_when_every_rank_fails_together(tmp_path):
    """All or nothing: when every rank raises at the same step, they can save together."""
    spec = {**BASE, "inject": {"kind": "raise_step", "rank": [0, 1], "step": 2}, "on_exception_dir": str(tmp_path / "exc")}
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job)
    assert (tmp_path / "exc" / "on_exception.ckpt").exists(), job.output[-6000:]
    assert "not saved" not in job.output
    assert job.count(TRACEBACK) == 1, job.output[-6000:]  # the first to fail prints it; the other says so in a line


# -- collective timeout -----------------------------------------------------------------------------------------------
def test_collective_timeout_is_configurable_and_names_the_operation(tmp_path):
    spec = {
        **BASE,
        "strategy_kwargs": {"timeout": 6},  # short, but the start-up rendezvous must fit in it too
        "inject": {"kind": "sleep", "rank": 1, "step": 2, "seconds": 120},
    }
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job, within=6 + 25)
    assert "CollectiveTimeoutError" in job.output
    assert "training_step (FSDP parameter all-gathers in forward" in job.output
    assert "timeout=6 s" in job.output


@pytest.mark.slow
def test_collective_timeout_applies_to_hsdp_subgroups(tmp_path):
    """HSDP's shard and replicate groups are created by the device mesh with PyTorch's 30-minute default; the
    strategy gives them its own `timeout` too (here the all-gather on the shard group {0, 1} times out)."""
    spec = {
        **BASE,
        "devices": 4,
        "batch_size": 2,
        "strategy_kwargs": {"timeout": 10, "replicate_size": 2, "shard_size": 2},  # also the start-up rendezvous
        "inject": {"kind": "sleep", "rank": 1, "step": 2, "seconds": 120},
    }
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job, within=10 + 25)
    assert "MeshShape(replicate=2, shard=2)" in job.output
    assert "CollectiveTimeoutError" in job.output and "timeout=10 s" in job.output


# -- non-finite steps -------------------------------------------------------------------------------------------------
def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    spec = {
        **BASE,
        "strategy_kwargs": {"skip_nonfinite_steps": True},
        "record_params": True,
        "inject": {"kind": "nan", "rank": 1, "step": 2},
    }
    job = run_lightning(spec, tmp_path, "job")
    assert job.returncodes == [0], job.output[-4000:]
    rows = {row["step"]: row for row in job.log}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # the run went on to max_steps
    params = {step: torch.tensor(row["params"]) for step, row in rows.items()}
    torch.testing.assert_close(params[3], params[2], rtol=0, atol=0)  # the NaN step (global step 2 -> 3) changed nothing
    assert not torch.equal(params[4], params[3])  # the next step trained again
    assert all(torch.isfinite(p).all() for p in params.values())
    assert [rows[s]["skipped"] for s in sorted(rows)] == [0, 0, 1, 1, 1, 1]
    assert job.count("skipped optimizer step at global step 2 on every rank") == 1


def test_consecutive_nonfinite_steps_stop_with_a_clear_error(tmp_path):
    spec = {
        **BASE,
        "strategy_kwargs": {"skip_nonfinite_steps": True, "max_nonfinite_steps": 3},
        "inject": {"kind": "nan", "rank": 0, "step": [1, 2, 3, 4, 5]},
    }
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job)
    assert "NonFiniteStepsError: 3 consecutive optimizer steps had a non-finite loss" in job.output
    assert job.count(TRACEBACK) == 1, job.output[-6000:]  # raised on both ranks, printed by rank 0 only
    assert "[rank 1] NonFiniteStepsError (raised on every rank" in job.output


# -- uneven data ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_uneven_batch_counts_fail_clearly_instead_of_hanging(tmp_path, iterable):
    spec = {**BASE, "max_steps": 20, "max_epochs": 1, "inject": {"kind": "uneven", "batches": [3, 5], "iterable": iterable}}
    job = run_lightning(spec, tmp_path, "job")
    assert_ended_promptly(job)  # counted from the start of training
    assert "UnevenBatchesError" in job.output
    if iterable:
        assert "ran out of training batches at different times" in job.output
        # Lightning fetches one batch ahead for loaders without a length, so the mismatch (at the 4th fetch) is seen
        # before the 3rd step runs: two steps trained, then every rank raised together
        assert len(job.log) == 2
    else:
        assert "rank 0: 3, rank 1: 5" in job.output
        assert job.log == []  # caught before the first step
    assert job.count(TRACEBACK) == 1, job.output[-6000:]


# -- the pure pieces --------------------------------------------------------------------------------------------------
def test_messages_and_classification():
    assert resilience.uneven_batches_message("training", [4, 4]) is None
    msg = resilience.uneven_batches_message("validation", [[2, 3], [2, 4]])
    assert msg is not None and "rank 0: [2, 3], rank 1: [2, 4]" in msg
    assert "no length" in resilience.uneven_batches_message("training", [-1, 3])
    assert resilience.is_timeout_error(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete"))
    assert resilience.is_timeout_error(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLGATHER)"))
    assert not resilience.is_timeout_error(RuntimeError("Connection closed by peer"))
    assert not resilience.is_timeout_error(TimeoutError("HTTPSConnectionPool: Read timed out."))  # a user's error
    text = resilience.timeout_message("backward (FSDP gradient reduce-scatter)", 3, timedelta(seconds=90), RuntimeError("x"))
    assert "rank 3" in text and "backward (FSDP gradient reduce-scatter)" in text and "timeout=90 s" in text
    assert issubclass(resilience.Preempted, SystemExit) and resilience.Preempted("m").code == resilience.PREEMPTED_EXIT_CODE
