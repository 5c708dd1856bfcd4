"""lm-evaluation-harness tasks on the sharded model, against lm-eval's own Hugging Face backend.

One 2-rank Fabric job (``tests/scripts/eval_sharded.py``) scores the package's two local tasks (a multiple-choice
task by log-likelihood, a generative one by greedy decoding) with the shards gathered once and streamed unit by
unit; each equals lm-eval's ``--model hf`` in one process on the same model: the same accuracy, the same
log-likelihoods at fp32 tolerance, the same greedy text. Streamed, no rank ever holds more than two decoder layers
unsharded at once. ``lightning-fsdp eval`` at 1 rank writes lm-eval's results file with the same scores, and at 2
ranks scores a LoRA fine-tune's sharded checkpoint as lm-eval's backend scores its export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import SCRIPTS, run_python
from tests.helpers.sft import make_tokenizer, write_chat_llama

pytest.importorskip("lm_eval")
TASKS = ["python_docstring_choice", "python_docs"]
LIMIT = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama whose output projection is scaled up: its next-token choices win by clear margins, so
    greedy text compares exactly (a random model's near-uniform logits tie within fp32 rounding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("eval")
    random = write_chat_llama(root / "random", make_tokenizer("chatml"), seed=3, num_hidden_layers=4,
                              tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(random)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(random).save_pretrained(root / "model")
    return root / "model"


_HF_BACKEND = r"""
import json, sys
import lm_eval
from lm_eval.models.huggingface import HFLM
from lightning_fsdp.evaluation.harness import task_manager
model_dir, tasks, limit, out = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
results = lm_eval.simple_evaluate(model=HFLM(pretrained=model_dir, device="cpu", batch_size=4), tasks=tasks,
                                  limit=limit, task_manager=task_manager(tasks=tasks), bootstrap_iters=0,
                                  log_samples=True)
