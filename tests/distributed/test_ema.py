"""Sharded EMA: ``lightning_fsdp.ShardedEMA`` under ``fsdp_custom`` equals Lightning's own ``EMAWeightAveraging`` in
one process on the same global batches, keeps 1/N of the average per rank, and survives save, resume at another
world size (4 → 2), full ``.ckpt`` files and export.

After ``fit`` both callbacks leave the average in the model, so the final (gathered) weights compared here *are*
the averages; the per-step losses compare the weights being trained. Four launches in all, shared by the tests.
"""

from __future__ import annotations


import pytest
import torch

from tests.helpers.launch import train

GLOBAL_BATCH = 8
STEPS = 8
EMA = {"decay": 0.9}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("ema")


@pytest.fixture(scope="module")
def reference(workdir):
    """One process, Lightning's EMAWeightAveraging, 8 steps."""
    spec = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "ema": EMA}
    return train(spec, workdir, "reference")


def _sharded(workdir, world, name, **extra):
    spec = {"strategy": "fsdp_custom", "devices": world, "batch_size": GLOBAL_BATCH // world, "max_steps": STEPS,
            "ema": EMA, **extra}
    return train(spec, workdir, name)


@pytest.fixture(scope="module")
def four(workdir):
    """4 ranks, sharded checkpoints after steps 4 and 8 (during fit: they hold the trained weights and the average)."""
    ckpts = workdir / "four"
    result = _sharded(workdir, 4, "four", checkpoint_dir=str(ckpts),
                      checkpoint_kwargs={"every_n_train_steps": 4, "save_top_k": -1})
    result["step4"], result["step8"] = ckpts / "epoch=0-step=4.ckpt", ckpts / "epoch=0-step=8.ckpt"
    return result


def assert_same_params(result, reference, keys=None):
    keys = keys or reference["params"].keys()
    for name in keys:
        torch.testing.assert_close(result["params"][name], reference["params"][name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # CI: the 2-rank cases cover the sharded average by default
def test_sharded_ema_at_four_ranks_equals_lightning_ema_with_a_quarter_per_rank(four, reference):
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(reference["losses"]))
    assert four["params"].keys() == reference["params"].keys()
    assert_same_params(four, reference)
    # each rank holds exactly its shards of the average: the same bytes as its parameter shards, 1/N of the whole
    params_per_rank = [row[0] for row in four["state_bytes"]]
    assert four["ema_bytes"] == params_per_rank
    full_bytes = sum(v.numel() * 4 for k, v in four["params"].items() if k != "net.head.weight")  # head tied to emb
    assert sum(four["ema_bytes"]) == full_bytes
    assert max(four["ema_bytes"]) <= full_bytes / 4 * 1.3


def test_sharded_ema_at_two_ranks_in_cpu_memory_equals_lightning_ema(workdir, reference):
    two = _sharded(workdir, 2, "two", ema={**EMA, "device": "cpu"})
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(reference["losses"]))
    assert_same_params(two, reference)
    assert two["ema_devices"] == ["cpu"]


@pytest.mark.slow
def test_ema_resumes_resharded_from_four_ranks_to_two_and_saves_full_files(workdir, four, reference):
    """Resume the 4-rank step-4 checkpoint on 2 ranks: the average continues exactly; its full-format saves hold
    the average as plain tensors under ``ema_state_dict``."""
    ckpts = workdir / "two-full"
    resumed = _sharded(workdir, 2, "resumed", ckpt_path=str(four["step4"]), checkpoint_dir=str(ckpts),
                       checkpoint_kwargs={"every_n_train_steps": 4, "save_top_k": -1},
                       strategy_kwargs={"state_dict_type": "full"})
    assert resumed["global_step"] == STEPS
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][4:]))
    assert_same_params(resumed, reference)
    full = torch.load(ckpts / "epoch=0-step=8.ckpt", weights_only=True)
    average = full["ema_state_dict"]
    assert set(average) == set(reference["params"])  # the tied head too: a drop-in state_dict
    for name, value in average.items():
        torch.testing.assert_close(value, reference["params"][name], msg=lambda m, n=name: f"{n}: {m}")
    assert full["callbacks"]["ShardedEMA"]["n_averaged"] == STEPS


def _consolidate(*args) -> int:
    """The command's own entry function, in this process (a process start-up costs more than the export)."""
    from lightning_fsdp.commands.consolidate import main

    return main([str(a) for a in args])


def test_consolidate_exports_the_average(tmp_path, four, reference):
    """`consolidate --weights ema` writes the average (what the model holds after fit); without it, the trained
    weights at that step, which are not the average."""
    from safetensors.torch import load_file

    assert _consolidate(four["step8"], tmp_path / "ema.safetensors", "--format", "safetensors", "--weights", "ema") == 0
    ema = load_file(str(tmp_path / "ema.safetensors"))
    assert set(ema) == set(reference["params"])
    for name, value in ema.items():
        torch.testing.assert_close(value, reference["params"][name], msg=lambda m, n=name: f"{n}: {m}")
    assert _consolidate(four["step8"], tmp_path / "model.safetensors", "--format", "safetensors") == 0
    trained = load_file(str(tmp_path / "model.safetensors"))
    assert not torch.equal(trained["net.emb.weight"], ema["net.emb.weight"])
