"""Fault injection with real gloo jobs: killed ranks, damaged and crafted files, a rank whose disk write fails.

Each test asserts three things: the job ends (subprocess timeouts, no hang), every rank reports the same
``CheckpointError``, and the previous checkpoint is intact and loads.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import signal
import time

import pytest
import torch

from lightning_fsdp.checkpoint import CheckpointError, verify_checkpoint
from lightning_fsdp.checkpoint.checksums import hash_file
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME, META_NAME
from tests.scripts.ckpt_jobs import end_session, errors_by_rank, job, start, wait_for

pytestmark = pytest.mark.xdist_group("test_checkpoint_faults")  # its module fixtures run once, on one worker

STEPS_PER_EPOCH = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One epoch on 2 ranks with ModelCheckpoint(save_top_k=-1, save_last=True): `epoch=0-step=4.ckpt`, `last.ckpt`."""
    root = tmp_path_factory.mktemp("faults")
    ckpts = root / "ckpts"
    job(
        {"devices": 2, "max_epochs": 1, "checkpoint_dir": str(ckpts), "checkpoint_kwargs": {"save_top_k": -1}},
        root,
        "base",
    )
    return ckpts


def _copy_last(base, tmp_path):
    return shutil.copytree(base / "last.ckpt", tmp_path / "last.ckpt")


def _save_id(path):
    return json.loads((path / MANIFEST_NAME).read_text())["save_id"]


def _global_step(path):
    return torch.load(path / META_NAME, weights_only=True)["global_step"]


def _load_fails_on_every_rank(tmp_path, ckpt, name="load"):
    """Resume from ``ckpt`` on 2 ranks; returns each rank's error text (the job must end by itself)."""
    errors = tmp_path / f"{name}-errors"
    errors.mkdir()
    result = job(
        {"devices": 2, "max_epochs": 2, "ckpt_path": str(ckpt), "error_dir": str(errors)},
        tmp_path,
        name,
        check=False,
        timeout=120,
    )
    assert result["proc"].returncode != 0
    by_rank = errors_by_rank(errors)
    assert sorted(by_rank) == [0, 1], result["proc"].stderr[-4000:]
    firsts = {rank: text.splitlines()[0] for rank, text in by_rank.items()}
    assert firsts[0] == firsts[1], firsts  # the same error on every rank
    assert firsts[0].startswith("CheckpointError: ")
    return firsts[0]


# -- damaged shards -----------------------------------------------------------------------------------------------------
def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_flip_byte, "__1_0.distcp fails its crc32 checksum"),
        (lambda p: p.unlink(), "__1_0.distcp is missing"),
        (_truncate, "__1_0.distcp has"),
    ],
    ids=["flipped_byte", "deleted_shard", "truncated_shard"],
)
def test_damaged_shard_is_rejected_on_every_rank(tmp_path, base, damage, expected):
    ckpt = _copy_last(base, tmp_path)
    damage(ckpt / "__1_0.distcp")
    message = _load_fails_on_every_rank(tmp_path, ckpt)
    assert "is damaged and was not loaded" in message and expected in message


@pytest.mark.timeout(120)
def test_a_fifo_that_the_manifest_agrees_with_is_refused_on_every_rank_without_blocking(tmp_path, base):
    """Opening a FIFO blocks until a writer appears: a load that opened rank 1's shard would hang forever. The
    directory is refused by name on every rank before any file is opened (the job's timeout would catch a hang)."""
    ckpt = _copy_last(base, tmp_path)
    shard = ckpt / "__1_0.distcp"
    shard.unlink()
    os.mkfifo(shard)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["files"][shard.name] = {"size": 0, "checksum": "00000000"}  # what stat and an empty read would give
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    started = time.monotonic()
    message = _load_fails_on_every_rank(tmp_path, ckpt)
    assert "holds entries that are not regular files: __1_0.distcp (a FIFO)" in message
    assert time.monotonic() - started < 60


