"""``Fabric(strategy="fsdp_custom")`` in a hand-written loop, run for real: Fabric's own launcher starts gloo ranks,
a Hugging Face Llama is built with ``AutoModelForCausalLM.from_config`` under ``fabric.init_module(empty_init=True)``
and started from ``fabric.load_raw(<full state file>)`` (``tests/scripts/fabric_loop.py``).

One 2-rank job is asserted many ways: losses, clipped gradient norms and final parameters equal a one-process Fabric
run on the same global batches (fp32 default tolerances); each rank holds 1/2 of the parameters; ``fabric.setup``
with an optimizer built before sharding, resumed with ``fabric.load`` at step 2, equals the uninterrupted run;
``no_backward_sync`` accumulation skips the first micro-batch's reduce-scatters and matches too; a damaged
checkpoint is refused on every rank, naming the file. A 1-rank job resumes the 2-rank checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.hf import write_llama
from tests.helpers.launch import SCRIPTS, run_python
from tests.helpers.parity import assert_params_up_to_adam_noise

pytest.importorskip("transformers")

BASE = {"steps": 4, "global_batch": 8, "seq": 16, "lr": 1e-3, "clip": 0.5}


def fabric_job(spec: dict[str, Any], tmp_path: Path, name: str, timeout: float = 240) -> dict[str, Any]:
    spec = {**spec, "out": str(tmp_path / f"{name}.json")}
    spec_path = tmp_path / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = run_python([str(SCRIPTS / "fabric_loop.py"), str(spec_path)], timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(Path(spec["out"]).read_text())
    for result in results.values():
        result["params"] = torch.load(result["params_path"], weights_only=True)
    return results


def assert_same_run(actual: dict[str, Any], expected: dict[str, Any], losses: bool = True) -> None:
    if losses:
        torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]))
    torch.testing.assert_close(torch.tensor(actual["norms"]), torch.tensor(expected["norms"]))
    assert actual["params"].keys() == expected["params"].keys()
    for key, value in expected["params"].items():
        torch.testing.assert_close(actual["params"][key], value, msg=lambda m, key=key: f"{key}: {m}")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, str]:
    """A Llama directory (its config) and the full state file the loops start from."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fabric")
    model_dir = write_llama(root / "llama")
    torch.save(AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), root / "full.pt")
    return {"model_dir": str(model_dir), "raw_state": str(root / "full.pt")}


@pytest.fixture(scope="module")
def reference(model_files, tmp_path_factory) -> dict[str, Any]:
    """One process, Fabric's default strategy, the whole global batch per step."""
    spec = {**BASE, **model_files, "devices": 1, "strategy": "auto", "runs": [{"name": "reference", "average": 0.5}]}
    return fabric_job(spec, tmp_path_factory.mktemp("reference"), "reference")["reference"]


@pytest.fixture(scope="module")
def two_ranks(model_files, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("two")
    checkpoint = str(root / "ckpt" / "step2.ckpt")
    runs = [
        {"name": "straight", "save_at": 2, "save": checkpoint, "average": 0.5},
        {"name": "resumed", "joint_setup": True, "resume": checkpoint, "damaged": checkpoint},
        {"name": "accumulated", "accumulate": 2},
        {"name": "from_hf_dir", "raw": model_files["model_dir"], "frozen_copy": True},
        {"name": "preempted", "signal_rank": 1, "signal_at": 1, "save": str(root / "ckpt" / "preempted.ckpt")},
    ]
    results = fabric_job({**BASE, **model_files, "devices": 2, "strategy": "fsdp_custom", "runs": runs}, root, "two")
    results["checkpoint"] = checkpoint
    results["preempted_checkpoint"] = str(root / "ckpt" / "preempted.ckpt")
    return results


def test_two_ranks_equal_one_process(two_ranks, reference):
    assert_same_run(two_ranks["straight"], reference)


def test_context_parallel_in_a_fabric_loop_equals_one_process(model_files, reference, tmp_path):
    """``FSDPCustomFabricStrategy(context_parallel=2)``: both ranks read the whole global batch, split each row with
    ``fabric.strategy.sequence_split`` and train through ring attention, as one process on whole sequences."""
    spec = {**BASE, **model_files, "devices": 2, "strategy": "fsdp_custom", "strategy_kwargs": {"context_parallel": 2},
            "runs": [{"name": "context"}]}
    run = fabric_job(spec, tmp_path, "context")["context"]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]))
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(reference["norms"]))
    assert_params_up_to_adam_noise(run["params"], reference["params"], BASE["lr"])


def test_sharded_average_in_a_fabric_loop_equals_one_process(two_ranks, reference):
    """``ShardedAverage`` without a Trainer: each rank averages its own shards (half the bytes each), and the
    average swapped into the model equals the one-process average."""
    run = two_ranks["straight"]
    ours, expected = (torch.load(r["average_path"], weights_only=True) for r in (run, reference))
    assert ours.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, msg=lambda m, key=key: f"{key}: {m}")
    assert len(run["average_bytes"]) == 2 and max(run["average_bytes"]) <= 0.51 * sum(run["average_bytes"])
    assert any(not torch.equal(ours[k], run["params"][k]) for k in ours)  # an average, not the last weights


def test_load_raw_of_the_hf_directory_equals_load_raw_of_the_full_state_file(two_ranks):
    """Each rank reads only its shards of the safetensors files; the run is the one started from the .pt file."""
    assert_same_run(two_ranks["from_hf_dir"], two_ranks["straight"])


