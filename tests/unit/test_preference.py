"""Preference tuning in one process: TRL's formats, the pairs' tokens, DPO and SimPO against TRL's ``DPOTrainer`` and
closed forms, the LoRA reference against a separately loaded base, and the pair-count normalisation.

The sharded runs (2 ranks, accumulation, mid-epoch resume) are in ``tests/distributed/test_preference_sharded.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_fsdp.data.preference import (
    PairEncoder,
    PairStatus,
    PreferenceDataModule,
    collate_pairs,
    detect_preference_format,
    split_pair,
)
from lightning_fsdp.loss import IGNORE_INDEX, TokenWeightedLoss
from lightning_fsdp.loss.preference import preference_loss
from lightning_fsdp.models import HFPreferenceLM
from tests.helpers.sft import make_tokenizer, write_chat_llama, write_jsonl

pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


ROWS = [
    {"prompt": _user("alpha beta"), "chosen": _assistant("gamma delta river"), "rejected": _assistant("stone")},
    {"prompt": _user("north south quiet"), "chosen": _assistant("loud"), "rejected": _assistant("dark small large")},
    {"prompt": _user("window"), "chosen": _assistant("garden table music seven"), "rejected": _assistant("eleven")},
    {"prompt": _user("paper orange"), "chosen": _assistant("cloud"), "rejected": _assistant("bright cloud")},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    tokenizer = make_tokenizer("chatml")
    return write_chat_llama(tmp_path_factory.mktemp("pref") / "model", tokenizer, seed=3)


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model))


def test_formats_are_told_from_the_columns_and_a_missing_one_is_named():
    assert detect_preference_format(["prompt", "chosen", "rejected", "id"]) == "explicit"
    assert detect_preference_format(["chosen", "rejected"]) == "implicit"
    with pytest.raises(ValueError, match=r"\['answer', 'prompt'\] match no preference format.*prompt \+ chosen \+ rejected"):
        detect_preference_format(["prompt", "answer"])


def test_an_implicit_prompt_is_the_shared_beginning():
    chosen = [*_user("q"), *_assistant("yes")]
    rejected = [*_user("q"), *_assistant("no")]
    assert split_pair({"chosen": chosen, "rejected": rejected}) == (_user("q"), _assistant("yes"), _assistant("no"))
    assert split_pair({"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"}) == ("Q: sky? A: ", "blue", "green")


def test_pairs_that_cannot_be_trained_are_dropped_with_their_reason(tokenizer):
    encoder = PairEncoder(tokenizer, seq_len=24)
    same = encoder.encode({"prompt": _user("alpha"), "chosen": _assistant("beta"), "rejected": _assistant("beta")})
    assert same["status"] == PairStatus.IDENTICAL and same["chosen_ids"] == []
    long_prompt = encoder.encode({"prompt": _user("alpha " * 40), "chosen": _assistant("b"), "rejected": _assistant("c")})
    assert long_prompt["status"] == PairStatus.NO_ROOM
    cut = encoder.encode({"prompt": _user("alpha"), "chosen": _assistant("beta " * 30), "rejected": _assistant("c")})
    assert cut["status"] == PairStatus.TRUNCATED
    assert len(cut["prompt_ids"]) + len(cut["chosen_ids"]) == 24


def test_the_data_module_counts_what_it_dropped_and_errs_when_nothing_is_left(chat_model, tmp_path, capsys):
    rows = [*ROWS, {"prompt": _user("a"), "chosen": _assistant("same"), "rejected": _assistant("same")}]
    data = PreferenceDataModule(write_jsonl(tmp_path / "p.jsonl", rows), chat_model, val_fraction=0.0, seq_len=64,
                                batch_size=2, cache_dir=tmp_path / "cache")
    data.setup()
    assert data.stats is not None and data.stats["train"]["kept"] == 4
    assert data.stats["train"]["dropped (chosen equals rejected)"] == 1
    assert "1 dropped (chosen equals rejected)" in capsys.readouterr().out
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["pair_mask"].tolist() == [1.0, 1.0]
    same = [{"prompt": _user("a"), "chosen": _assistant("x"), "rejected": _assistant("x")}]
    with pytest.raises(ValueError, match="No preference pair is left to train on: 1 dropped \\(chosen equals rejected\\)"):
        PreferenceDataModule(write_jsonl(tmp_path / "same.jsonl", same), chat_model, val_fraction=0.0, seq_len=64,
                             cache_dir=tmp_path / "cache").setup()
    with pytest.raises(ValueError, match="match no preference format"):
        PreferenceDataModule(write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}]), chat_model)


def _trl_dpo(chat_model: Path, tmp_path: Path, beta: float):
    """TRL's DPOTrainer on the rows with a new LoRA adapter (its reference: the adapters disabled), the adapter then
    moved off zero so that the policy and the reference differ."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS), beta=beta,
                       max_length=64, report_to=[], use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(ROWS),
                         processing_class=AutoTokenizer.from_pretrained(str(chat_model)),
                         peft_config=LoraConfig(**LORA))
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return trainer