# -- crafted files ------------------------------------------------------------------------------------------------------
class Payload:
    """Unpickled by a plain unpickler, this runs a shell command creating ``marker`` (see the unit tests)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@pytest.mark.parametrize("target", [".metadata", META_NAME])
def test_crafted_file_is_refused_and_its_code_never_runs(tmp_path, base, target):
    """The attacker also rewrites the manifest, so checksums pass: the restricted loaders must refuse."""
    ckpt = _copy_last(base, tmp_path)
    marker = tmp_path / "code-ran"
    if target == ".metadata":
        (ckpt / target).write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"epoch": Payload(marker), "global_step": 4}, ckpt / target)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    entry = hash_file(ckpt / target)
    manifest["files"][target] = {"size": entry.size, "checksum": entry.checksum}
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    verify_checkpoint(ckpt)  # checksums match: only the unpickler stands in the way
    message = _load_fails_on_every_rank(tmp_path, ckpt)
    assert message.startswith(f"CheckpointError: Refusing to load {ckpt / target}")
    assert not marker.exists()


def test_directory_without_manifest_is_refused(tmp_path, base):
    ckpt = _copy_last(base, tmp_path)
    (ckpt / MANIFEST_NAME).unlink()
    message = _load_fails_on_every_rank(tmp_path, ckpt)
    assert "is not a checkpoint: it has no manifest.json" in message and f"`lightning-fsdp seal {ckpt}`" in message


# -- a rank killed in the middle of a save ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "kill_rank"),
    [pytest.param("epoch=1-step=8.ckpt", 1, marks=pytest.mark.slow), ("last.ckpt", 0)],
    ids=["fresh_path", "overwriting_last"],
)
def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, base, target, kill_rank):
    """Resume for epoch 2; at its end ModelCheckpoint saves `epoch=1-step=8.ckpt`, then overwrites `last.ckpt`.
    In every save each rank pauses (test hook) after writing its shard file, before the ranks agree the save is
    complete: the test SIGKILLs one rank there."""
    ckpts = shutil.copytree(base, tmp_path / "ckpts")
    last_before = _save_id(ckpts / "last.ckpt")
    pids = tmp_path / "pids"
    pids.mkdir()
    spec = {
        "devices": 2,
        "max_epochs": 2,
        "ckpt_path": "last",
        "checkpoint_dir": str(ckpts),
        # the copied state names the original directory: overwrite `last.ckpt` here instead of adding `last-v1`
        "checkpoint_kwargs": {"save_top_k": -1, "enable_version_counter": False},
        "pid_dir": str(pids),
        "pause_after_write_s": 4,
    }
    proc = start(spec, tmp_path, "killed")
    try:
        staging = wait_for(
            lambda: next(
                (p for p in ckpts.glob(f".staging-*-{target}") if (p / f"__{kill_rank}_0.distcp").exists()), None
            ),
            timeout=150,
            what=f"rank {kill_rank}'s shard of {target}",
            proc=proc,
        )
        os.kill(int((pids / f"rank{kill_rank}.pid").read_text()), signal.SIGKILL)
    finally:
        code = end_session(proc, timeout=60)
    assert code != 0
    # the partial checkpoint is not a checkpoint, under any name
    assert not (staging / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no manifest.json"):
        verify_checkpoint(staging)
    # the previous one is intact
    assert _save_id(ckpts / "last.ckpt") == last_before and _global_step(ckpts / "last.ckpt") == STEPS_PER_EPOCH
    verify_checkpoint(ckpts / "last.ckpt")
    if target == "last.ckpt":
        verify_checkpoint(ckpts / "epoch=1-step=8.ckpt")  # committed before the kill
        return
    assert not (ckpts / target).exists()
    # fresh processes: `ckpt_path="last"` picks the intact checkpoint, and the next save cleans up
    resumed = job({**spec, "pid_dir": None}, tmp_path, "resumed")
    assert resumed["global_step"] == 2 * STEPS_PER_EPOCH and len(resumed["losses"]) == STEPS_PER_EPOCH
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert _global_step(ckpts / "last.ckpt") == 2 * STEPS_PER_EPOCH


# -- a rank whose disk write fails --------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"])
def test_failed_write_on_one_rank_fails_the_save_on_every_rank(tmp_path, async_save):
    """Rank 1's process may not grow a file beyond 4 KiB (RLIMIT_FSIZE: the kernel's EFBIG, a real write
    error) while it overwrites an existing checkpoint. Async: the error surfaces at the next save."""
    ckpt = tmp_path / "model.ckpt"
    errors = tmp_path / "errors"
    errors.mkdir()
    fail = {"rank": 1, "path": str(ckpt)}
    if async_save:
        fail["async_then"] = str(tmp_path / "next.ckpt")
    spec = {
        "devices": 2,
        "max_epochs": 1,
        "save_path": str(ckpt),
        "strategy_kwargs": {"async_save": async_save},
        "fail_write": fail,
        "error_dir": str(errors),
    }
    result = job(spec, tmp_path, "fail", check=False, timeout=120)
    assert result["proc"].returncode != 0
    by_rank = errors_by_rank(errors)
    assert sorted(by_rank) == [0, 1], result["proc"].stderr[-4000:]
    for text in by_rank.values():
        first = text.splitlines()[0]
        assert first.startswith("CheckpointError: Writing the shards of checkpoint")
        assert "rank 1: OSError: [Errno 27] File too large" in first
    # the previous checkpoint is intact (same content, all checksums) and nothing half-written is left
    verify_checkpoint(ckpt)
    assert _global_step(ckpt) == STEPS_PER_EPOCH
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert not (tmp_path / "next.ckpt").exists()
    if not async_save:  # and it loads (validate: the model only, no optimizer)
        loaded = job(
            {"devices": 2, "stage": "validate", "ckpt_path": str(ckpt), "limit_val_batches": 1}, tmp_path, "load"
        )
        assert loaded["proc"].returncode == 0
