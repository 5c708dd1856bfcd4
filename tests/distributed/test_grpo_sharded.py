"""GRPO sharded for real (gloo processes, ``fsdp_custom``), from :class:`PromptDataModule` files.

One set of launches, asserted several ways:

- the same seed and global batch of 4 prompts split as (1 process × 4), (2 ranks × 2) and (2 ranks × 1 × accumulate
  2) gives the same completions (token for token), rewards, per-step losses and final adapters, with the KL term to
  the reference (the base with the adapters off, inside every rank's sharded forward);
- gather-once and streamed rollouts give the same sampled completions and the same log-probabilities, and the same
  greedy held-out completions;
- ``num_iterations=2`` (one rollout reused, its old log-probabilities kept) is the same at 1 and 2 ranks;
- a run resumed from its checkpoint at step 2 ends equal to the uninterrupted one;
- a full fine-tune against a frozen copy sharded 1/N per rank (as the planner counts it) equals the one-process run,
  and the copy still holds the file's weights after training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, first_errors, run_python
from tests.helpers.sft import WORDS, make_tokenizer, write_chat_llama, write_jsonl

pytest.importorskip("peft")
SCRIPT = REPO / "tests" / "scripts" / "grpo_train.py"
STEPS = 4


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": " ".join(rng.sample(WORDS, 3))}], "word": rng.choice(WORDS),
             "target": rng.randint(2, 6)} for _ in range(n)]


def _run(specs: dict[str, dict], tmp_path: Path, launch: str) -> dict[str, dict]:
    """Every spec in one launch (the processes and their group are reused), each with its own output."""
    results, full = {}, []
    for name, spec in specs.items():
        root = tmp_path / name
        root.mkdir()
        full.append({**spec, "out": str(root / "result.json"), "root_dir": str(root)})
    (tmp_path / f"{launch}.json").write_text(json.dumps(full))
    proc = run_python([str(SCRIPT), str(tmp_path / f"{launch}.json")], timeout=420)
    assert proc.returncode == 0, f"{launch} failed:\n{proc.stdout[-3000:]}\n{first_errors(proc.stderr)}\n{proc.stderr[-5000:]}"
    for name, spec in zip(specs, full):
        result = json.loads(Path(spec["out"]).read_text())
        result["params"] = torch.load(result["params_path"], weights_only=True)
        results[name] = result
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grpo")
    model = write_chat_llama(root / "model", make_tokenizer("chatml"), seed=5)
    data = root / "data"
    write_jsonl(data / "train.jsonl", _prompts(24, 0))
    write_jsonl(data / "val.jsonl", _prompts(5, 1))  # 5: an uneven split of the held-out prompts over 2 ranks
    return {"model_dir": str(model), "data_dir": str(data), "max_steps": STEPS, "lr": 2e-2, "beta": 0.05,
            "num_generations": 4, "max_completion_length": 8}


def _same_run(a: dict, b: dict, what: str) -> None:
    assert a["rollouts"] == b["rollouts"] or _same_rollouts(a["rollouts"], b["rollouts"]), what
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), msg=what)
    assert a["params"].keys() == b["params"].keys()
    for name, value in a["params"].items():
        _close_but_for_adam_noise(b["params"][name], value, f"{what}: {name}")


def _close_but_for_adam_noise(actual: torch.Tensor, expected: torch.Tensor, what: str, lr: float = 2e-2) -> None:
    """fp32 tolerance everywhere but in at most one element per tensor, which may be off by up to ``lr``: Adam turns
    float noise in a gradient element that is mathematically ~0 into a step of up to ``lr`` (the noise itself comes
    from summing the same values in another order across ranks)."""
    off = ~torch.isclose(actual, expected, rtol=1.3e-6, atol=1e-5)
    assert int(off.sum()) <= 1, f"{what}: {int(off.sum())} elements differ"
    assert not off.any() or float((actual - expected).abs()[off].max()) <= lr, what


def _same_rollouts(a: list[dict], b: list[dict]) -> bool:
    """Token for token, advantages and sampling log-probabilities to fp32 tolerance."""
    assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b))
    for x, y in zip(a, b):
        for key, row in x.items():
            assert row["ids"] == y[key]["ids"], key
            torch.testing.assert_close(torch.tensor(y[key]["advantage"]), torch.tensor(row["advantage"]))
            torch.testing.assert_close(torch.tensor(y[key]["logprobs"]), torch.tensor(row["logprobs"]))
    return True


def test_grpo_is_the_same_at_any_split_and_rollout_mode_and_resumes(setup, tmp_path):
    full_ft = {**setup, "lora": False, "reference": "copy", "lr": 1e-4, "max_steps": 2}
    singles = _run({"single": {**setup, "strategy": "auto", "devices": 1, "batch_size": 4, "held_out": True},
                    "single_iter": {**setup, "strategy": "auto", "devices": 1, "batch_size": 4, "num_iterations": 2,
                                    "beta": 0.0, "loss_type": "grpo"},
                    "single_full": {**full_ft, "strategy": "auto", "devices": 1, "batch_size": 2}}, tmp_path, "singles")
    ranks_runs = _run({"split": {**setup, "devices": 2, "batch_size": 1, "accumulate": 2},
                       "ranks": {**setup, "devices": 2, "batch_size": 2, "checkpoint_every": 2, "held_out": True,
                                 "rollout_mode": "gather_once"},
                       "stream": {**setup, "devices": 2, "batch_size": 2, "rollout_mode": "stream", "held_out": True},
                       "ranks_iter": {**setup, "devices": 2, "batch_size": 2, "num_iterations": 2, "beta": 0.0,
                                      "loss_type": "grpo"},
                       "split_full": {**full_ft, "devices": 2, "batch_size": 1}}, tmp_path, "ranks")
    single, ranks = singles["single"], ranks_runs["ranks"]
    checkpoint = tmp_path / "ranks" / "ckpt" / "step=2.ckpt"
    assert checkpoint.exists(), sorted((tmp_path / "ranks" / "ckpt").iterdir())
    resumed = _run({"resumed": {**setup, "devices": 2, "batch_size": 2, "ckpt_path": str(checkpoint)}}, tmp_path,
                   "resumed")["resumed"]

    assert len(single["losses"]) == STEPS and len(single["rollouts"]) == STEPS
    assert single["losses"][-1] != single["losses"][0]
    for name in ("split", "ranks", "stream"):
        _same_run(single, ranks_runs[name], name)
    _same_run(singles["single_iter"], ranks_runs["ranks_iter"], "num_iterations=2")
    assert len(singles["single_iter"]["rollouts"]) == STEPS // 2  # one rollout every two steps
    assert ranks["held_out_completions"] == ranks_runs["stream"]["held_out_completions"] == single["held_out_completions"]
    assert len(single["held_out_completions"]["end"]) == 5

    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ranks["losses"][2:]))
    assert resumed["rollouts"] == ranks["rollouts"][2:] or _same_rollouts(resumed["rollouts"], ranks["rollouts"][2:])
    for name, value in ranks["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, msg=name)

    metrics = single["metrics"][-1]
    assert {"reward", "reward_std", "rewards/mean_token_id/mean", "rewards/has_word/std", "kl", "entropy",
            "clip_ratio/region_mean", "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
            "rollout/tokens_per_second", "train/tokens_per_second", "frac_reward_zero_std"} <= metrics.keys()
    assert metrics["kl"] > 0 and metrics["entropy"] > 0
    assert single["held_out"].keys() >= {"held_out_reward_at_start", "held_out_reward", "held_out_accuracy"}
    _full_fine_tune_against_a_sharded_copy(singles["single_full"], ranks_runs["split_full"])


def _full_fine_tune_against_a_sharded_copy(single: dict, sharded: dict) -> None:
    from lightning_fsdp.planner import sharded_numel

    _same_run(single, sharded, "full fine-tune")
    assert len(single["params"]) > 10  # every weight trains
    reference = sharded["reference"]
    assert not reference["trainable"] and reference["equals_file"]  # the reference never changed
    planned = sum(sharded_numel(shape, 2, rank=0) * 4 for shape in reference["shapes"])  # fp32
    assert reference["local_bytes"] == planned
    assert reference["local_bytes"] <= reference["full_bytes"] / 2 * 1.05  # 1/N, not the whole model