def test_dpo_equals_trls_dpo_trainer(chat_model, tokenizer, tmp_path):
    """Same model, pairs and β: the same tokens, per-pair rewards and log-probs (TRL's logged means), loss and
    adapter gradients, at fp32 tolerance."""
    beta = 0.3
    trainer = _trl_dpo(chat_model, tmp_path, beta)
    encoder = PairEncoder(tokenizer, seq_len=64)
    ours = [encoder.encode(row) for row in ROWS]
    for mine, theirs in zip(ours, trainer.train_dataset):
        assert (mine["prompt_ids"], mine["chosen_ids"], mine["rejected_ids"]) == (
            theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])

    policy = trainer.model
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    trl_loss = trainer.compute_loss(policy, trl_batch)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    policy.zero_grad()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    module = HFPreferenceLM(chat_model, lora=LORA, loss="dpo", beta=beta)
    module.model = policy  # the very model TRL trains
    batch = collate_pairs(ours, pad_id=encoder.tokenizer.pad_token_id)
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    scores = module.pair_scores(batch)
    loss = scores.losses.mean()
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.detach())
    for name, grad in trl_grads.items():
        torch.testing.assert_close(dict(policy.named_parameters())[name].grad, grad, msg=name)
    assert metrics["rewards/margins"] != 0  # the policy is not the reference: the comparison means something
    for ours_value, key in [(scores.chosen_rewards, "rewards/chosen"), (scores.rejected_rewards, "rewards/rejected"),
                            (scores.margins, "rewards/margins"), (scores.accuracies, "rewards/accuracies"),
                            (scores.chosen_logps, "logps/chosen"), (scores.rejected_logps, "logps/rejected")]:
        torch.testing.assert_close(ours_value.mean().item(), metrics[key], msg=key, rtol=1e-5, atol=1e-5)


def test_the_lora_reference_is_the_separately_loaded_base(chat_model, tokenizer):
    """Adapters switched off (nothing copied) give the log-probs of the base loaded on its own, token for token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = HFPreferenceLM(chat_model, lora={**LORA, "init_lora_weights": False}, from_pretrained=True)
    module.configure_model()
    encoder = PairEncoder(tokenizer, seq_len=64)
    batch = collate_pairs([encoder.encode(row) for row in ROWS], pad_id=tokenizer.pad_token_id)
    reference, counts = module.sequence_log_probs(batch, reference=True)
    policy, _ = module.sequence_log_probs(batch)

    base = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32)
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = (picked * (labels != IGNORE_INDEX)).sum(-1)
    torch.testing.assert_close(reference, expected)
    assert counts.tolist() == (labels != IGNORE_INDEX).sum(-1).tolist()
    assert not torch.allclose(policy, expected)  # the adapters do change the policy


def test_simpo_is_the_length_normalised_margin_loss():
    logps = torch.tensor([-4.0, -9.0, -6.0, -3.0])  # chosen rows first
    counts = torch.tensor([2, 3, 3, 1])
    scores = preference_loss("simpo", logps, counts, beta=2.0, simpo_gamma=0.5)
    expected = -F.logsigmoid(2.0 * torch.tensor([-2.0, -3.0]) - 2.0 * torch.tensor([-2.0, -3.0]) - 0.5)
    torch.testing.assert_close(scores.losses, expected)
    with pytest.raises(ValueError, match="reference_logps"):
        preference_loss("dpo", logps, counts)
    with pytest.raises(ValueError, match="the base model with the LoRA adapters switched off"):
        HFPreferenceLM("unused", loss="dpo", lora=None, reference="adapters_off")
    with pytest.raises(ValueError, match="needs no reference model"):
        HFPreferenceLM("unused", loss="simpo", reference="copy")
    with pytest.raises(ValueError, match="is not one of"):
        HFPreferenceLM("unused", reference="frozen")


def test_the_step_is_the_mean_over_all_pairs_even_when_micro_batches_hold_different_numbers():
    """Micro-batches of 1 and 3 real pairs (the other slot padding): Σ losses / global pair count equals one batch of
    4; the mean of per-micro-batch means does not."""
    weight = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.3]))
    per_pair = lambda w, idx: (w[idx] ** 2 + w[idx]).exp()  # noqa: E731  # any per-pair loss
    one = TokenWeightedLoss()
    one.add(per_pair(weight, [0, 1, 2, 3]).sum(), 4).backward()
    one.finish_step([weight], divisor=1)
    reference = weight.grad.clone()

    weight.grad = None
    split = TokenWeightedLoss()
    for idx in ([0], [1, 2, 3]):  # Lightning divides each micro-batch's loss by accumulate_grad_batches (2)
        (split.add(per_pair(weight, idx).sum(), len(idx)) / 2).backward()
    split.finish_step([weight], divisor=2)
    torch.testing.assert_close(weight.grad, reference)

    weight.grad = None
    for idx in ([0], [1, 2, 3]):
        (per_pair(weight, idx).mean() / 2).backward()
    assert not torch.allclose(weight.grad, reference)


def test_simpo_fine_tunes_the_whole_model_with_no_reference(chat_model, tmp_path):
    """SimPO through a real Trainer, full fine-tune (every weight trains; nothing is a reference): the held-out margin
    between chosen and rejected rewards grows."""
    import lightning as L

    rows = ROWS * 6
    data = PreferenceDataModule(write_jsonl(tmp_path / "p.jsonl", rows), chat_model,
                                val_path=write_jsonl(tmp_path / "v.jsonl", ROWS), seq_len=64, batch_size=4,
                                cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    model = HFPreferenceLM(chat_model, loss="simpo", beta=2.0, simpo_gamma=0.5, lr=1e-3, from_pretrained=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        inference_mode=False)  # the model is built in the first validate: no inference tensors
    before = trainer.validate(model, datamodule=data, verbose=False)[0]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]
    assert all(p.requires_grad for p in model.parameters())
    assert after["val_reward_margin"] > before["val_reward_margin"] + 0.1, (before, after)
    assert after["val_loss"] < before["val_loss"]


def _fit_dpo(chat_model: Path, tmp_path: Path, name: str, rows: list, steps: int = 3, ckpt_path=None, **model_args):
    """A few DPO steps through a real Trainer in one process; the per-step losses, the model and the Trainer."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(trainer.callback_metrics["train_loss"]))

    data = PreferenceDataModule(write_jsonl(tmp_path / f"{name}.jsonl", rows), chat_model,
                                val_path=write_jsonl(tmp_path / "v.jsonl", ROWS), seq_len=64, batch_size=2,
                                cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    model = HFPreferenceLM(str(chat_model), beta=0.5, lr=2e-2, from_pretrained=True, **model_args)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[losses],
                        default_root_dir=tmp_path / name, enable_checkpointing=False)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return losses.values, model, trainer, data


