"""Warm-started local ranks: which commands start them, and how a launcher's command is handed to one.

The whole path (a warm process becoming rank 1 of a real job) runs in ``tests/e2e/test_train_cli.py``, whose job
summary counts the ranks that were handed over."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from lightning_fsdp import _warm_start
from lightning_fsdp._warm_start import (
    _package_command_args,
    handing_over,
    runs_one_training_job,
    train_overrides,
    warm_rank_count,
)

SCRIPT = "/venv/bin/lightning-fsdp"


def test_the_train_command_is_recognised_however_it_is_started():
    assert train_overrides([SCRIPT, "train", "a=1"]) == ["a=1"]
    assert train_overrides([SCRIPT, "consolidate", "x"]) is None
    assert train_overrides(["/x/lightning_fsdp/__main__.py", "train"]) == []
    # `python -m lightning_fsdp train ...` while the package is imported: argv is ["-m"], the interpreter has the rest
    assert train_overrides(["-m"], [sys.executable, "-m", "lightning_fsdp", "train", "b=2"]) == ["b=2"]
    assert train_overrides(["-m"], [sys.executable, "-m", "other", "train"]) is None
    assert train_overrides(["script.py", "train"]) is None


@pytest.mark.parametrize(
    ("overrides", "env", "expected"),
    [
        ([], {}, 1),  # the default job: 2 CPU processes
        (["trainer.devices=4"], {}, 3),
        (["trainer.devices=1"], {}, 0),
        (["trainer.num_nodes=2"], {}, 0),  # other nodes start their own ranks
        (["strategy=ddp"], {}, 0),  # Lightning's own launcher
        (["-m", "seed=1,2"], {}, 0),  # a multirun launches per job
        (["no_such_key=1"], {}, 0),  # Hydra's error comes from `hydra.main`
        ([], {"LIGHTNING_FSDP_WARM_START": "0"}, 0),
        ([], {"LOCAL_RANK": "1"}, 0),  # already a rank
        ([], {"RANK": "0"}, 0),  # torchrun
        ([], {"SLURM_NTASKS": "4"}, 0),
        ([], {"LIGHTNING_FSDP_WARM_RANK": "1"}, 0),  # a warm process never starts more
    ],
)
def test_how_many_ranks_are_started_warm(overrides, env, expected):
    assert warm_rank_count([SCRIPT, "train", *overrides], env) == expected


def test_launcher_commands_of_this_package_run_in_process():
    assert _package_command_args([sys.executable, "-m", "lightning_fsdp", "train", "a=1"]) == ["train", "a=1"]
    assert _package_command_args([sys.executable, SCRIPT, "train"]) == ["train"]
    assert _package_command_args([sys.executable, "other.py", "train"]) is None  # exec-ed as Popen would
    assert _package_command_args(["/another/python", "-m", "lightning_fsdp"]) is None


def _fake_warm_process() -> subprocess.Popen:
    """Stands for a warm process: prints what it was handed."""
    code = ("import json, sys; m = json.loads(sys.stdin.readline());"
            " print(m['command'], m['env'].get('LOCAL_RANK'), m['cwd'])")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)


def test_the_launchers_command_goes_to_a_warm_process(tmp_path, monkeypatch):
    warm = _fake_warm_process()
    monkeypatch.setattr(_warm_start, "_warm", [warm])
    monkeypatch.setattr(_warm_start, "handed_over", 0)
    with handing_over(1):
        proc = subprocess.Popen(["my", "command"], env={"LOCAL_RANK": "1"}, cwd=str(tmp_path))
    assert proc is warm and _warm_start.handed_over == 1 and _warm_start._warm == []
    out, _ = proc.communicate(timeout=30)
    assert out.decode().split() == ["['my',", "'command']", "1", str(tmp_path)]
    assert subprocess.Popen is not None and subprocess.Popen.__name__ == "Popen"  # restored


def test_without_the_right_number_of_live_warm_processes_the_launcher_starts_its_own(monkeypatch):
    warm = _fake_warm_process()
    monkeypatch.setattr(_warm_start, "_warm", [warm])
    monkeypatch.setattr(_warm_start, "handed_over", 0)
    with handing_over(2):  # two ranks wanted, one warm: all released, plain processes started
        proc = subprocess.Popen([sys.executable, "-c", "print('own')"], stdout=subprocess.PIPE)
    assert proc is not warm and proc.communicate(timeout=30)[0].strip() == b"own"
    assert warm.poll() is not None and _warm_start._warm == [] and _warm_start.handed_over == 0


def test_the_processes_that_run_one_training_job():
    assert runs_one_training_job([SCRIPT, "train", "a=1"])
    assert runs_one_training_job(["-m"], [sys.executable, "-m", "lightning_fsdp", "train"])
    assert runs_one_training_job(["-m"], [sys.executable, "-m", "lightning_fsdp.train"])  # warm, or a multirun job
    assert not runs_one_training_job([SCRIPT, "train", "-m", "seed=1,2"])  # the sweep's own process
    assert not runs_one_training_job([SCRIPT, "train", "--help"])
    assert not runs_one_training_job([SCRIPT, "consolidate", "x"])
    assert not runs_one_training_job(["pytest"], [sys.executable, "-m", "pytest"])


def test_the_collector_is_off_while_a_job_imports_and_then_skips_what_was_imported(monkeypatch):
    monkeypatch.setattr(_warm_start, "_collection_paused", False)
    assert gc.isenabled()
    try:
        _warm_start.pause_collection()
        assert not gc.isenabled() and _warm_start.collection_paused()
        assert _warm_start.resume_collection()
        assert gc.isenabled() and not _warm_start.collection_paused() and gc.get_freeze_count() > 10_000
        assert not _warm_start.resume_collection()  # once
        gc.unfreeze()
        gc.disable()  # turned off by someone else: neither taken over nor turned back on
        _warm_start.pause_collection()
        assert not _warm_start.collection_paused() and not _warm_start.resume_collection() and not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
