"""GRPO in one process: the loss and adapter gradients against TRL's ``GRPOTrainer`` fed the same completions, the
advantages against TRL's formula, the prompt data in TRL's formats and its rollout windows, and the settings that are
refused before training.

The sharded runs (any split, gather-once and streamed rollouts, resume, a full fine-tune against a sharded
reference) are in ``tests/distributed/test_grpo_sharded.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lightning_fsdp.data.prompts import PromptDataModule, PromptRows, RolloutLoader
from lightning_fsdp.loss.grpo import aggregate, group_advantages, token_losses
from lightning_fsdp.models import HFGRPOLM
from lightning_fsdp.models.rollout import build_part, reward_arguments
from lightning_fsdp.rewards import RewardFunctions
from tests.helpers.sft import WORDS, make_tokenizer, write_chat_llama, write_jsonl

pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
REWARDS = ["tests.helpers.rewards.mean_token_id", "tests.helpers.rewards.has_word"]
G, LENGTH = 4, 6


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": " ".join(rng.sample(WORDS, 3))}], "word": rng.choice(WORDS),
             "target": rng.randint(2, 6)} for _ in range(n)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("grpo") / "model", make_tokenizer("chatml"), seed=7)


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model))


def _completions(tokenizer, prompts: int, seed: int = 0) -> list[list[int]]:
    """Made-up completions, some ended by EOS and some cut at LENGTH, all of words the reward can find."""
    rng = random.Random(seed)
    out = []
    for i in range(prompts * G):
        ids = tokenizer(" ".join(rng.sample(WORDS, 4)))["input_ids"][: rng.randint(1, LENGTH)]
        out.append(ids + [tokenizer.eos_token_id] if i % 2 and len(ids) < LENGTH else ids[:LENGTH])
    return out


def _trl_grpo(chat_model: Path, tmp_path: Path, rows: list[dict], loss_type: str, beta: float):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers import rewards

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32)
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows) * G,
                        num_generations=G, max_completion_length=LENGTH, beta=beta, loss_type=loss_type,
                        report_to=[], use_cpu=True, bf16=False, temperature=1.0, reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards.mean_token_id, rewards.has_word], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(str(chat_model)),
                          peft_config=LoraConfig(**LORA))
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)  # the policy away from the reference: the KL term means something
    return trainer


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.05), ("grpo", 0.0), ("dr_grpo", 0.05), ("bnpo", 0.0)])
def test_loss_and_adapter_gradients_equal_trls_grpo_trainer(chat_model, tokenizer, tmp_path, loss_type, beta):
    """The same prompts and the same completions fed to both: the same prompt tokens, rewards, advantages, reference
    log-probabilities, loss and LoRA gradients, at fp32 tolerance."""
    rows = _rows(3, 0)
    trainer = _trl_grpo(chat_model, tmp_path, rows, loss_type, beta)
    completions = _completions(tokenizer, len(rows))
    trainer._generate_single_turn = lambda *args, **kwargs: (completions, None)
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for a step without accumulation
    policy = trainer.model
    policy.train()
    inputs = trainer._generate_and_score_completions([r for r in rows for _ in range(G)])
    trl_loss = trainer.compute_loss(policy, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    policy.zero_grad()

    module = HFGRPOLM(chat_model, reward_funcs=REWARDS, reward_weights=[1.0, 0.5], lora=LORA, num_generations=G,
                      max_completion_length=LENGTH, beta=beta, loss_type=loss_type)
    module.model = policy  # the very model TRL trains
    prompt_rows = [{"prompt": r["prompt"], "columns": {k: v for k, v in r.items() if k != "prompt"},
                    "prompt_ids": tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                                return_dict=True)["input_ids"]} for r in rows]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    scores = module.rewards.score(*reward_arguments(prompt_rows, texts, completions, G))
    advantages, _ = group_advantages(module.rewards.total(scores), G)
    stopped = [c[-1] == tokenizer.eos_token_id for c in completions]
    part = build_part([r["prompt_ids"] for r in prompt_rows], completions, stopped, advantages,
                      pad_id=tokenizer.pad_token_id, num_generations=G)
    assert torch.equal(part.input_ids[:, : part.prompt_width], inputs["prompt_ids"])
    torch.testing.assert_close(advantages, inputs["advantages"])
    if beta:
        part.ref_logps = module.completion_log_probs(part, reference=True)[0]
        mask = part.completion_mask.bool()
        torch.testing.assert_close(part.ref_logps[mask], inputs["ref_per_token_logps"][mask])
    logps, _ = module.completion_log_probs(part)
    terms = token_losses(logps, part.advantages, ref_logps=part.ref_logps, beta=beta)
    total, count = aggregate(terms.losses, part.completion_mask, loss_type, LENGTH)
    loss = total / count  # TokenWeightedLoss's step at one rank, one micro-batch
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.detach())
    for name, grad in trl_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(dict(policy.named_parameters())[name].grad, grad, msg=name)


def test_advantages_follow_trls_scaling_with_unscored_completions():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 2.0, float("nan"), 3.0, 3.0, 3.0, 3.0])
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(4)
    for scale, std in [("group", nanstd(grouped, dim=1).repeat_interleave(4)), ("batch", nanstd(rewards).expand(8)),
                       ("none", None)]:
        expected = rewards - mean if std is None else (rewards - mean) / (std + 1e-4)
        advantages, zero_std = group_advantages(rewards, 4, scale)
        torch.testing.assert_close(advantages, torch.nan_to_num(expected, nan=0.0), msg=scale)
        assert advantages[3] == 0.0  # a completion no function scored moves nothing
    assert group_advantages(rewards, 4)[1].tolist() == [False] * 4 + [True] * 4  # the second group has no signal


def test_the_four_normalisations_divide_by_their_units():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert [float(x) for x in aggregate(losses, mask, "dapo", 3)] == [18.0, 5.0]
    assert [float(x) for x in aggregate(losses, mask, "grpo", 3)] == [1.5 + 5.0, 2.0]
    assert [float(x) for x in aggregate(losses, mask, "dr_grpo", 3)] == [6.0, 2.0]
    assert [float(x) for x in aggregate(losses, mask, "bnpo", 3)] == pytest.approx([18.0 / 5, 1.0])
    logps = torch.zeros(2, 3, requires_grad=True)
    terms = token_losses(logps, torch.tensor([1.0, -1.0]))  # the same policy: ratio 1, nothing clipped
    torch.testing.assert_close(terms.losses, torch.tensor([[-1.0] * 3, [1.0] * 3]))
    assert not terms.clipped_low.any() and not terms.clipped_high.any()
    with pytest.raises(ValueError, match="beta > 0 adds a KL term"):
        token_losses(logps, torch.ones(2), beta=0.1)


def test_prompts_in_trls_formats_keep_their_columns_and_long_ones_are_named(chat_model, tmp_path):
    rows = [{"prompt": "plain text prompt", "answer": "1"}, {"prompt": [{"role": "user", "content": "a chat"}], "answer": "2"}]
    data = PromptDataModule(write_jsonl(tmp_path / "p.jsonl", rows), chat_model, val_fraction=0.0,
                            max_prompt_length=64, cache_dir=tmp_path / "cache")
    data.setup()
    first, second = data.train_set[0], data.train_set[1]  # type: ignore[index]
    assert first["columns"] == {"answer": "1"} and second["prompt"] == rows[1]["prompt"]
    assert first["prompt_ids"] == data.tokenizer("plain text prompt")["input_ids"]
    assert second["prompt_ids"] == data.tokenizer.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True,
                                                                      return_dict=True)["input_ids"]
    long = [*rows, {"prompt": " ".join(WORDS * 4), "answer": "3"}]
    path = write_jsonl(tmp_path / "long.jsonl", long)
    with pytest.raises(ValueError, match=r"1 of 3 train prompts are longer than max_prompt_length=40.*long_prompts=drop"):
        PromptDataModule(path, chat_model, val_fraction=0.0, max_prompt_length=40, cache_dir=tmp_path / "c2").setup()
    dropped = PromptDataModule(path, chat_model, val_fraction=0.0, max_prompt_length=40, long_prompts="drop",
                               cache_dir=tmp_path / "c3")
    dropped.setup()
    assert len(dropped.train_set) == 2  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no 'prompt' column"):
        PromptDataModule(write_jsonl(tmp_path / "q.jsonl", [{"question": "x"}]), chat_model)
    with pytest.raises(ValueError, match="max_prompt_length=512 is above the model's max_position_embeddings=128"):
        PromptDataModule(path, chat_model)


class _Rows(PromptRows):
    def __init__(self, n: int) -> None:
        super().__init__(None)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "prompt_ids": [index], "prompt": str(index), "columns": {}}


def _windows(loader_args: dict, ranks: int) -> list[list[int]]:
    """Each window's prompts over every rank, in order of the parts."""
    per_rank = [list(RolloutLoader(_Rows(24), rank=r, num_replicas=ranks, **loader_args)) for r in range(ranks)]
    windows = []
    for items in zip(*per_rank):
        if items[0]["part"] == 0 and items[0]["iteration"] == 0:
            windows.append(sorted(row["position"] for item in items for row in item["window"]))
    return windows


