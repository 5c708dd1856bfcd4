"""`lightning-fsdp train` for real: the default job, every experiment, multirun, torchrun, and bad overrides.

Each test runs the installed console script (or ``python -m lightning_fsdp``) in a fresh folder; Lightning's launcher
starts the other ranks, which must share the job's one output folder.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fsdp.checkpoint import verify_checkpoint
from lightning_fsdp.data import TextCorpusDataModule
from lightning_fsdp.models import GPTLightningModule
from tests.helpers.console import foreign_lines
from tests.helpers.launch import child_env

CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-fsdp")
#: a smaller slice of the standard-library corpus: builds in well under a second
SMALL_CORPUS = "data.max_bytes=200000"


def cli(args: list[str], cwd: Path, *, module: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_fsdp", *args] if module else [str(CONSOLE_SCRIPT), *args]
    return subprocess.run(command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    return proc


def only_run_dir(cwd: Path, task: str) -> Path:
    """The job's folder; there must be exactly one (ranks > 0 create none)."""
    runs = sorted((cwd / "outputs" / task / "runs").iterdir())
    assert len(runs) == 1, runs
    # besides the job folders: generated models and prepared data sets, shared by runs
    assert sorted(p.name for p in (cwd / "outputs").iterdir() if p.name not in ("pretrained", "cache")) == [task]
    assert not (cwd / "lightning_logs").exists()
    return runs[0]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def consolidate(checkpoint_dir: Path, out: Path, cwd: Path) -> Path:
    check(cli(["consolidate", str(checkpoint_dir), str(out), "--no-progress"], cwd))
    return out


def test_gpt_pretrain_briefly_logs_checkpoints_and_learns(tmp_path):
    """The GPT trained from scratch (~4.8M params, fsdp_custom, 2 CPU processes), shortened to 16 steps."""
    proc = check(cli(["train", "experiment=gpt_pretrain", "trainer.max_steps=16", "trainer.val_check_interval=8",
                      "trainer.log_every_n_steps=2", "sample.max_new_tokens=24"], tmp_path))
    run_dir = only_run_dir(tmp_path, "gpt_pretrain")
    result = summary(run_dir)
    assert result["state"] == "finished" and result["global_step"] == 16 and result["world_size"] == 2
    assert result["warm_started_ranks"] == 1  # rank 1 imported alongside rank 0, then ran the handed-over job
    assert result["frozen_objects"] > 100_000  # imported with the garbage collector off, then frozen
    assert result["wrapped_units"] == [f"net.blocks.{i}" for i in range(6)] + [""]
    assert [row["rank"] for row in result["memory"]["ranks"]] == [0, 1]
    assert "Memory per rank" in proc.stdout and "Sample from the trained model" in proc.stdout
    assert result["sample"].startswith("Return the ") and len(result["sample"]) > len("Return the ")

    # CSV (and TensorBoard) logs; the loss falls clearly from ln(256) = 5.55
    losses = [loss for _, loss in logged(run_dir, "train_loss")]
    assert len(losses) >= 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 1.0, losses
    assert {"val_loss", "val_ppl", "val_acc", "train_acc"} <= set(result["metrics"])
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    # a sharded checkpoint directory that verifies, consolidates and loads in a plain process ...
    last = Path(result["last_checkpoint"])
    assert last.is_dir() and last.parent == run_dir / "checkpoints"
    verify_checkpoint(last)
    model = GPTLightningModule.load_from_checkpoint(consolidate(last, tmp_path / "full.ckpt", tmp_path), map_location="cpu")
    # ... and reproduces the validation loss the two ranks logged for the same weights (8 batches of 8 per rank)
    data = TextCorpusDataModule(seq_len=128, cache_dir=run_dir / "data")
    data.setup()
    x = torch.stack([data.val_set[i][0] for i in range(128)])
    y = torch.stack([data.val_set[i][1] for i in range(128)])
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert loss.item() == pytest.approx(result["metrics"]["val_loss"], rel=1e-4)


def test_finetune_pretrained_starts_from_the_pretrained_weights(tmp_path):
    """Weights trained elsewhere (here: a plain single-process run) are loaded into the shards by
    `experiment=finetune_pretrained`: its first loss continues where pretraining ended, far below a fresh model's."""
    import lightning as L

    L.seed_everything(0)
    model = GPTLightningModule(n_layer=2, n_head=2, d_model=64, seq_len=128, lr=2e-3, warmup_steps=5)
    data = TextCorpusDataModule(seq_len=128, batch_size=16, max_bytes=200_000)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    pretrained_loss = float(trainer.callback_metrics["train_loss"])
    weights = tmp_path / "pretrained" / "tiny.pt"
    weights.parent.mkdir()
    torch.save(model.state_dict(), weights)

    (tmp_path / "job").mkdir()
    check(cli(["train", "experiment=finetune_pretrained", "model=gpt_tiny", SMALL_CORPUS, "sample=null",
               f"strategy.pretrained_weights={weights}", "debug=steps"], tmp_path / "job"))
    finetune = [loss for _, loss in logged(only_run_dir(tmp_path / "job", "finetune_pretrained"), "train_loss")]
    assert pretrained_loss < 4.5, pretrained_loss  # a fresh model starts at ln(256) = 5.55
    assert abs(finetune[0] - pretrained_loss) < 0.3, (pretrained_loss, finetune)