def test_the_three_references_give_the_same_losses(chat_model, tmp_path):
    """LoRA: adapters off, a frozen copy and precomputed log-probs train identically; a full fine-tune's frozen copy
    and its precomputed reference too. The precomputed values are cached beside the prepared pairs, and reused."""
    rows = ROWS * 2
    lora = {**LORA, "init_lora_weights": False}  # adapters moved off zero: the policy differs from the reference
    runs = {mode: _fit_dpo(chat_model, tmp_path, "lora", rows, lora=lora, reference=mode)
            for mode in ("adapters_off", "copy", "precomputed")}
    expected = torch.tensor(runs["adapters_off"][0])
    for mode in ("copy", "precomputed"):
        torch.testing.assert_close(torch.tensor(runs[mode][0]), expected, msg=mode)
    data = runs["precomputed"][3]
    cached = sorted(data.prepared_dir.glob("reference-*.safetensors"))
    assert len(cached) == 1 and "_reference_copy" not in runs["precomputed"][1].__dict__
    assert "_reference_copy" in runs["copy"][1].__dict__  # built, yet no parameter of the module
    assert not any("reference" in name for name, _ in runs["copy"][1].named_parameters())

    full = {mode: _fit_dpo(chat_model, tmp_path, "full", rows, reference=mode)[0] for mode in ("copy", "precomputed")}
    torch.testing.assert_close(torch.tensor(full["precomputed"]), torch.tensor(full["copy"]))
    assert full["copy"][0] == pytest.approx(0.6931, abs=1e-4)  # step 0: the policy is its reference
    again = _fit_dpo(chat_model, tmp_path, "full", rows, reference="precomputed")[0]
    assert again == full["precomputed"]


def test_precomputed_references_refuse_other_pairs(chat_model, tmp_path):
    """A cache made for other pairs, a damaged cache, and resuming a run whose data changed since its reference was
    computed: each refused, naming what to do."""
    from lightning_fsdp.models.reference import read_reference

    _, model, trainer, data = _fit_dpo(chat_model, tmp_path, "a", ROWS * 2, steps=2, reference="precomputed",
                                       lora=LORA)
    path = next(data.prepared_dir.glob("reference-*.safetensors"))
    counts = {"train": len(data.train_set), "val": len(data.val_set)}
    with pytest.raises(ValueError, match="made for the prepared pairs .* the data changed since"):
        read_reference(path, "pairs-other", counts)
    with pytest.raises(ValueError, match="do not cover the pairs"):
        read_reference(path, data.prepared_dir.name, {**counts, "train": counts["train"] + 1})
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="cannot be read"):
        read_reference(damaged, data.prepared_dir.name, counts)

    checkpoint = tmp_path / "a" / "step2.ckpt"
    trainer.save_checkpoint(checkpoint)
    changed = [*ROWS, {**ROWS[0], "chosen": _assistant("a new answer")}, *ROWS[1:]]  # as many pairs, one changed
    with pytest.raises(ValueError, match="data .* changed since the reference was computed"):
        _fit_dpo(chat_model, tmp_path, "b", changed, steps=3, reference="precomputed", lora=LORA,
                 ckpt_path=checkpoint)
    resumed, *_ = _fit_dpo(chat_model, tmp_path, "a", ROWS * 2, steps=3, reference="precomputed", lora=LORA,
                           ckpt_path=checkpoint)
    assert len(resumed) == 1  # the same data: resumed at step 2 of 3
