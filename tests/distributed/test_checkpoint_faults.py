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


def _fifo(ckpt):
    """Opening a FIFO blocks until a writer appears: a load that opened it would hang forever. The manifest is made to
    agree with what stat and an empty read would give."""
    shard = ckpt / "__1_0.distcp"
    shard.unlink()
    os.mkfifo(shard)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["files"][shard.name] = {"size": 0, "checksum": "00000000"}
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))


class Payload:
    """Unpickled by a plain unpickler, this runs a shell command creating ``marker`` (see the unit tests)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _crafted(target, marker):
    """A file that runs code when unpickled; the attacker also rewrites the manifest, so checksums pass and only the
    restricted loaders stand in the way."""

    def craft(ckpt):
        if target == ".metadata":
            (ckpt / target).write_bytes(pickle.dumps(Payload(marker)))
        else:
            torch.save({"epoch": Payload(marker), "global_step": 4}, ckpt / target)
        manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
        entry = hash_file(ckpt / target)
        manifest["files"][target] = {"size": entry.size, "checksum": entry.checksum}
        (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
        verify_checkpoint(ckpt)  # checksums match

    return craft


#: damaged and crafted copies of `last.ckpt`, loaded one after another by one 2-rank job
REFUSALS = {
    "deleted_shard": (lambda c: (c / "__1_0.distcp").unlink(), ["__1_0.distcp is missing", "is damaged and was not loaded"]),
    "truncated_shard": (lambda c: _truncate(c / "__1_0.distcp"), ["__1_0.distcp has", "is damaged and was not loaded"]),
    "fifo": (_fifo, ["holds entries that are not regular files: __1_0.distcp (a FIFO)"]),
    "no_manifest": (lambda c: (c / MANIFEST_NAME).unlink(), ["is not a checkpoint: it has no manifest.json", "lightning-fsdp seal"]),
    "crafted_metadata": (".metadata", ["Refusing to load", ".metadata"]),
    "crafted_meta_pt": (META_NAME, ["Refusing to load", META_NAME]),
}


@pytest.fixture(scope="module")
def refusals(base, tmp_path_factory):
    """Every case of :data:`REFUSALS` loaded by the same 2-rank job, after a fit: each rank's error per case."""
    root = tmp_path_factory.mktemp("refusals")
    marker = root / "code-ran"
    paths = {}
    for case, (damage, _) in REFUSALS.items():
        ckpt = shutil.copytree(base / "last.ckpt", root / case / "last.ckpt")
        (_crafted(damage, marker) if isinstance(damage, str) else damage)(ckpt)
        paths[case] = str(ckpt)
    errors = root / "errors"
    errors.mkdir()
    job({"devices": 2, "max_steps": 1, "load_each": paths, "error_dir": str(errors)}, root, "refusals", timeout=180)
    return {case: {r: (errors / f"{case}-rank{r}.txt").read_text() for r in (0, 1)} for case in REFUSALS}, marker


def test_damaged_shard_is_rejected_on_every_rank(tmp_path, base):
    """Through the Trainer: `fit(ckpt_path=...)` with one flipped byte ends every rank with the same error."""
    ckpt = _copy_last(base, tmp_path)
    _flip_byte(ckpt / "__1_0.distcp")
    message = _load_fails_on_every_rank(tmp_path, ckpt)
    assert "is damaged: __1_0.distcp fails its crc32c checksum in bytes" in message and "do not continue" in message


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_damaged_or_crafted_checkpoints_are_refused_on_every_rank(refusals, case):
    """Deleted, truncated, a FIFO (refused by name before any file is opened: the job's timeout would catch a hang),
    no manifest, and crafted pickles whose code never runs."""
    by_case, marker = refusals
    errors = by_case[case]
    assert errors[0] == errors[1], errors  # the same error on every rank
    assert errors[0].startswith("CheckpointError: "), errors[0]
    for expected in REFUSALS[case][1]:
        assert expected in errors[0], errors[0]
    assert not marker.exists()  # no crafted pickle's code ran


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