EXPERIMENTS = {
    "cnn_shapes": ["debug=steps"],
    "gpt_medium_offload": ["debug=fast_dev_run", SMALL_CORPUS],
    "hsdp": ["debug=fast_dev_run", SMALL_CORPUS],
    "finetune_pretrained": ["debug=steps", SMALL_CORPUS],
    "finetune_hf_lora": ["debug=steps", SMALL_CORPUS, "sample.max_new_tokens=4"],
    "finetune_hf_qlora": ["debug=steps", SMALL_CORPUS, "sample.max_new_tokens=4"],
    "dpo": ["trainer.max_steps=2", "data.batch_size=1", "export.formats=[]", "data.val_path=null",
            "data.val_fraction=0.02"],  # 14 held-out pairs: the evaluation at the start and the end stays short
    "grpo": ["trainer.max_steps=2", "data.batch_size=1", "model.num_generations=2", "model.max_completion_length=8",
             "callbacks.held_out_rewards.count=4", "export.formats=[peft]"],
    "finetune_hf_chat": ["debug=steps", "callbacks.held_out_answers.count=2", "callbacks.held_out_answers.max_new_tokens=4",
                         "data.seq_len=128", "sample=null"],
}


#: experiments whose features other default tests run already (offload and HSDP parity, the pretrained start, the
#: HF LoRA and QLoRA examples, DPO on the real model): CI runs them with `-m slow`
COVERED_ELSEWHERE = {"dpo", "gpt_medium_offload", "hsdp", "finetune_pretrained", "finetune_hf_lora", "finetune_hf_qlora"}


@pytest.mark.parametrize(
    "experiment",
    [pytest.param(e, marks=pytest.mark.slow) if e in COVERED_ELSEWHERE else e for e in sorted(EXPERIMENTS)],
)
def test_every_experiment_runs_with_a_debug_override(tmp_path, experiment):
    verbose = ["--verbose"] if experiment == "cnn_shapes" else []  # every library's output, as it prints it
    proc = check(cli(["train", *verbose, f"experiment={experiment}", *EXPERIMENTS[experiment]], tmp_path))
    run_dir = only_run_dir(tmp_path, experiment)
    result = summary(run_dir)
    assert result["state"] == "finished"
    noise = foreign_lines(proc.stdout + "\n" + proc.stderr)
    if verbose:
        assert any("GPU available:" in line for line in noise), noise
    else:  # the console shows the project's own output only
        assert noise == [], "\n".join(noise)
    if experiment == "cnn_shapes":
        assert result["wrapped_units"] == ["features.0", "features.1", "features.2", "features.3", ""]
        assert "val_acc" in result["metrics"] and result["sample"] is None
        last = Path(result["last_checkpoint"])
        verify_checkpoint(last)
        state = torch.load(consolidate(last, tmp_path / "cnn.ckpt", tmp_path), weights_only=True)["state_dict"]
        running_var = state["features.0.bn.running_var"]  # BatchNorm buffers are saved (and were updated)
        assert running_var.shape == (16,) and not torch.equal(running_var, torch.ones(16))
    elif experiment == "gpt_medium_offload":
        assert result["wrapped_units"] == [f"net.blocks.{i}" for i in range(8)] + [""]
    elif experiment == "hsdp":
        assert result["world_size"] == 4 and result["mesh_shape"] == [2, 2]
        assert len(result["memory"]["ranks"]) == 4 and result["memory"]["shard_size"] == 2
    elif experiment == "finetune_pretrained":
        assert (tmp_path / "outputs" / "pretrained" / "gpt_L6_d256_v256.pt").is_file()  # pretrained_if_missing=init
        assert result["global_step"] == 4
    elif experiment == "finetune_hf_chat":  # generated data, a tokenizer trained on it, a model of its vocabulary
        from transformers import AutoConfig, AutoTokenizer

        model_dir = tmp_path / "outputs" / "pretrained" / "chat_demo_llama_L4_d192"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert tokenizer.chat_template and len(tokenizer) == AutoConfig.from_pretrained(model_dir).vocab_size > 256
        assert (tmp_path / "outputs" / "cache" / "chat_demo" / "train.jsonl").is_file()
        assert {"val_loss", "val_ppl", "val_token_accuracy", "held_out_exact_match"} <= set(result["metrics"])
        assert "Held-out set at step 0: loss" in proc.stdout and "Held-out set after 4 steps: loss" in proc.stdout
        assert "held_out_rougeL" in result["metrics"] and "held_out_loss_at_start" in result["metrics"]
    elif experiment == "dpo":  # the real SmolLM2, LoRA, its base as the reference; tests/distributed has the rest
        assert result["global_step"] == 2 and result["warm_started_ranks"] == 1
        assert {"held_out_reward_accuracy_at_start", "held_out_reward_accuracy", "train_reward_margin"} <= set(result["metrics"])
        assert result["metrics"]["held_out_reward_margin_at_start"] == 0.0  # new adapters: the policy is the reference
        assert "Held-out pairs at step 0:" in proc.stdout and "Held-out pairs after 2 steps:" in proc.stdout
    elif experiment == "grpo":  # the real SmolLM2 samples its own answers on the shards; a program checks them
        assert result["global_step"] == 2 and {"peft"} == set(result["exports"])
        metrics = result["metrics"]
        assert {"held_out_accuracy_at_start", "held_out_accuracy", "held_out_reward", "reward",
                "rewards/correct_value/mean", "completions/mean_length", "rollout/tokens_per_second"} <= set(metrics)
        assert "Held-out prompts at step 0: accuracy" in proc.stdout and "Held-out prompts after 2 steps" in proc.stdout
        assert (run_dir / "csv" / "reward_curve.png").is_file()
    elif experiment == "finetune_hf_qlora":
        assert len(result["wrapped_units"]) == 5 and {"hf", "peft"} <= set(result["exports"])
        assert (tmp_path / "outputs" / "pretrained" / "llama_byte_L4_d256_ff768" / "config.json").is_file()
    elif experiment == "finetune_hf_lora":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert result["wrapped_units"] == [f"model.base_model.model.model.layers.{i}" for i in range(4)] + [""]
        merged = AutoModelForCausalLM.from_pretrained(result["exports"]["hf"])
        tokenizer = AutoTokenizer.from_pretrained(result["exports"]["hf"])
        assert tokenizer("Return")["input_ids"] == list(b"Return")  # byte-level, as trained
        base = tmp_path / "outputs" / "pretrained" / "llama_byte_L4_d256"  # pretrained_if_missing=init wrote it
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), result["exports"]["peft"])
        expected = adapted.merge_and_unload().state_dict()
        for name, value in merged.state_dict().items():
            torch.testing.assert_close(value, expected[name])