json.dump({
    "metrics": {task: {k: v for k, v in r.items() if "," in k and "stderr" not in k}
                for task, r in results["results"].items()},
    "samples": {task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
                for task, rows in results["samples"].items()},
}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def hf_backend(model_dir, tmp_path_factory) -> dict[str, Any]:
    """lm-eval's own Hugging Face backend, one process, the whole model: in a fresh interpreter, as its users run
    it (its accelerate state must not meet another test's)."""
    out = tmp_path_factory.mktemp("hf") / "out.json"
    proc = run_python(["-c", _HF_BACKEND, str(model_dir), ",".join(TASKS), str(LIMIT), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sharded(model_dir, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded")
    spec = {"model_dir": str(model_dir), "devices": 2, "tasks": TASKS, "limit": LIMIT,
            "modes": ["gather_once", "stream"], "out": str(root / "out.json")}
    (root / "spec.json").write_text(json.dumps(spec))
    proc = run_python([str(SCRIPTS / "eval_sharded.py"), str(root / "spec.json")], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((root / "out.json").read_text())


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["metrics"].keys() == theirs["metrics"].keys()
    for task, metrics in theirs["metrics"].items():
        assert ours["metrics"][task] == pytest.approx(metrics), task
    choices, reference = ours["samples"]["python_docstring_choice"], theirs["samples"]["python_docstring_choice"]
    assert len(choices) == len(reference) == LIMIT
    for mine, expected in zip(choices, reference):  # each choice's (log-likelihood, is greedy)
        torch.testing.assert_close(torch.tensor([r[0][0] for r in mine]), torch.tensor([r[0][0] for r in expected]))
        assert [r[0][1] for r in mine] == [r[0][1] for r in expected]
    assert ours["samples"]["python_docs"] == theirs["samples"]["python_docs"]  # the same greedy text


@pytest.mark.parametrize("mode", ["gather_once", "stream"])
def test_sharded_scores_equal_lm_evals_hf_backend(sharded, hf_backend, mode):
    _assert_same(sharded[mode], hf_backend)
    assert sharded[mode]["all_sharded_after"]


def test_streamed_evaluation_never_holds_the_whole_model(sharded):
    assert sharded["layers"] == 4
    assert 1 <= sharded["stream"]["most_unsharded_layers"] <= 2  # the running layer (and the next, prefetched)
    assert sharded["gather_once"]["most_unsharded_layers"] == sharded["layers"]  # the control: gathered once


@pytest.mark.slow
def test_the_command_writes_lm_evals_results_file(model_dir, hf_backend, tmp_path):
    from tests.e2e.test_train_cli import check, cli

    out = tmp_path / "results"
    proc = check(cli(["eval", str(model_dir), "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "-n", "1",
                      "--output_path", str(out)], tmp_path))
    written = json.loads(next(out.rglob("results_*.json")).read_text())
    for task, metrics in hf_backend["metrics"].items():
        assert {k: written["results"][task][k] for k in metrics} == pytest.approx(metrics)
    assert "python_docstring_choice" in proc.stdout and "acc" in proc.stdout  # lm-eval's table


@pytest.mark.slow
def test_evaluating_every_n_steps_trains_exactly_as_without(model_dir, tmp_path):
    """``EvalHarness`` at step 0, every 2 steps and at the end of a 2-rank LoRA fine-tune: the same per-step losses
    and adapters as the run without it (the evaluation restores the mode, the shards and every random generator)."""
    from tests.helpers.sft import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(24, seed=1))
    checkpoint = tmp_path / "plain.ckpt"
    spec = {"model_dir": str(model_dir), "data": str(data), "devices": 2, "max_steps": 4, "root_dir": str(tmp_path),
            "out": str(tmp_path / "out.json"),
            "runs": [{"name": "plain", "save": str(checkpoint)}, {"name": "evaluated", "every": 2}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = run_python([str(SCRIPTS / "eval_callback_train.py"), str(tmp_path / "spec.json")], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    runs = json.loads((tmp_path / "out.json").read_text())
    plain, evaluated = runs["plain"], runs["evaluated"]
    assert len(plain["losses"]) == 4 and plain["losses"] == evaluated["losses"]
    assert plain["adapters"] == evaluated["adapters"]
    assert sorted(int(step) for step in evaluated["history"]) == [0, 2, 4]
    assert all("eval/python_docstring_choice/acc" in metrics for metrics in evaluated["history"].values())
    assert "lm-eval before and after training" in proc.stdout
    _assert_checkpoint_scores_as_its_export(checkpoint, tmp_path)


def _assert_checkpoint_scores_as_its_export(checkpoint: Path, tmp_path: Path) -> None:
    """``lightning-fsdp eval CKPT -n 2`` on the LoRA run's sharded checkpoint (each rank filling its rows of the
    merged model) scores as lm-eval's own backend on ``consolidate --format hf``'s export of it."""
    from lightning_fsdp.commands.consolidate import main as consolidate
    from tests.e2e.test_train_cli import check, cli

    export = tmp_path / "export"
    assert consolidate([str(checkpoint), str(export), "--format", "hf", "--no-progress"]) == 0
    theirs = tmp_path / "theirs.json"
    proc = run_python(["-c", _HF_BACKEND, str(export), ",".join(TASKS), str(LIMIT), str(theirs)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = tmp_path / "results"
    check(cli(["eval", str(checkpoint), "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "-n", "2",
               "--output_path", str(out), "--log_samples"], tmp_path))
    written, reference = json.loads(next(out.rglob("results_*.json")).read_text()), json.loads(theirs.read_text())
    for task, metrics in reference["metrics"].items():
        assert {k: written["results"][task][k] for k in metrics} == pytest.approx(metrics), task
    rows = [json.loads(line) for line in next(out.rglob("samples_python_docs_*.jsonl")).read_text().splitlines()]
    greedy = [row["resps"] for row in sorted(rows, key=lambda row: row["doc_id"])]
    assert len(greedy) == LIMIT and greedy == reference["samples"]["python_docs"]  # the same greedy text
