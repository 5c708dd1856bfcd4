"""The benchmark harness runs end to end at tiny size: fresh processes per peer, a report with every ratio, plots.

No timing is asserted: on a shared machine the numbers are noise at this size. What must hold is structural:
every peer ran, the sharded peers hold half the state per rank at two ranks, the collective counter saw FSDP's
all-gathers and reduce-scatters (and DDP's all-reduce), and the report and plots were written.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.launch import REPO, run_python


@pytest.mark.slow
def test_quick_benchmark_writes_tables_and_plots(tmp_path):
    out = tmp_path / "results"
    proc = run_python([str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    data = json.loads((out / "raw.json").read_text())
    runs = {r["spec"]["peer"]: r for r in data["runs"]}
    assert set(runs) == {"single", "fsdp_custom", "mp_fsdp2", "ddp"}
    assert all(r["ok"] for r in runs.values()), [r.get("log_tail") for r in runs.values() if not r["ok"]]
    assert data["meta"]["environment"]["torch"].split("+")[0] in sys.modules["torch"].__version__

    for peer in ("fsdp_custom", "mp_fsdp2"):
        run = runs[peer]
        assert run["world"] == 2 and len(run["per_rank"]) == 2
        state = max(r["params"] + r["grads"] + r["optimizer"] for r in run["per_rank"])
        assert state <= 1.02 * run["unsharded"]["total"] / 2  # sharded: half the state per rank
        comm = run["collective_bytes_per_step"]
        assert comm["all_gather_single"] > 0 and comm["reduce_scatter_single"] == run["param_bytes"]
        assert run["checkpoint"]["bytes"] > 0 and run["checkpoint"]["save_s"] > 0
    ddp = runs["ddp"]
    assert ddp["collective_bytes_per_step"]["all_reduce"] >= ddp["param_bytes"]  # one all-reduce of every gradient
    assert all(r["peak"] > 0 for run in runs.values() for r in run["per_rank"])

    report = (out / "RESULTS.md").read_text()
    for text in ("## Headline", "## Targets", "## Checkpoint save and load", "## Memory planner against the measurements",
                 "fsdp_custom", "ModelParallelStrategy + hand-written fully_shard", "DDP", "single process (reference)",
                 "× MP", "× 3·params", "torch 2.13"):
        assert text in report, text
    assert "## Headline" not in (out / "headline.md").read_text()  # the bare table, for the project README
    for image in ("memory_per_rank_vs_world.png", "step_time_vs_model_size.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_hf_load_benchmark_runs_every_peer(tmp_path):
    pytest.importorskip("transformers")
    proc = run_python([str(REPO / "benchmarks" / "hf_load.py"), "--quick", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "hf_load_quick.json").read_text())
    assert set(data["results"]["2"]) == {"sharded", "broadcast", "from_pretrained"}
    assert all(len(rows) == 2 and all(r["seconds"] > 0 for r in rows) for rows in data["results"]["2"].values())


@pytest.mark.slow
def test_quick_checkpoint_io_benchmark_times_every_peer_and_phase(tmp_path):
    proc = run_python([str(REPO / "benchmarks" / "checkpoint_io.py"), "--quick", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "checkpoint_io_quick.json").read_text())
    result = data["tiny, 2"]
    assert len(result["ranks"]) == 2
    rows = result["ranks"][0]
    ops = {(row["op"], row["peer"]) for row in rows}
    assert {("save", "ours"), ("save", "dcp"), ("load (warm)", "ours"), ("load (warm)", "ours_two_pass"),
            ("load (warm)", "dcp")} <= ops
    phases = {row["peer"]: row["phases"] for row in rows if row["op"] == "load (warm)"}
    assert phases["ours"]["load: DCP read + verification"] > 0 and phases["ours"]["CRC-32C"] > 0
    assert phases["dcp"] == {}  # the peer runs none of our code
    save = next(row["phases"] for row in rows if row["op"] == "save" and row["peer"] == "ours")
    assert save["save: DCP write + hashing"] > 0 and save["fsync"] > 0
    text = (tmp_path / "checkpoint_io_quick.md").read_text()
    assert "ours × dcp" in text and "Where our time goes" in text


@pytest.mark.slow
def test_quick_activation_offload_benchmark_moves_activations_and_changes_nothing(tmp_path):
    """On CPU through ``copy_on_cpu``: every configuration ran, the offloaded steps equal the plain ones exactly, and
    checkpointing leaves less to move (only the blocks' inputs are saved)."""
    proc = run_python([str(REPO / "benchmarks" / "activation_offload.py"), "--quick", "--out", str(tmp_path)],
                      timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads((tmp_path / "activation_offload_quick_cpu.json").read_text())["rows"]
    assert [(r["checkpointing"], r["mode"]) for r in rows] == [
        (c, m) for c in (False, True) for m in ("none", "ActivationOffload", "save_on_cpu")]
    assert all(r["max_diff"] == 0.0 for r in rows)
    moved = {r["checkpointing"]: r["offloaded_mib_per_step"] for r in rows if r["mode"] == "ActivationOffload"}
    assert 0 < moved[True] < moved[False]
    assert "| yes | ActivationOffload |" in (tmp_path / "activation_offload_quick_cpu.md").read_text()
