"""Atomic commit and crash recovery on real directories (no process group).

Each crash test builds the exact on-disk state a crash at that point leaves behind, then runs the recovery the
next save or load runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fsdp.checkpoint import commit as c
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME


def _checkpoint(path: Path, tag: str, complete: bool = True) -> Path:
    path.mkdir()
    (path / "__0_0.distcp").write_text(tag)
    if complete:
        (path / MANIFEST_NAME).write_text("{}")
    return path


def _tag(path: Path) -> str:
    return (path / "__0_0.distcp").read_text()


def test_staging_names_never_look_like_checkpoints(tmp_path):
    """Lightning's `ckpt_path="last"` lists the directory for `last*.ckpt`: hidden entries must never match."""
    target = tmp_path / "last.ckpt"
    for kind in (c.STAGING, c.REPLACED, c.TRASH):
        _checkpoint(c.temp_path(target, kind, c.new_token()), "x")
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == set()
    _checkpoint(target, "x")
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == {str(target)}


@pytest.mark.parametrize("use_exchange", [None, False])
def test_commit_fresh_and_replace(tmp_path, use_exchange):
    target = tmp_path / "last.ckpt"
    c.commit(_checkpoint(c.temp_path(target, c.STAGING, "0" * 12), "old"), target, use_exchange=use_exchange)
    assert _tag(target) == "old"
    c.commit(_checkpoint(c.temp_path(target, c.STAGING, "1" * 12), "new"), target, use_exchange=use_exchange)
    assert _tag(target) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_commit_replaces_a_file_with_a_directory(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_text("full checkpoint")
    c.commit(_checkpoint(c.temp_path(target, c.STAGING, "2" * 12), "sharded"), target)
    assert _tag(target) == "sharded" and len(list(tmp_path.iterdir())) == 1


def test_commit_refuses_a_foreign_source(tmp_path):
    with pytest.raises(ValueError, match="not a staging entry"):
        c.commit(_checkpoint(tmp_path / "other", "x"), tmp_path / "last.ckpt")


def test_crash_between_the_renames_rolls_forward(tmp_path):
    """Move-aside path, crash after `last.ckpt` → `.replaced-*` and before staging → `last.ckpt`."""
    target = tmp_path / "last.ckpt"
    token = c.new_token()
    _checkpoint(c.temp_path(target, c.REPLACED, token), "old")
    _checkpoint(c.temp_path(target, c.STAGING, token), "new")
    actions = c.recover(tmp_path)
    assert _tag(target) == "new"
    assert f"completed the interrupted commit of {target}" in actions
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_crash_with_incomplete_staging_restores_the_old(tmp_path):
    target = tmp_path / "last.ckpt"
    token = c.new_token()
    _checkpoint(c.temp_path(target, c.REPLACED, token), "old")
    _checkpoint(c.temp_path(target, c.STAGING, token), "new", complete=False)
    c.recover(tmp_path)
    assert _tag(target) == "old" and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_crash_after_exchange_or_before_commit_keeps_the_target(tmp_path):
    """Staging of a save that never committed, an old copy left after an exchange, a half-deleted trash entry."""
    target = tmp_path / "last.ckpt"
    _checkpoint(target, "current")
    _checkpoint(c.temp_path(target, c.STAGING, c.new_token()), "uncommitted")
    _checkpoint(c.temp_path(target, c.REPLACED, c.new_token()), "previous")
    _checkpoint(c.temp_path(tmp_path / "epoch=0.ckpt", c.TRASH, c.new_token()), "deleted", complete=False)
    c.recover(tmp_path)
    assert _tag(target) == "current" and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_readers_repair_but_leave_staging_alone(tmp_path):
    """A load may run while another job saves into the same directory: it must not delete that job's staging."""
    target = tmp_path / "last.ckpt"
    token = c.new_token()
    _checkpoint(c.temp_path(target, c.REPLACED, token), "old")
    other = _checkpoint(c.temp_path(tmp_path / "epoch=3.ckpt", c.STAGING, c.new_token()), "in progress", complete=False)
    c.recover(tmp_path, {"last.ckpt"}, delete_leftovers=False)
    assert _tag(target) == "old" and other.exists()


def test_remove_never_leaves_a_partial_checkpoint_under_its_name(tmp_path):
    target = _checkpoint(tmp_path / "epoch=0.ckpt", "x")
    c.remove(target)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full.ckpt").write_text("x")
    c.remove(tmp_path / "full.ckpt")
    c.remove(tmp_path / "missing.ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("directory", [False, True])
def test_staged_writes_commit_whole_or_leave_the_target_as_it_was(tmp_path, directory):
    target = tmp_path / ("out" if directory else "out.ckpt")

    def write(staging: Path, text: str) -> None:
        (staging / "model.safetensors" if directory else staging).write_text(text)

    with c.staged(target, directory=directory) as staging:
        write(staging, "first")
    with pytest.raises(RuntimeError, match="disk full"):
        with c.staged(target, directory=directory) as staging:
            write(staging, "half")
            raise RuntimeError("disk full")
    assert (target / "model.safetensors" if directory else target).read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no staging entry left behind


def test_one_safetensors_writer_round_trips_mixed_dtypes_aligned(tmp_path):
    import torch
    from safetensors import safe_open

    from lightning_fsdp.checkpoint.errors import CheckpointError
    from lightning_fsdp.checkpoint.safetensors_file import write_safetensors, write_tensors

    tensors = {"a.bias": torch.arange(3, dtype=torch.bfloat16), "b.weight": torch.randn(3, 5),
               "c.mask": torch.tensor([True, False, True]), "d.ids": torch.arange(7, dtype=torch.int64)}
    write_tensors(tmp_path / "m.safetensors", tensors)
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)
    header_len = int.from_bytes((tmp_path / "m.safetensors").read_bytes()[:8], "little")
    import json

    header = json.loads((tmp_path / "m.safetensors").read_bytes()[8:8 + header_len])
    for name, tensor in tensors.items():  # every tensor starts at a multiple of its element size
        assert header[name]["data_offsets"][0] % tensor.element_size() == 0
    lying = {"x": (torch.float32, (2,), lambda: torch.zeros(3))}
    with pytest.raises(CheckpointError, match=r"x: read torch.float32 \(3,\), but the header says"):
        write_safetensors(tmp_path / "bad.safetensors", lying)
