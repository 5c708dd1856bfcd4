"""Reward functions: loaded by dotted path and checked at the edge, code run outside the process with limits, and the
expression task whose answers Python computes."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fsdp.data.expressions import EXPRESSION_FAMILIES, evaluate, expression_rows, write_expression_prompts
from lightning_fsdp.rewards import RewardError, RewardFunctions, code_passes_tests, run_python
from lightning_fsdp.rewards.expressions import concise, correct_value, is_correct, stated_value

H = "tests.helpers.rewards"


def _score(functions: RewardFunctions, n: int = 3) -> torch.Tensor:
    return functions.score(["p"] * n, ["c"] * n, [[1, 2]] * n, {"target": [1] * n, "word": ["c"] * n})


def test_reward_functions_load_by_dotted_path_and_weigh_their_sum():
    functions = RewardFunctions([f"{H}.has_word", f"{H}.mean_token_id"], [2.0, 1.0])
    assert functions.names == ["has_word", "mean_token_id"]
    scores = _score(functions)
    torch.testing.assert_close(scores, torch.tensor([[1.0, 0.015]] * 3))
    torch.testing.assert_close(functions.total(scores), torch.tensor([2.015] * 3))
    with_none = torch.tensor([[float("nan"), 1.0], [float("nan"), float("nan")]])
    total = functions.total(with_none)
    assert total[0] == 1.0 and math.isnan(total[1])  # None counts 0; a completion nothing scored stays NaN


@pytest.mark.parametrize("spec, message", [
    ("nowhere.at_all", "its module 'nowhere' cannot be imported"),
    (f"{H}.missing", "has no callable 'missing'"),
    ("not_dotted", "give a dotted path"),
    (f"{H}.positional_only", "does not take \\['prompts', 'completions'\\]"),
])
def test_a_reward_function_that_cannot_be_used_is_named_before_training(spec, message):
    with pytest.raises(RewardError, match=message):
        RewardFunctions([spec])


@pytest.mark.parametrize("name, message", [
    ("raises", "'raises' raised KeyError"),
    ("returns_nan", "'returns_nan' returned nan for completion 0"),
    ("returns_too_few", "returned 2 rewards for 3 completions"),
])
def test_a_reward_function_that_misbehaves_stops_with_its_name(name, message):
    with pytest.raises(RewardError, match=message):
        _score(RewardFunctions([f"{H}.{name}"]))
    with pytest.raises(RewardError, match="2 reward_weights for 1 reward functions"):
        RewardFunctions([f"{H}.has_word"], [1.0, 2.0])
    with pytest.raises(RewardError, match="at least one reward function"):
        RewardFunctions([])


def test_code_runs_in_another_process_and_its_failures_are_outcomes_not_errors():
    assert run_python("assert 1 + 1 == 2").outcome == "passed"
    assert run_python("assert 1 + 1 == 3").outcome == "failed"
    hang = run_python("while True:\n    pass", timeout=1.0)
    assert hang.outcome == "timeout" and hang.seconds < 5
    assert run_python("import os\nos.abort()").outcome == "crashed"
    assert run_python("x = bytearray(2 << 30)", memory_bytes=256 << 20).outcome == "crashed"
    forks = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)", timeout=1.0)
    assert forks.outcome == "timeout"  # the whole process group is killed, children included


def test_the_code_reward_scores_zero_for_what_hangs_or_crashes_and_counts_it():
    logged: dict[str, float] = {}
    completions = ["```python\ndef f(x):\n    return 2 * x\n```", "def f(x):\n    return x", "def f(x):\n    while True: pass",
                   [{"role": "assistant", "content": "def f(x):\n    import os; os.abort()"}]]
    rewards = code_passes_tests(["q"] * 4, completions, ["assert f(3) == 6"] * 4, timeout=1.0,
                                log_metric=lambda name, value: logged.__setitem__(name, value))
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert logged == {"code/passed": 1.0, "code/failed": 1.0, "code/timeout": 1.0, "code/crashed": 1.0}


def test_the_expression_task_is_right_by_construction(tmp_path):
    rows = expression_rows(90, seed=0)
    assert len({r["expression"] for r in rows}) == 90
    assert {r["family"] for r in rows} == set(EXPRESSION_FAMILIES)
    for row in rows:
        assert repr(evaluate(row["expression"])) == row["answer"]
        assert row["expression"] in row["prompt"][-1]["content"]
    root = write_expression_prompts(tmp_path / "expr", train=40, val=10)
    import json

    val = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    assert not {r["expression"] for r in val} & {r["expression"] for r in train}


def test_the_stated_value_is_read_as_a_grader_reads_it():
    assert stated_value("The Python expression `4 * 11` evaluates to `44` because ...", "4 * 11") == "44"
    assert stated_value("The expression `sum([5, 3, 3])` evaluates to 11.", "sum([5, 3, 3])") == "11"
    assert stated_value("'ROBOT'") == "'ROBOT'"
    assert is_correct("44", "44") and not is_correct("44.0", "44") and is_correct("8.0", "8.0")
    assert is_correct("ROBOT", "'ROBOT'") and is_correct("'ROBOT'", "'ROBOT'") and not is_correct("robot", "'ROBOT'")
    assert is_correct("[0, 4, 6]", "[0, 4, 6]") and not is_correct("[4, 0, 6]", "[0, 4, 6]")
    assert not is_correct("True", "1")
    completions = [[{"role": "assistant", "content": "`44`"}], "It evaluates to 45.", "44"]
    assert correct_value([], completions, answer=["44"] * 3, expression=["4 * 11"] * 3) == [1.0, 0.0, 1.0]
    assert concise([], completions, answer=["44"] * 3) == [1.0, 0.0, 1.0]
