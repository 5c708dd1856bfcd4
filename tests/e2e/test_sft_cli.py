"""Fine-tuning on your own data through the main job, as users type it:

    lightning-fsdp train experiment=finetune_hf_lora model.model_dir=DIR data=sft data.path=FILE

A tiny Llama with a BPE tokenizer trained here, chat data of varied lengths (padded rows, so micro-batches hold
different numbers of target tokens), real gloo processes. One global batch of 4 split four ways gives the same
per-step ``train_loss`` in the CSV log and the same final weights, equal to a hand-written loop of
Σ token losses / Σ target tokens; per-micro-batch averaging gives other weights. A run stopped at step 3 of its
epoch on 2 ranks and resumed on 1 equals the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from lightning_fsdp.data.order import GlobalOrderSampler  # noqa: E402
from lightning_fsdp.data.sft import SFTDataModule, collate_rows  # noqa: E402
from lightning_fsdp.loss import causal_lm_token_loss  # noqa: E402
from tests.e2e.test_train_cli import check, cli, logged, only_run_dir, summary  # noqa: E402
from tests.helpers.sft import chat_rows, make_tokenizer, write_chat_llama, write_jsonl  # noqa: E402

#: Adam turns float noise in ~0 gradients into steps of up to ~lr/100: at 1e-3 one element in 10k came out 1.3e-5
#: off (beyond the fp32 default tolerance) on one tokenizer build; 3e-4 keeps that noise inside it
LR, STEPS, SEQ = 3e-4, 6, 128
#: (devices, batch per rank, accumulation): one global batch of 4 rows, split four ways
SPLITS = {"1x4": (1, 4, 1), "2x2": (2, 2, 1), "2x1acc2": (2, 1, 2),
          "4x1": pytest.param((4, 1, 1), marks=pytest.mark.slow)}


def _split_value(split: Any) -> tuple[int, int, int]:
    return split.values[0] if hasattr(split, "values") else split


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft_cli")
    model = write_chat_llama(root / "model", make_tokenizer("chatml"))
    train = write_jsonl(root / "chat.jsonl", chat_rows(48, seed=7, turns=(1, 2), low=1, high=6))
    val = write_jsonl(root / "val.jsonl", chat_rows(8, seed=8, turns=(1, 1), low=1, high=6))
    return {"root": root, "model": model, "train": train, "val": val, "cache": root / "cache"}


def _args(inputs: dict[str, Path], devices: int, batch: int, accumulate: int, steps: int = STEPS) -> list[str]:
    return [
        "train", "experiment=finetune_hf_lora", f"model.model_dir={inputs['model']}", "data=sft",
        f"data.path={inputs['train']}", f"data.val_path={inputs['val']}", f"data.cache_dir={inputs['cache']}",
        f"data.seq_len={SEQ}", "data.packing=false", f"data.batch_size={batch}", "model.lora=null", f"model.lr={LR}",
        f"trainer.devices={devices}", f"trainer.accumulate_grad_batches={accumulate}", f"trainer.max_steps={steps}",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "logger=csv", "export.formats=[hf]", "~callbacks.memory_report",
    ]


def _run(inputs: dict[str, Path], name: str, args: list[str], task: str = "finetune_hf_lora") -> Path:
    cwd = inputs["root"] / name
    cwd.mkdir()
    check(cli(args, cwd))
    return only_run_dir(cwd, task)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "export" / "hf_model"), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(inputs) -> dict[str, Path]:
    out = {}
    for name, split in SPLITS.items():
        if hasattr(split, "marks"):  # slow variants run in their own test
            continue
        out[name] = _run(inputs, name, _args(inputs, *split))
    return out


def reference(inputs: dict[str, Path], per_micro_batch: tuple[int, int] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A plain loop in this process: the same rows in the same global order, AdamW, clipping at 1.0. The loss is
    Σ token losses / Σ target tokens of the global batch, or with ``per_micro_batch=(ranks, rows)`` the mean of
    each micro-batch's own per-token mean (what most scripts do).

    It runs in float64 and returns float32: a float32 loop is itself off the exact result by up to 8e-6 where Adam
    turns float noise in ~0 gradients into steps, which left an fp32 run no room at the fp32 default tolerance."""
    from transformers import AutoModelForCausalLM

    dm = SFTDataModule(inputs["train"], inputs["model"], val_path=inputs["val"], seq_len=SEQ, packing=False,
                       batch_size=4, cache_dir=inputs["cache"])
    dm.setup()
    model = AutoModelForCausalLM.from_pretrained(str(inputs["model"]), dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    order = list(GlobalOrderSampler(len(dm.train_set), 4, seed=0))
    losses = []
    for step in range(STEPS):
        rows = [dm.train_set[i] for i in order[4 * step: 4 * step + 4]]
        parts = [rows] if per_micro_batch is None else [rows[i:i + per_micro_batch[1]] for i in range(0, 4, per_micro_batch[1])]
        sums = []
        for part in parts:
            batch = collate_rows(part, dm.pad_id, packed=False)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            sums.append(causal_lm_token_loss(logits, batch["labels"]))
        if per_micro_batch is None:
            loss = sums[0][0] / sums[0][1]
        else:
            loss = torch.stack([total / count for total, count in sums]).mean()
        losses.append(float(sum(t.detach() for t, _ in sums) / sum(c for _, c in sums)))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


def test_every_split_logs_the_same_losses_and_ends_at_the_same_weights_as_the_token_mean(inputs, runs):
    losses = {name: [v for _, v in logged(run, "train_loss")] for name, run in runs.items()}
    steps = [s for s, _ in logged(runs["1x4"], "train_loss")]
    assert steps == list(range(STEPS)) and all(len(v) == STEPS for v in losses.values()), losses
    weights = {name: _final_weights(run) for name, run in runs.items()}
    expected_losses, expected = reference(inputs)
    for name in runs:
        torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(expected_losses), msg=name)
        torch.testing.assert_close(weights[name], expected, msg=lambda m, n=name: f"{n}: {m}")
        assert summary(runs[name])["world_size"] == _split_value(SPLITS[name])[0]
    # validation (steps 2 and 5 for both) is per token over every rank's rows: the same at one and two ranks
    for key in ("val_loss", "val_ppl", "val_token_accuracy"):
        torch.testing.assert_close(torch.tensor(logged(runs["2x2"], key)), torch.tensor(logged(runs["1x4"], key)))
    # the trap this guards against: each micro-batch's own mean, averaged, trains another model
    _, naive = reference(inputs, per_micro_batch=(2, 1))
    with pytest.raises(AssertionError, match="not close"):  # told apart at the tolerance the runs meet
        torch.testing.assert_close(naive, expected)


