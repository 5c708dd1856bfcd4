"""Multi-node for real: two ``torchrun`` agents ("nodes") on this machine over loopback, c10d rendezvous, 2 ranks
each; and, where a local Slurm can be started, a real 2-task ``sbatch`` job.

- ``fsdp_custom`` shards over all 4 ranks; ``fsdp_custom_hybrid`` builds a (nodes × ranks-per-node) = 2 × 2 mesh,
  replicating across nodes and sharding within one. Both must equal a single process on the same global batch.
- A rank failing on one node ends the ranks on the other node too (they only share the rendezvous store).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, SCRIPTS, child_env, train
from tests.helpers.models import TinyLM
from tests.scripts.fail_jobs import FAIL_TRAIN, run_lightning, run_torchrun, write_spec

GLOBAL_BATCH = 8
STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference")
    return train({"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS}, path, "reference")


def _torchrun_train(tmp_path: Path, strategy: str) -> tuple[dict, str]:
    spec = {
        "strategy": strategy,
        "devices": 2,
        "num_nodes": 2,
        "batch_size": GLOBAL_BATCH // 4,
        "max_steps": STEPS,
        "out": str(tmp_path / "result.json"),
    }
    job = run_torchrun(spec, tmp_path, "job", nnodes=2, nproc_per_node=2, script=SCRIPTS / "train.py")
    assert job.returncodes == [0, 0], job.output[-6000:]
    assert not job.orphans, job.orphans
    result = json.loads((tmp_path / "result.json").read_text())
    result["params"] = torch.load(result["params_path"], weights_only=True)
    return result, job.output


def _assert_parity(result: dict, reference: dict) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]))
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    ("strategy", "mesh"), [pytest.param("fsdp_custom", (1, 4), marks=pytest.mark.slow), ("fsdp_custom_hybrid", (2, 2))]
)
def test_two_nodes_two_ranks_each_match_one_process(tmp_path, reference, strategy, mesh):
    result, output = _torchrun_train(tmp_path, strategy)
    assert result["world_size"] == 4
    assert f"on mesh MeshShape(replicate={mesh[0]}, shard={mesh[1]})" in output
    _assert_parity(result, reference)
    params_bytes = [row[0] for row in result["state_bytes"]]
    model_bytes = sum(p.numel() * 4 for p in TinyLM().parameters())
    # every replica holds the whole model once, split over its shard group: node 0 = ranks 0-1, node 1 = ranks 2-3
    assert sum(params_bytes) == pytest.approx(mesh[0] * model_bytes, rel=0.02)
    if mesh[0] == 2:
        assert params_bytes[:2] == params_bytes[2:]  # the replica on node 1 mirrors node 0


def test_failure_on_one_node_ends_the_other_node(tmp_path):
    spec = {
        "devices": 2, "num_nodes": 2, "batch_size": 2, "max_steps": 6,
        "strategy_kwargs": {"replicate_size": "auto"},
        "inject": {"kind": "raise_step", "rank": 3, "step": 2},
    }
    job = run_torchrun(spec, tmp_path, "job", nnodes=2, nproc_per_node=2)
    assert all(code != 0 for code in job.returncodes), job.output[-6000:]
    assert job.seconds_after_fault < 30, job.output[-6000:]
    assert not job.orphans, job.orphans
    assert job.count("ValueError: injected failure in training_step on rank 3") >= 1
    # once, from rank 3 (torch prefixes a worker's uncaught traceback with its rank; torchrun's agents add
    # their own ChildFailedError report, which is not the original traceback)
    assert len(re.findall(r"^\[rank\d+\]: Traceback", job.output, flags=re.M)) == 1, job.output[-8000:]
    assert "[rank3]: ValueError: injected failure in training_step on rank 3" in job.output
    for r in (0, 1, 2):
        assert f"[rank {r}]" in job.output and "rank 3 failed" in job.output


# -- a real Slurm job ---------------------------------------------------------------------------------------------------
SLURM_SCRIPT = REPO / "examples" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-machine Slurm (controller + node daemon on loopback), installed from Debian's packages if missing."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (munged and slurmd run as root)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    state = tmp_path_factory.mktemp("slurm")
    try:
        proc = subprocess.run(["bash", str(SLURM_SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("installing/starting the local Slurm took more than 15 minutes")
    conf = [line.split("=", 1)[1] for line in proc.stdout.splitlines() if line.startswith("SLURM_CONF=")]
    if proc.returncode != 0 or not conf:
        pytest.skip(f"could not start a local Slurm:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    env = {k: v for k, v in child_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # SLURMEnvironment picks them
    env["SLURM_CONF"] = conf[0]
    yield env
    subprocess.run(["bash", str(SLURM_SCRIPT), "stop", str(state)], capture_output=True, timeout=120)


def _job_fields(job_id: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


@pytest.mark.slow
def test_sbatch_job_is_preempted_requeued_and_resumes(tmp_path, slurm):
    """A real 2-task job from the documented sbatch script: SIGUSR1 (SLURM's time-limit warning, here from
    `scancel --signal`) mid-step → all ranks save `last` → rank 0 requeues → the same job id runs again and
    resumes with ckpt_path="last" to the end, reproducing an uninterrupted run's losses."""
    reference = run_lightning({"devices": 2, "max_steps": 12}, _mkdir(tmp_path / "ref"), "ref")
    assert reference.returncodes == [0], reference.output[-4000:]

    run = _mkdir(tmp_path / "run")
    marker = run / "pid"
    spec_path, spec = write_spec(
        {"devices": 2, "max_steps": 12, "checkpoint_dir": str(run / "ckpt"), "ckpt_path": "last",
         "inject": {"kind": "wait_signal", "rank": 1, "step": 3, "marker": str(marker)}},
        run, "job",
    )
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
         f"--chdir={REPO}", f"--output={run}/slurm-%j.out", str(SBATCH), "--", sys.executable, str(FAIL_TRAIN), str(spec_path)],
        capture_output=True, text=True, timeout=60, env=slurm,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    signalled = False
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id, slurm)
        state = fields.get("JobState", "")
        if not signalled and marker.exists() and marker.read_text():
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True, env=slurm)
            signalled = True
        if state == "PENDING" and int(fields.get("Restarts", 0)) > 0:
            # a requeued job waits out a begin-time delay; start it now
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(1)
    logs = "\n".join(p.read_text(errors="replace") for p in run.glob("slurm-*.out"))
    assert fields.get("JobState") == "COMPLETED", f"{fields}\n{logs[-6000:]}"
    assert signalled and fields.get("Restarts") == "1", f"{fields}\n{logs[-6000:]}"
    assert "[rank 1] preempted by SIGUSR1 at global step 4" in logs and "[rank 0] preempted by SIGUSR1 at global step 4" in logs
    assert f"requeued SLURM job {job_id}" in logs
    assert "Restored all states from the checkpoint" in logs
    rows = [json.loads(line) for line in Path(spec["log"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(reference.losses))


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
