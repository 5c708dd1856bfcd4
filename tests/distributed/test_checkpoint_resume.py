"""Resume equivalence, resharding, consolidation and async saves with real gloo jobs.

Every job uses the same global batch (12) and data (48 samples, 4 steps per epoch), so a run at any world size
sees the same batches in the same order (Lightning's DistributedSampler deals contiguous slices of one shuffled
order). "2 epochs straight" is therefore one reference for every resumed run, at default fp32 tolerances.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_fsdp.checkpoint import verify_checkpoint
from lightning_fsdp.checkpoint.safe_load import read_metadata
from tests.helpers.models import TinyLM
from tests.scripts.ckpt_jobs import job

STEPS_PER_EPOCH = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def reference(workdir):
    """Two epochs, uninterrupted, on 2 ranks."""
    return job({"devices": 2, "max_epochs": 2}, workdir, "reference")


@pytest.fixture(scope="module")
def saved_on_4(workdir):
    """One epoch on 4 ranks, saved both as a sharded directory and as one full file."""
    result = job(
        {
            "devices": 4,
            "max_epochs": 1,
            "save_path": str(workdir / "four.ckpt"),
            "full_save_path": str(workdir / "four-full.ckpt"),
        },
        workdir,
        "saved_on_4",
    )
    result["sharded"] = workdir / "four.ckpt"
    result["full"] = workdir / "four-full.ckpt"
    return result


def assert_continues(first_losses, second, reference):
    """``first_losses`` then ``second`` equal the uninterrupted reference: per-step losses and final weights."""
    torch.testing.assert_close(torch.tensor(first_losses + second["losses"]), torch.tensor(reference["losses"]))
    assert second["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        torch.testing.assert_close(second["params"][name], ref, msg=lambda m, name=name: f"{name}: {m}")


def test_resume_from_last_in_fresh_processes(tmp_path, reference):
    """1 epoch with ModelCheckpoint(save_last, save_top_k=2 on train_loss, every 2 steps), then
    `fit(ckpt_path="last")` in new processes; the top-k pruning continues across the restart."""
    ckpts = tmp_path / "ckpts"
    kwargs = {"save_top_k": 2, "monitor": "train_loss", "every_n_train_steps": 2}
    spec = {"devices": 2, "checkpoint_dir": str(ckpts), "checkpoint_kwargs": kwargs}
    first = job({**spec, "max_epochs": 1}, tmp_path, "first")
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    second = job({**spec, "max_epochs": 2, "ckpt_path": "last"}, tmp_path, "second")
    assert second["global_step"] == 2 * STEPS_PER_EPOCH
    assert_continues(first["losses"], second, reference)
    losses = reference["losses"]
    assert losses[7] < losses[5] < losses[3] < losses[1]  # so the two best are the last two saves
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    for path in ckpts.iterdir():
        manifest = verify_checkpoint(path)
        assert manifest.world_size == 2 and manifest.target == path.name


@pytest.mark.parametrize(
    ("world", "source", "replicate"),
    [(1, "sharded", 1), (2, "full", 1), pytest.param(3, "sharded", 1, marks=pytest.mark.slow),
     pytest.param(4, "sharded", 2, marks=pytest.mark.slow)],
    ids=["1-sharded", "2-full", "3-sharded", "4-hsdp"],
)
def test_resume_at_another_world_size(tmp_path, reference, saved_on_4, world, source, replicate):
    """Saved on 4 ranks; resumed on 1, 2 (from the full file) or 3 ranks, or on a 2×2 HSDP mesh: resharded model
    and optimizer state."""
    torch.testing.assert_close(torch.tensor(saved_on_4["losses"]), torch.tensor(reference["losses"][:STEPS_PER_EPOCH]))
    spec = {"devices": world, "max_epochs": 2, "ckpt_path": str(saved_on_4[source])}
    if replicate > 1:
        spec["strategy_kwargs"] = {"replicate_size": replicate}
    second = job(spec, tmp_path, f"resume{world}")
    assert second["world_size"] == world and second["global_step"] == 2 * STEPS_PER_EPOCH
    assert_continues(saved_on_4["losses"], second, reference)


@pytest.mark.slow
def test_compiled_units_resume_from_an_eager_checkpoint_and_save_the_same_names(tmp_path, reference, saved_on_4):
    """compile=True changes no parameter name: a 4-rank eager checkpoint resumes into compiled units on 2 ranks and
    continues exactly (CPU inductor reproduces eager fp32), and what the compiled run saves has the eager keys."""
    spec = {"devices": 2, "max_epochs": 2, "ckpt_path": str(saved_on_4["sharded"]),
            "strategy_kwargs": {"compile": True}, "save_path": str(tmp_path / "compiled.ckpt")}
    second = job(spec, tmp_path, "compiled")
    assert second["global_step"] == 2 * STEPS_PER_EPOCH
    assert_continues(saved_on_4["losses"], second, reference)
    keys = set(read_metadata(tmp_path / "compiled.ckpt").state_dict_metadata)
    assert keys == set(read_metadata(saved_on_4["sharded"]).state_dict_metadata)


def test_consolidated_checkpoint_loads_in_a_plain_process(tmp_path, saved_on_4, capsys):
    """`lightning-fsdp consolidate` of the 4-rank checkpoint (the command's entry function, run here: the e2e tests
    run the installed command): `load_from_checkpoint` and `weights_only` load it, its weights are the gathered
    weights, and it holds what the full save holds (integer-keyed optimizer state)."""
    from lightning_fsdp.commands.consolidate import main as consolidate

    dst = tmp_path / "model.ckpt"
    for args in (
        [str(saved_on_4["sharded"]), str(dst)],
        [str(saved_on_4["sharded"]), str(tmp_path / "w.safetensors"), "--format", "safetensors"],
    ):
        assert consolidate(args) == 0
        assert "consolidate: wrote" in capsys.readouterr().err
    model = TinyLM.load_from_checkpoint(dst)
    gathered = saved_on_4["params"]
    state = model.state_dict()
    assert state.keys() == gathered.keys()
    for name, value in gathered.items():
        assert torch.equal(state[name], value), name
    plain = torch.load(dst, weights_only=True)
    full = torch.load(saved_on_4["full"], weights_only=True)
    assert plain["global_step"] == full["global_step"] == STEPS_PER_EPOCH and plain["epoch"] == full["epoch"]
    assert plain["loops"] == full["loops"] and plain["hyper_parameters"] == full["hyper_parameters"]
    for ours, theirs in zip(plain["optimizer_states"], full["optimizer_states"]):
        assert ours["param_groups"] == theirs["param_groups"]
        assert ours["state"].keys() == theirs["state"].keys() and all(isinstance(k, int) for k in ours["state"])
        for pid, values in theirs["state"].items():
            for key, value in values.items():
                assert torch.equal(ours["state"][pid][key], value), (pid, key)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "w.safetensors"))
    assert weights.keys() == gathered.keys() and all(torch.equal(weights[k], v) for k, v in gathered.items())


def test_async_save_prunes_after_commit_and_resumes_exactly(tmp_path, reference):
    """Async saves every step (save_top_k=1 prunes the previous one each time): what remains is committed and
    complete, nothing half-written is left, and resuming from it continues exactly."""
    ckpts = tmp_path / "ckpts"
    spec = {
        "devices": 2,
        "strategy_kwargs": {"async_save": True},
        "checkpoint_dir": str(ckpts),
        "checkpoint_kwargs": {"every_n_train_steps": 1, "save_top_k": 1},
    }
    first = job({**spec, "max_epochs": 1}, tmp_path, "first")
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    for path in ckpts.iterdir():
        verify_checkpoint(path)
    assert json.loads((ckpts / "last.ckpt" / "manifest.json").read_text())["world_size"] == 2
    second = job({**spec, "max_epochs": 2, "ckpt_path": "last"}, tmp_path, "second")
    assert_continues(first["losses"], second, reference)