def test_rollout_windows_hold_the_same_prompts_at_any_split_and_repeat_for_each_iteration():
    single = _windows({"batch_size": 4}, 1)
    assert _windows({"batch_size": 2}, 2) == single == _windows({"batch_size": 1, "accumulate": 2}, 2)
    loader = RolloutLoader(_Rows(24), batch_size=2, accumulate=2, iterations=3)
    items = list(loader)
    assert len(items) == len(loader) == 6 * 2 * 3
    assert [(i["iteration"], i["part"]) for i in items[:6]] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(item["window"] == items[0]["window"] for item in items[:6])

    resumed = RolloutLoader(_Rows(24), batch_size=2, accumulate=2, iterations=1)
    it = iter(resumed)
    for _ in range(4):  # two windows
        next(it)
    state = resumed.state_dict()
    assert state["samples_consumed"] == 8
    again = RolloutLoader(_Rows(24), batch_size=4, accumulate=1)  # another split of the same window
    again.load_state_dict(state)
    assert [r["position"] for r in next(iter(again))["window"]] == [r["position"] for r in next(it)["window"]]
    odd = RolloutLoader(_Rows(24), batch_size=3, accumulate=1)
    odd.load_state_dict(state)
    with pytest.raises(ValueError, match="not a whole number of this run's rollout windows"):
        next(iter(odd))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_generations": 1}, "at least 2 completions per prompt"),
    ({"temperature": 0.0}, "Use a temperature above 0"),
    ({"loss_type": "ppo"}, "loss_type='ppo' is not one of"),
    ({"scale_rewards": "rank"}, "scale_rewards='rank' is not one of"),
    ({"reference": "precomputed", "beta": 0.1}, "cannot be precomputed"),
    ({"reference": "adapters_off", "lora": None}, "pass lora="),
    ({"generation_batch_size": 6}, "a multiple of num_generations=4"),
    ({"rollout_mode": "fast"}, "rollout_mode='fast' is not one of"),
    ({"reward_funcs": ["tests.helpers.rewards.nothing_here"]}, "has no callable 'nothing_here'"),
])
def test_settings_that_cannot_train_are_refused_when_the_module_is_made(chat_model, kwargs, message):
    settings = {"reward_funcs": REWARDS, "lora": LORA, "num_generations": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        HFGRPOLM(chat_model, **settings)
