"""Checkpoints from another tool: Lightning's ``ModelParallelStrategy`` (the module shards itself) writes a DCP
directory; ``fsdp_custom`` refuses it until ``lightning-fsdp seal``; then it resumes at 2 and at 1 rank exactly as
continuing with ``ModelParallelStrategy`` does. ``verify`` and ``inspect`` on good, damaged and foreign checkpoints.

Three training launches in all: the ModelParallel run (its steps 5-8 are the "continue on the original strategy"
reference) and the two resumes; everything else runs the commands in one process.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from lightning_fsdp.checkpoint import CheckpointError, verify_checkpoint
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME, META_NAME, read_manifest
from tests.helpers.launch import REPO, child_env, train

GLOBAL_BATCH = 8
STEPS = 8
MODEL = {"shard_myself": True}


def cli(*args, timeout=120):
    """``lightning-fsdp ARGS`` as a user runs it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "lightning_fsdp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=REPO)


def cli_here(*args):
    """The same command's ``main`` in this process (what the entry point calls), without a start-up per call."""
    import contextlib
    import io

    from lightning_fsdp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("seal")


@pytest.fixture(scope="module")
def model_parallel(workdir):
    """8 steps on 2 ranks with ModelParallelStrategy, a DCP checkpoint after step 4 (its own format, no manifest)."""
    ckpts = workdir / "mp"
    spec = {"strategy": "model_parallel", "devices": 2, "batch_size": GLOBAL_BATCH // 2, "max_steps": STEPS,
            "model": MODEL, "checkpoint_dir": str(ckpts),
            "checkpoint_kwargs": {"every_n_train_steps": 4, "save_top_k": -1, "save_last": False}}
    result = train(spec, workdir, "mp")
    result["step4"] = ckpts / "epoch=0-step=4.ckpt"
    assert (result["step4"] / ".metadata").is_file() and not (result["step4"] / MANIFEST_NAME).exists()
    return result


@pytest.fixture(scope="module")
def sealed(workdir, model_parallel):
    """A copy of the step-4 checkpoint, sealed with the command."""
    path = workdir / "sealed.ckpt"
    shutil.copytree(model_parallel["step4"], path)
    proc = cli("seal", path)
    assert proc.returncode == 0, proc.stderr
    assert "sealed" in proc.stdout and "2 rank(s)" in proc.stdout
    return path