@pytest.mark.slow
def test_multirun_runs_each_job_in_its_own_folder(tmp_path):
    """`-m` (via `python -m lightning_fsdp`): one folder per job, no folder of the ranks' own, jobs isolated."""
    proc = check(cli(["train", "-m", "experiment=gpt_pretrain", "model=gpt_tiny", "debug=fast_dev_run", SMALL_CORPUS,
                      "seed=1,2"], tmp_path, module=True))
    assert "Launching 2 jobs" in proc.stdout + proc.stderr
    sweeps = list((tmp_path / "outputs" / "gpt_pretrain" / "multiruns").iterdir())
    assert len(sweeps) == 1
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job in jobs:
        result = summary(sweeps[0] / job)
        assert result["state"] == "finished" and result["world_size"] == 2
        assert result["warm_started_ranks"] == 0  # a multirun job's ranks are started by Lightning's launcher
        assert result["frozen_objects"] > 100_000  # the job's own process imports with the collector off too
    assert not (tmp_path / "outputs" / "gpt_pretrain" / "runs").exists()


def test_torchrun_ranks_share_the_given_run_dir(tmp_path):
    """An external launcher starts every rank; ranks > 0 compose the config without creating folders."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lightning_fsdp",
         "train", "experiment=gpt_pretrain", "model=gpt_tiny", "debug=steps", SMALL_CORPUS, "hydra.run.dir=shared/run"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300,
    )
    check(proc)
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]
    result = summary(tmp_path / "shared" / "run")
    assert result["world_size"] == 2 and result["global_step"] == 4
    verify_checkpoint(Path(result["last_checkpoint"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=gpt_huge"], "Could not find 'model/gpt_huge'"),
        (["+strategy.cpu_ofload=true"], "did you mean 'cpu_offload'"),
        (["experiment=hsdp", "trainer.devices=3"], "do not fit"),
    ],
)
def test_bad_overrides_fail_fast_before_any_process_group(tmp_path, overrides, message):
    proc = cli(["train", *overrides], tmp_path, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert message in output
    assert "Initializing distributed" not in output and "GLOBAL_RANK" not in output
    assert not list(tmp_path.rglob("summary.json")) and not list(tmp_path.rglob("*.ckpt"))