def test_a_run_stopped_mid_epoch_on_2_ranks_resumes_on_1_rank_at_the_next_sample(inputs, runs):
    stopped = _run(inputs, "stopped", _args(inputs, 2, 2, 1, steps=3))
    [checkpoint] = (stopped / "checkpoints").glob("step000003*")
    resumed = _run(inputs, "resumed", [*_args(inputs, 1, 4, 1), f"ckpt_path={checkpoint}"])
    uninterrupted = [v for _, v in logged(runs["1x4"], "train_loss")]
    before, after = logged(stopped, "train_loss"), logged(resumed, "train_loss")
    assert [s for s, _ in after] == [3, 4, 5]  # 12 steps per epoch: step 3 is mid-epoch
    torch.testing.assert_close(torch.tensor([v for _, v in before + after]), torch.tensor(uninterrupted))
    torch.testing.assert_close(_final_weights(resumed), _final_weights(runs["1x4"]))


@pytest.mark.slow
def test_four_ranks_of_one_row_each_equal_one_rank_of_four(inputs, runs):
    run = _run(inputs, "4x1", _args(inputs, 4, 1, 1))
    torch.testing.assert_close(torch.tensor([v for _, v in logged(run, "train_loss")]),
                               torch.tensor([v for _, v in logged(runs["1x4"], "train_loss")]))
    torch.testing.assert_close(_final_weights(run), _final_weights(runs["1x4"]))


def test_lightning_cli_takes_the_data_module_and_the_model(inputs, tmp_path):
    from tests.helpers.launch import run_python

    app = ("import lightning_fsdp; from lightning.pytorch.cli import LightningCLI; "
           "from lightning_fsdp.data import SFTDataModule; from lightning_fsdp.models import HFCausalLM; "
           "LightningCLI(HFCausalLM, SFTDataModule)")
    proc = run_python(["-c", app, "fit", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                       "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
                       "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
                       "--model.model_dir", str(inputs["model"]), "--model.tokenizer", str(inputs["model"]),
                       "--data.path", str(inputs["train"]), "--data.tokenizer", str(inputs["model"]),
                       "--data.seq_len", str(SEQ), "--data.batch_size", "2", "--data.cache_dir", str(inputs["cache"])],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Fine-tuning data train:" in proc.stdout


@pytest.mark.slow
def test_a_run_stopped_mid_epoch_on_1_rank_resumes_on_2_ranks(inputs, runs):
    stopped = _run(inputs, "stopped1", _args(inputs, 1, 4, 1, steps=3))
    [checkpoint] = (stopped / "checkpoints").glob("step000003*")
    resumed = _run(inputs, "resumed2", [*_args(inputs, 2, 2, 1), f"ckpt_path={checkpoint}"])
    losses = [v for _, v in logged(stopped, "train_loss") + logged(resumed, "train_loss")]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([v for _, v in logged(runs["1x4"], "train_loss")]))
    torch.testing.assert_close(_final_weights(resumed), _final_weights(runs["1x4"]))


@pytest.mark.slow
def test_qlora_takes_the_data_module_as_typed(inputs, tmp_path):
    """`experiment=finetune_hf_qlora ... data=sft`: a base whose projections hold whole NF4 blocks on 2 ranks."""
    model = write_chat_llama(tmp_path / "qlora_base", make_tokenizer("chatml"), hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    args = [a for a in _args({**inputs, "model": model}, 2, 2, 1, steps=4) if not a.startswith(("model.lora", "model.lr",
                                                                                                    "export."))]
    args[1] = "experiment=finetune_hf_qlora"
    run = _run(inputs, "qlora", [*args, "export.formats=[peft]"], task="finetune_hf_qlora")
    losses = [v for _, v in logged(run, "train_loss")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert (run / "export" / "adapter" / "adapter_config.json").is_file()