def test_unsealed_directory_is_refused_with_the_fix_named(model_parallel):
    with pytest.raises(CheckpointError, match=r"lightning-fsdp seal .*epoch=0-step=4\.ckpt"):
        read_manifest(model_parallel["step4"])
    proc = cli_here("verify", model_parallel["step4"])
    assert proc.returncode == 1 and "NOT OK" in proc.stderr and "lightning-fsdp seal" in proc.stderr
    proc = cli_here("inspect", model_parallel["step4"], "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["sealed"] is False and info["fix"].startswith("lightning-fsdp seal")
    assert info["global_step"] == 4 and info["tensors"]["model"]["tensors"] > 0


@pytest.mark.parametrize("world", [2, 1])
def test_sealed_model_parallel_checkpoint_resumes_with_fsdp_custom_like_continuing(workdir, model_parallel, sealed,
                                                                                     world):
    resumed = train({"strategy": "fsdp_custom", "devices": world, "batch_size": GLOBAL_BATCH // world,
                     "max_steps": STEPS, "model": MODEL, "ckpt_path": str(sealed)}, workdir, f"resumed{world}")
    assert resumed["global_step"] == STEPS
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(model_parallel["losses"][4:]))
    assert resumed["params"].keys() == model_parallel["params"].keys()
    for name, value in model_parallel["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, msg=lambda m, n=name: f"{n}: {m}")


def test_seal_checks_completeness_and_never_twice(tmp_path, model_parallel, sealed):
    partial = tmp_path / "partial.ckpt"
    shutil.copytree(model_parallel["step4"], partial)
    next(partial.glob("__1_*.distcp")).unlink()
    proc = cli_here("seal", partial)
    assert proc.returncode == 1 and "not a complete DCP checkpoint" in proc.stderr and "__1_0.distcp is missing" in proc.stderr
    assert not (partial / MANIFEST_NAME).exists()
    no_metadata = tmp_path / "unfinished.ckpt"
    shutil.copytree(model_parallel["step4"], no_metadata)
    (no_metadata / ".metadata").unlink()
    proc = cli_here("seal", no_metadata)
    assert proc.returncode == 1 and "has no .metadata" in proc.stderr
    proc = cli_here("seal", sealed)
    assert proc.returncode == 1 and "already has a manifest.json" in proc.stderr


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("target", [pytest.param(".metadata", marks=pytest.mark.slow), META_NAME])
def test_crafted_pickle_runs_no_code_when_sealed_or_loaded(tmp_path, model_parallel, sealed, target):
    """Sealing reads every pickle with the restricted unpickler; a sealed directory whose pickle was replaced and
    whose manifest was rewritten to match (the checksums agree) still runs no code when inspected or loaded."""
    marker = tmp_path / "pwned"
    foreign = tmp_path / "foreign.ckpt"
    shutil.copytree(model_parallel["step4"], foreign)
    (foreign / target).write_bytes(pickle.dumps(_RunsCode(marker)))
    proc = cli_here("seal", foreign)
    assert proc.returncode == 1 and "Refusing to load" in proc.stderr and "executed" in proc.stderr
    assert not marker.exists() and not (foreign / MANIFEST_NAME).exists()

    copy = tmp_path / "sealed.ckpt"
    shutil.copytree(sealed, copy)
    (copy / target).write_bytes(pickle.dumps(_RunsCode(marker)))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    from lightning_fsdp.checkpoint.checksums import hash_file

    entry = hash_file(copy / target)
    manifest["files"][target] = {"size": entry.size, "checksum": entry.checksum}
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    verify_checkpoint(copy)  # the checksums agree: only the unpickler stands in the way
    for command in (("inspect", copy), ("consolidate", copy, tmp_path / "out.ckpt")):
        proc = cli_here(*command)
        assert proc.returncode != 0 and "Refusing to load" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_verify_and_inspect_good_and_damaged(tmp_path, sealed):
    proc = cli("verify", sealed)
    assert proc.returncode == 0 and ": OK (" in proc.stdout and "checksums match" in proc.stdout, proc.stderr
    proc = cli_here("inspect", sealed)
    assert proc.returncode == 0, proc.stderr
    assert "sharded directory" in proc.stdout and "saved on 2 rank(s)" in proc.stdout and "global step 4" in proc.stdout
    info = json.loads(cli_here("inspect", sealed, "--json").stdout)
    assert info["sealed"] and info["world_size"] == 2 and info["global_step"] == 4 and info["epoch"] == 0
    assert info["checksum"] == "crc32c" and info["files"] == len(list(sealed.iterdir())) - 1
    assert set(info["tensors"]) == {"model", "optimizer 0"}
    assert info["not_optimized"] == ["net.head.weight"]  # tied to net.emb.weight: it has no optimizer state of its own
    assert "torch" in info["versions"]

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(sealed, damaged)
    shard = next(damaged.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = cli_here("verify", damaged)
    assert proc.returncode == 1 and f"{shard.name} fails its crc32c checksum" in proc.stderr
    assert cli_here("verify", damaged, "--no-checksums").returncode == 0  # the quick check: sizes only
    shard.write_bytes(bytes(data[:-10]))
    proc = cli_here("verify", damaged, "--no-checksums")
    assert proc.returncode == 1 and "truncated or overwritten" in proc.stderr



@pytest.mark.slow
def test_verify_and_inspect_a_ckpt_file(tmp_path, sealed):
    """A full .ckpt (here the consolidated sealed checkpoint): intact, described from its structure; a changed
    byte fails the archive's CRCs."""
    ckpt = tmp_path / "model.ckpt"
    assert cli("consolidate", sealed, ckpt).returncode == 0
    proc = cli("verify", ckpt)
    assert proc.returncode == 0 and "OK (archive CRCs intact)" in proc.stdout, proc.stderr
    info = json.loads(cli("inspect", ckpt, "--json").stdout)
    assert info["kind"] == "full file" and info["global_step"] == 4
    assert info["tensors"]["model"]["tensors"] == 38 and set(info["tensors"]) == {"model", "optimizer 0"}
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    proc = cli("verify", ckpt)
    assert proc.returncode == 1 and "NOT OK" in proc.stderr
