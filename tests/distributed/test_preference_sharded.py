"""DPO with LoRA, sharded for real (gloo processes, ``fsdp_custom``), from :class:`PreferenceDataModule` files.

One set of runs, asserted several ways:

- the same global batch of 4 pairs split as (1 process × 4), (2 ranks × 2) and (2 ranks × 1 × accumulate 2) gives
  the same per-step losses, validation metrics and final adapters at fp32 tolerance (the reference model, the base
  with the adapters off, runs inside every step's sharded forward);
- a run resumed from its mid-epoch checkpoint (step 2 of 4) continues with the next pairs and ends equal to the
  uninterrupted one;
- the training actually prefers the chosen answers: reward accuracy on the training pairs rises;
- the three reference models (adapters off, a frozen sharded copy, precomputed log-probs) give the same losses and
  adapters at 2 ranks;
- a full fine-tune's DPO against its frozen copy, sharded 1/N per rank as the planner says, equals the one-process
  run (2 ranks × 1 × accumulate 2 = 1 process × 2).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, run_python
from tests.helpers.sft import WORDS, make_tokenizer, write_chat_llama, write_jsonl

pytest.importorskip("peft")
SCRIPT = REPO / "tests" / "scripts" / "preference_train.py"
STEPS = 4


def _pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, 6)
        rows.append({"prompt": [{"role": "user", "content": " ".join(words[:2])}],
                     "chosen": [{"role": "assistant", "content": " ".join(words[2:2 + rng.randint(1, 3)])}],
                     "rejected": [{"role": "assistant", "content": " ".join(rng.sample(WORDS, rng.randint(1, 4)))}]})
    return rows


def _run(specs: dict[str, dict], tmp_path: Path, launch: str) -> dict[str, dict]:
    """Every spec in one launch (the processes and their group are reused), each with its own output."""
    import json

    results, full = {}, []
    for name, spec in specs.items():
        root = tmp_path / name
        root.mkdir()
        full.append({**spec, "out": str(root / "result.json"), "root_dir": str(root)})
    (tmp_path / f"{launch}.json").write_text(json.dumps(full))
    proc = run_python([str(SCRIPT), str(tmp_path / f"{launch}.json")], timeout=420)
    assert proc.returncode == 0, f"{launch} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for name, spec in zip(specs, full):
        result = json.loads(Path(spec["out"]).read_text())
        result["params"] = torch.load(result["params_path"], weights_only=True)
        results[name] = result
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dpo")
    model = write_chat_llama(root / "model", make_tokenizer("chatml"), seed=5)
    data = root / "data"
    write_jsonl(data / "train.jsonl", _pairs(40, 0))
    write_jsonl(data / "val.jsonl", _pairs(7, 1))  # 7: an uneven last round at 2 ranks, padded with empty pairs
    return {"model_dir": str(model), "data_dir": str(data), "max_steps": STEPS, "lr": 2e-2, "beta": 0.5}


def test_dpo_is_the_same_at_any_split_and_resumes_mid_epoch(setup, tmp_path):
    # a small step: Adam's first update is near sign(g), and lr scales the rounding of entries whose g is ~0
    full_ft = {**setup, "lora": False, "reference": "copy", "lr": 1e-4}
    singles = _run({"single": {**setup, "strategy": "auto", "devices": 1, "batch_size": 4, "validate": True},
                    "single_full": {**full_ft, "strategy": "auto", "devices": 1, "batch_size": 2, "max_steps": 2}},
                   tmp_path, "singles")
    splits = _run({"split": {**setup, "devices": 2, "batch_size": 1, "accumulate": 2, "validate": True},
                   "split_full": {**full_ft, "devices": 2, "batch_size": 1, "max_steps": 2}}, tmp_path, "splits")
    ranks_runs = _run({"ranks": {**setup, "devices": 2, "batch_size": 2, "checkpoint_every": 2},
                       "ranks_copy": {**setup, "devices": 2, "batch_size": 2, "reference": "copy"},
                       "ranks_precomputed": {**setup, "devices": 2, "batch_size": 2, "reference": "precomputed"}},
                      tmp_path, "ranks")
    single, split, ranks = singles["single"], splits["split"], ranks_runs["ranks"]
    checkpoint = tmp_path / "ranks" / "ckpt" / "step=2.ckpt"
    assert checkpoint.exists(), sorted((tmp_path / "ranks" / "ckpt").iterdir())
    resumed = _run({"resumed": {**setup, "devices": 2, "batch_size": 2, "ckpt_path": str(checkpoint)}}, tmp_path,
                   "resumed")["resumed"]

    assert len(single["losses"]) == STEPS and single["losses"][0] == pytest.approx(0.6931, abs=1e-3)  # policy = ref
    for other in (split, ranks, ranks_runs["ranks_copy"], ranks_runs["ranks_precomputed"]):
        torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(single["losses"]))
        assert other["params"].keys() == single["params"].keys()
        for name, value in single["params"].items():
            torch.testing.assert_close(other["params"][name], value, msg=name)
    assert single["val"].keys() >= {"val_loss", "val_reward_accuracy", "val_reward_margin", "val_chosen_logps"}
    for key, value in single["val"].items():  # every held-out pair once, padding pairs counted for nothing
        assert split["val"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ranks["losses"][2:]))
    for name, value in ranks["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, msg=name)
    assert single["losses"][-1] < single["losses"][0]  # the chosen answers are being preferred
    _full_fine_tune_against_a_sharded_copy(singles["single_full"], splits["split_full"])


def _full_fine_tune_against_a_sharded_copy(single: dict, sharded: dict) -> None:
    """Every weight trains against a frozen copy: the same steps sharded and in one process, the copy holding 1/N
    of the model's bytes on each rank (rank 0: the largest shard, as the planner counts it)."""
    from lightning_fsdp.planner import sharded_numel

    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]))
    assert single["losses"][0] == pytest.approx(0.6931, abs=1e-4) and single["losses"][1] != single["losses"][0]
    assert sharded["params"].keys() == single["params"].keys() and len(single["params"]) > 10
    for name, value in single["params"].items():
        torch.testing.assert_close(sharded["params"][name], value, msg=name)
    reference = sharded["reference"]
    assert not reference["trainable"]
    planned = sum(sharded_numel(shape, 2, rank=0) * 4 for shape in reference["shapes"])  # fp32
    assert reference["local_bytes"] == planned
    assert reference["local_bytes"] <= reference["full_bytes"] / 2 * 1.05  # 1/N, not the whole model
