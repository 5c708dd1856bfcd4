"""Manifest format, checksums computed while writing, file assignment for parallel verification."""

from __future__ import annotations

import json

import pytest

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.checksums import FileEntry, FileRecords, HashingWriter, hash_file
from lightning_fsdp.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    assign_files,
    build_manifest,
    check_files,
    read_manifest,
)


def _manifest(files):
    return build_manifest(
        files, world_size=4, mesh=(1, 4), state_dict_type="sharded", target="last.ckpt", save_id="abc"
    )


def test_manifest_json_round_trip():
    manifest = _manifest({"__0_0.distcp": FileEntry(10, "aa"), ".metadata": FileEntry(3, "bb")})
    parsed = Manifest.from_json(manifest.to_json())
    assert parsed == manifest
    data = json.loads(manifest.to_json())
    assert data["format_version"] == FORMAT_VERSION and data["world_size"] == 4 and data["target"] == "last.ckpt"
    assert set(data["versions"]) >= {"torch", "lightning"}
    assert parsed.total_bytes == 13


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps({**d, "format": "other"}), "format is 'other'"),
        (lambda d: json.dumps({**d, "format_version": FORMAT_VERSION + 1}), "upgrade lightning_fsdp"),
        (lambda d: json.dumps({**d, "files": {"../escape": {"size": 1, "checksum": "x"}}}), "not a plain file name"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "world_size"}), "world_size"),
        (lambda d: json.dumps({**d, "hash_algorithm": "rot13"}), "unknown hash_algorithm"),
    ],
)
def test_invalid_manifests_are_rejected(edit, message):
    data = json.loads(_manifest({"a": FileEntry(1, "x")}).to_json())
    with pytest.raises(CheckpointError, match=message):
        Manifest.from_json(edit(data), "ckpt/manifest.json")


def test_hashing_writer_records_what_reaches_the_file(tmp_path):
    records = FileRecords()
    with HashingWriter(tmp_path / "a.bin", records.record) as f:
        f.write(b"hello ")
        f.write(memoryview(bytearray(b"world")))
        assert f.tell() == 11
    assert records.snapshot() == {"a.bin": hash_file(tmp_path / "a.bin")}
    assert records.snapshot()["a.bin"].size == 11
    failed = HashingWriter(tmp_path / "b.bin", records.record)
    failed.write(b"partial")
    failed.abort()
    assert "b.bin" not in records.snapshot()
    records.rename(tmp_path / "a.bin", tmp_path / "c.bin")
    assert set(records.snapshot()) == {"c.bin"}


def test_assign_files_is_deterministic_balanced_and_complete():
    sizes = {f"__{r}_0.distcp": 1000 + r for r in range(5)} | {".metadata": 10, "meta.pt": 20}
    for world in (1, 2, 3, 8):
        parts = assign_files(sizes, world)
        assert parts == assign_files(dict(reversed(list(sizes.items()))), world)
        assert sorted(n for p in parts for n in p) == sorted(sizes)
        loads = [sum(sizes[n] for n in p) for p in parts]
        assert max(loads) - min(loads) <= max(sizes.values())
    with pytest.raises(ValueError):
        assign_files(sizes, 0)


def test_check_files_names_every_problem(tmp_path):
    for name, data in {"ok": b"1234", "flipped": b"abcd", "short": b"abcdef"}.items():
        (tmp_path / name).write_bytes(data)
    manifest = _manifest({n: hash_file(tmp_path / n) for n in ("ok", "flipped", "short")} | {"gone": FileEntry(1, "0")})
    (tmp_path / "flipped").write_bytes(b"abce")
    (tmp_path / "short").write_bytes(b"abc")
    problems = check_files(tmp_path, manifest, sorted(manifest.files))
    assert problems == [
        "flipped fails its crc32c checksum (the file was modified or damaged)",
        "gone is missing",
        "short has 3 bytes, the manifest says 6 (truncated or overwritten)",
    ]
    assert check_files(tmp_path, manifest, ["flipped"], checksums=False) == []


def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path):
    (tmp_path / "x.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no manifest.json"):
        read_manifest(tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_manifest(tmp_path / "missing.ckpt")
