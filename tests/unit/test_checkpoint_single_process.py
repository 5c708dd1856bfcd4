"""``Checkpointer`` and consolidation in one process (no process group): the same code path as rank 0 alone.

The multi-rank behaviour (parallel writes, resharding, agreement on errors) is in ``tests/distributed``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import zipfile

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_fsdp.checkpoint import (
    Checkpointer,
    CheckpointError,
    consolidate_checkpoint,
    load_pretrained,
    verify_checkpoint,
)
from lightning_fsdp.checkpoint.checksums import hash_file
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME, META_NAME
from lightning_fsdp.commands.consolidate import main as consolidate_main


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _lightning_checkpoint(model, opt, full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=full)
    return {
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_states": [get_optimizer_state_dict(model, opt, options=options)],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
        "callbacks": {"ModelCheckpoint{}": {"best_model_score": torch.tensor(0.5), "dirpath": "x"}},
        "hyper_parameters": {"width": 7},
    }


def _equal_state(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def saved(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = tmp_path / "ckpts" / "last.ckpt"
    Checkpointer().save_sharded(_lightning_checkpoint(model, opt), path)
    return path, model, opt


def test_sharded_round_trip(saved):
    path, model, opt = saved
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", MANIFEST_NAME, META_NAME]
    manifest = verify_checkpoint(path)
    assert manifest.world_size == 1 and manifest.target == "last.ckpt"
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no staging left behind
    fresh, fresh_opt = _model_and_optimizer(1)
    rest = Checkpointer().load(path, fresh, [fresh_opt])
    assert _equal_state(model, fresh)
    for p, q in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)
    assert rest["epoch"] == 3 and rest["callbacks"]["ModelCheckpoint{}"]["best_model_score"] == 0.5
    assert "state_dict" not in rest and "optimizer_states" not in rest and "lightning_fsdp" not in rest


def test_overwrite_keeps_one_directory(saved):
    path, model, opt = saved
    first = json.loads((path / MANIFEST_NAME).read_text())["save_id"]
    Checkpointer().save_sharded(_lightning_checkpoint(model, opt), path)
    assert json.loads((path / MANIFEST_NAME).read_text())["save_id"] != first
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_is_detected_as_it_is_read(saved):
    """Each entry is checked before it is parsed: the load raises, naming the file and the bytes."""
    path, _, _ = saved
    _flip_middle_byte(path / "__0_0.distcp")
    fresh, fresh_opt = _model_and_optimizer(1)
    with pytest.raises(CheckpointError, match=r"is damaged: __0_0\.distcp fails its crc32c checksum in bytes \d+\.\.\d+"):
        Checkpointer().load(path, fresh, [fresh_opt])


def test_verify_before_load_changes_nothing_when_a_byte_is_flipped(saved):
    path, _, _ = saved
    _flip_middle_byte(path / "__0_0.distcp")
    fresh, fresh_opt = _model_and_optimizer(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"is damaged and was not loaded: __0_0\.distcp fails its crc32c checksum in bytes"
    ):
        Checkpointer(verify_before_load=True).load(path, fresh, [fresh_opt])
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    from lightning_fsdp import FSDPCustomStrategy

    assert FSDPCustomStrategy(verify_before_load=True).checkpointer.verify_before_load  # the strategy's switch
    assert not FSDPCustomStrategy().checkpointer.verify_before_load


def test_each_shard_file_is_opened_and_read_once_per_load(saved, monkeypatch):
    """One pass: every byte of the shard file is read once, by the load itself (no checksum pass before it)."""
    import builtins

    path, _, _ = saved
    shard = path / "__0_0.distcp"
    opened, read = [], [0]
    real_open = builtins.open

    class Counted:
        def __init__(self, f):
            self._f = f

        def read(self, *args):
            data = self._f.read(*args)
            read[0] += len(data)
            return data

        def readinto(self, buffer):
            n = self._f.readinto(buffer)
            read[0] += n or 0
            return n

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def counting_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if str(file) == str(shard):
            opened.append(file)
            return Counted(f)
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    fresh, fresh_opt = _model_and_optimizer(1)
    Checkpointer().load(path, fresh, [fresh_opt])
    monkeypatch.undo()
    assert len(opened) == 1 and read[0] == shard.stat().st_size, (opened, read[0], shard.stat().st_size)
    assert _equal_state(saved[1], fresh)


def test_directory_without_manifest_is_not_a_checkpoint(saved):
    path, _, _ = saved
    (path / MANIFEST_NAME).unlink()
    fresh, _ = _model_and_optimizer(1)
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no manifest.json"):
        Checkpointer().load(path, fresh)


def test_files_outside_the_manifest_are_never_read(saved, tmp_path):
    path, _, _ = saved
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    del manifest["files"][META_NAME]
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"inconsistent: \['meta\.pt'\] are read but not listed"):
        Checkpointer().load(path, _model_and_optimizer(1)[0])
    with pytest.raises(CheckpointError, match="inconsistent"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt")


def test_strict_names_missing_and_unexpected_keys(saved):
    path, _, _ = saved
    other = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"missing keys \[3\.bias, 3\.weight\], unexpected keys \[\]"):
        Checkpointer().load(path, other, strict=True)
    with pytest.warns(UserWarning, match=r"non-strictly.*\[3\.bias, 3\.weight\] keep their current values"):
        Checkpointer().load(path, other, strict=False)
    assert torch.equal(other[0].weight, saved[1][0].weight)


def test_dtype_mismatch_is_an_error_not_a_cast(saved):
    path, _, _ = saved
    fresh, _ = _model_and_optimizer(1)
    fresh.to(torch.float64)
    with pytest.raises(
        CheckpointError, match=r"0\.weight: checkpoint torch\.float32, model torch\.float64.*never cast"
    ):
        Checkpointer().load(path, fresh)


def test_crafted_meta_pt_is_refused_even_with_a_matching_manifest(saved, tmp_path):
    path, _, _ = saved
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {shlex.quote(str(marker))}",))

    torch.save({"epoch": Payload()}, path / META_NAME)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    entry = hash_file(path / META_NAME)
    manifest["files"][META_NAME] = {"size": entry.size, "checksum": entry.checksum}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    fresh, _ = _model_and_optimizer(1)
    with pytest.raises(CheckpointError, match="Refusing to load"):
        Checkpointer().load(path, fresh)
    with pytest.raises(CheckpointError, match="Refusing to load"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt")
    assert not marker.exists()


def test_full_round_trip_writes_a_plain_lightning_file(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = tmp_path / "full.ckpt"
    Checkpointer().save_full(_lightning_checkpoint(model, opt, full=True), path)
    assert verify_checkpoint(path) is None
    plain = torch.load(path, weights_only=True)
    assert plain["optimizer_states"][0]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sorted(plain["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    fresh, fresh_opt = _model_and_optimizer(1)
    rest = Checkpointer().load(path, fresh, [fresh_opt])
    assert _equal_state(model, fresh) and rest["global_step"] == 12
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


def test_damaged_full_file_is_rejected(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = tmp_path / "full.ckpt"
    Checkpointer().save_full(_lightning_checkpoint(model, opt, full=True), path)
    with zipfile.ZipFile(path) as archive:  # flip a byte inside the largest tensor record
        info = max(archive.infolist(), key=lambda i: i.file_size)
        with archive.open(info) as member:
            member.read(1)
            data_start = member._fileobj.tell() - 1  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[data_start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"full\.ckpt is damaged: its member .* fails its CRC check"):
        Checkpointer().load(path, _model_and_optimizer(1)[0])


def test_consolidate_to_ckpt_and_safetensors(saved, tmp_path, capsys):
    path, model, opt = saved
    dst = consolidate_checkpoint(path, tmp_path / "out" / "model.ckpt", progress=True)
    assert "consolidate: wrote" in capsys.readouterr().err
    plain = torch.load(dst, weights_only=True)
    assert plain["epoch"] == 3 and plain["hyper_parameters"] == {"width": 7}
    assert all(torch.equal(plain["state_dict"][k], v) for k, v in model.state_dict().items())
    assert plain["optimizer_states"][0]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert torch.equal(plain["optimizer_states"][0]["state"][2]["exp_avg"], opt.state[model[2].weight]["exp_avg"])
    assert (
        consolidate_main([str(path), str(tmp_path / "model.safetensors"), "--format", "safetensors", "--no-progress"])
        == 0
    )
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_consolidate_cli_reports_errors(tmp_path, capsys):
    (tmp_path / "not_a_ckpt").mkdir()
    assert consolidate_main([str(tmp_path / "not_a_ckpt"), str(tmp_path / "x.ckpt")]) == 1
    err = capsys.readouterr().err
    assert "lightning-fsdp consolidate: error:" in err and "it has no manifest.json" in err
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_load_pretrained_single_process(tmp_path, suffix):
    model, _ = _model_and_optimizer(0)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, str(path))
    else:
        torch.save({"state_dict": model.state_dict()}, path)
    fresh, _ = _model_and_optimizer(1)
    if suffix == ".safetensors":
        with pytest.raises(
            CheckpointError, match=r"other dtypes than the model: \[0\.bias \(torch\.bfloat16 -> torch\.float32\)"
        ):
            load_pretrained(fresh, path, dtype_mismatch="error")
        with pytest.warns(UserWarning, match="converted to the model's dtypes"):
            report = load_pretrained(fresh, path)
        assert len(report.cast_keys) == 4
        assert torch.equal(fresh[0].weight, model[0].weight.to(torch.bfloat16).float())
    else:
        load_pretrained(fresh, path)
        assert _equal_state(model, fresh)
    bigger = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 1))
    with pytest.raises(CheckpointError, match=r"missing keys \[3\.bias, 3\.weight\]"):
        load_pretrained(bigger, path)


def test_crafted_pretrained_file_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {shlex.quote(str(marker))}",))

    torch.save({"state_dict": {"0.weight": Payload()}}, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match="Refusing to load"):
        load_pretrained(_model_and_optimizer(1)[0], tmp_path / "w.pt")
    assert not marker.exists()


def _agreeing_manifest(path, name: str, size: int, checksum: str) -> None:
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["files"][name] = {"size": size, "checksum": checksum}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("entry", ["symlink_to_dev_zero", "symlink_outside", "fifo", "fifo_manifest"])
def test_non_regular_entries_are_refused_without_reading_them(saved, tmp_path, entry):
    """Even with a manifest that agrees with them (sizes and checksums of what they would yield), a checkpoint is
    read only through regular files inside its directory: nothing blocks, nothing is restored."""
    path, model, _ = saved
    shard = path / "__0_0.distcp"
    if entry == "symlink_outside":
        outside = tmp_path / "elsewhere.distcp"
        outside.write_bytes(shard.read_bytes())  # the very same bytes: checksums agree
        shard.unlink()
        shard.symlink_to(outside)
        expected = "__0_0.distcp (a symlink)"
    elif entry == "symlink_to_dev_zero":
        shard.unlink()
        shard.symlink_to("/dev/zero")  # endless; stat says 0 bytes
        _agreeing_manifest(path, shard.name, 0, "00000000")  # the CRC-32 of nothing
        expected = "__0_0.distcp (a symlink)"
    elif entry == "fifo":
        shard.unlink()
        os.mkfifo(shard)  # opening it would block forever
        _agreeing_manifest(path, shard.name, 0, "00000000")
        expected = "__0_0.distcp (a FIFO)"
    else:
        manifest = path / MANIFEST_NAME
        manifest.unlink()
        os.mkfifo(manifest)  # even the manifest is never opened
        expected = "manifest.json (a FIFO)"
    fresh, fresh_opt = _model_and_optimizer(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"holds entries that are not regular files: {re.escape(expected)}"):
        Checkpointer().load(path, fresh, [fresh_opt])
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing restored
    with pytest.raises(CheckpointError, match="not regular files"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="not regular files"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt")


@pytest.mark.timeout(30)
def test_a_file_longer_than_its_manifest_says_is_refused_without_reading_past_it(saved):
    path, _, _ = saved
    shard = path / "__0_0.distcp"
    with open(shard, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp has \d+ bytes, the manifest says \d+"):
        Checkpointer().load(path, _model_and_optimizer(1)[0])


@pytest.mark.parametrize("algorithm", ["sha256", "crc32"])
def test_format_1_checkpoints_with_one_checksum_per_file_still_load(saved, algorithm):
    """Manifests of format 1 record one checksum per file: SHA-256 before the switch to CRC-32, then CRC-32. They
    verify as they are, each file in a pass before the load."""
    path, model, opt = saved
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["hash_algorithm"], manifest["format_version"] = algorithm, 1
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (path / name).stat().st_size, "checksum": hash_file(path / name, algorithm).checksum}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    fresh, _ = _model_and_optimizer(1)
    Checkpointer().load(path, fresh)
    assert _equal_state(model, fresh)
    assert json.loads((path / MANIFEST_NAME).read_text())["hash_algorithm"] == algorithm
    new = path.parent / "new.ckpt"
    Checkpointer().save_sharded(_lightning_checkpoint(model, opt), new)
    written = json.loads((new / MANIFEST_NAME).read_text())
    assert written["hash_algorithm"] == "crc32c" and written["format_version"] == 2
    assert len(written["files"]["__0_0.distcp"]["items"]) > 1  # one checksum per entry