def test_each_rank_holds_half_the_parameters(two_ranks):
    run = two_ranks["straight"]
    assert len(run["local_bytes"]) == 2
    assert sum(run["local_bytes"]) == run["full_bytes"]
    assert max(run["local_bytes"]) <= 0.51 * run["full_bytes"]


def test_resume_with_fabric_load_equals_the_uninterrupted_run(two_ranks):
    resumed, straight = two_ranks["resumed"], two_ranks["straight"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][2:]))
    torch.testing.assert_close(torch.tensor(resumed["norms"]), torch.tensor(straight["norms"][2:]))
    for key, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][key], value)
    assert resumed["remainder"] == ["note"]  # what `state` did not ask for comes back; our own entries do not


def test_a_frozen_copy_reads_only_each_ranks_shards(two_ranks):
    """DPO's and GRPO's ``reference="copy"`` through ``fabric.strategy``: sharded like the model (each rank holds
    half the file's bytes, not the whole model as a plain load would), frozen, and equal to the files."""
    held = two_ranks["from_hf_dir"]["frozen_copy"]
    assert held["equals_files"] and not held["trainable"]
    assert all(b <= held["full_bytes"] / 2 * 1.05 for b in held["local_bytes"]), held
    assert sum(held["local_bytes"]) >= held["full_bytes"]


def test_no_backward_sync_accumulates_without_reduce_scatter(two_ranks, reference):
    accumulated, straight = two_ranks["accumulated"], two_ranks["straight"]
    # two micro-batches per step, one reduce-scatter per FSDP unit: as many as one un-accumulated step
    assert accumulated["reduce_scatters"] == straight["reduce_scatters"]
    assert all(n > 0 for n in straight["reduce_scatters"])
    assert_same_run(accumulated, reference, losses=False)  # the loss logged is the last micro-batch's


def test_damaged_checkpoint_is_refused_on_every_rank(two_ranks):
    refusals = two_ranks["resumed"]["refusals"]
    assert len(refusals) == 2
    for message in refusals:
        assert message.startswith("CheckpointError") and "damaged" in message and ".distcp" in message, message


def test_one_rank_resumes_the_two_rank_checkpoint(two_ranks, model_files, tmp_path):
    runs = [{"name": "resumed", "resume": two_ranks["checkpoint"]}]
    spec = {**BASE, **model_files, "devices": 1, "strategy": "fsdp_custom", "runs": runs}
    resumed = fabric_job(spec, tmp_path, "one")["resumed"]
    straight = two_ranks["straight"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][2:]))
    for key, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][key], value)


@pytest.mark.slow
def test_four_ranks_equal_one_process(model_files, reference, tmp_path):
    spec = {**BASE, **model_files, "devices": 4, "strategy": "fsdp_custom", "runs": [{"name": "run"}]}
    four = fabric_job(spec, tmp_path, "four")["run"]
    assert_same_run(four, reference)
    assert max(four["local_bytes"]) <= 0.26 * four["full_bytes"]


@pytest.mark.slow
def test_bf16_mixed_agrees_with_one_process(model_files, tmp_path):
    """bf16-mixed: FSDP2 gathers bf16 parameters and reduces fp32 gradients; one process autocasts. They agree to
    bf16's resolution, as the Trainer path's bf16 parity does."""
    spec = {**BASE, **model_files, "precision": "bf16-mixed", "runs": [{"name": "run"}]}
    two = fabric_job({**spec, "devices": 2, "strategy": "fsdp_custom"}, tmp_path, "two")["run"]
    one = fabric_job({**spec, "devices": 1, "strategy": "auto"}, tmp_path, "one")["run"]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(torch.tensor(two["norms"]), torch.tensor(one["norms"]), rtol=2e-2, atol=2e-2)
    # Adam moves a weight by about lr per step whatever its gradient's size, so where bf16 rounding flips the sign of
    # a near-zero gradient the two runs may differ by up to 2·lr per step
    bound = 2 * BASE["lr"] * BASE["steps"]
    for key, value in one["params"].items():
        torch.testing.assert_close(two["params"][key], value, rtol=2e-2, atol=bound)
    differs = sum(int((two["params"][k] - v).abs().gt(2e-3).sum()) for k, v in one["params"].items())
    assert differs <= 0.01 * sum(v.numel() for v in one["params"].values())  # and that happens to few weights


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(two_ranks):
    from lightning_fsdp.checkpoint import verify_checkpoint

    assert two_ranks["preempted"]["stopped_at"] == [1, 1]  # rank 1 was signalled after step 1; both stop there
    verify_checkpoint(two_ranks["preempted_checkpoint"])  # and the checkpoint saved on the way out is intact


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_every_rank_with_its_traceback(model_files, tmp_path):
    import time

    spec = {**BASE, **model_files, "devices": 2, "strategy": "fsdp_custom", "out": str(tmp_path / "fail.json"),
            "runs": [{"name": "failing", "raise_rank": 1}]}
    (tmp_path / "fail.spec.json").write_text(json.dumps(spec))
    start = time.monotonic()
    proc = run_python([str(SCRIPTS / "fabric_loop.py"), str(tmp_path / "fail.spec.json")], timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 90  # not the collective timeout (1800 s)
    assert "RuntimeError: a bug on rank 1 at step 0" in proc.stderr
    # the failure relay, not a gloo connection error, ends rank 0, naming the rank that failed first
    assert "[rank 0] stopping: rank 1 failed with RuntimeError: a bug on rank 1 at step 0" in proc.stderr
