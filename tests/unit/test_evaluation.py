"""``lightning-fsdp eval`` refuses bad input before any model is loaded, each error naming the problem and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")


def _eval(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from lightning_fsdp.commands import eval as command

    code = command.main(argv)
    return code, capsys.readouterr().err


def test_an_unknown_task_is_named_with_close_matches(tmp_path, capsys):
    code, err = _eval([str(tmp_path / "no-model"), "--tasks", "python_doc"], capsys)
    assert code == 1 and "Unknown lm-eval task(s): 'python_doc'" in err and "python_docs" in err
    assert "--include_path" in err


def test_a_task_folder_that_does_not_parse_names_the_file(tmp_path, capsys):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    code, err = _eval([str(tmp_path), "--tasks", "broken", "--include_path", str(tmp_path / "tasks")], capsys)
    assert code == 1 and "broken.yaml does not parse" in err


def test_a_task_that_needs_the_network_is_refused_when_none_is_reachable(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(
        "task: hub_only\ndataset_path: nobody-here/no-such-dataset\noutput_type: loglikelihood\ntest_split: test\n"
        "doc_to_text: question\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    code, err = _eval([str(tmp_path), "--tasks", "hub_only", "--include_path", str(tmp_path / "tasks")], capsys)
    assert code == 1 and "hub_only (nobody-here/no-such-dataset)" in err and "not reachable" in err


def test_a_chat_template_asked_of_a_model_without_one(tmp_path, capsys):
    from tests.helpers.sft import make_tokenizer, write_chat_llama

    model = write_chat_llama(tmp_path / "model", make_tokenizer("chatml"))
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"no_template"'))
    for template in model.glob("chat_template.*"):
        template.unlink()
    code, err = _eval([str(model), "--tasks", "python_docs", "--apply_chat_template"], capsys)
    assert code == 1 and "has no chat template" in err


def test_not_a_model_names_what_model_may_be(tmp_path, capsys):
    code, err = _eval([str(tmp_path), "--tasks", "python_docs"], capsys)
    assert code == 1 and "neither a Hugging Face model directory (no config.json) nor a sharded checkpoint" in err


def test_without_lm_eval_the_error_names_the_install_command(tmp_path, capsys, monkeypatch):
    from lightning_fsdp.evaluation import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-fsdp\[eval\]'"):
        require_lm_eval()
    code, err = _eval([str(tmp_path), "--tasks", "python_docs"], capsys)
    assert code == 1 and "lightning-fsdp[eval]" in err


def test_the_package_tasks_ship_their_rows():
    from lightning_fsdp.evaluation.harness import TASKS_DIR

    rows = (TASKS_DIR / "python_docs.jsonl").read_text().splitlines()
    assert len(rows) == 60 and {p.name for p in TASKS_DIR.glob("*.yaml")} == {"python_docs.yaml",
                                                                               "python_docstring_choice.yaml"}
    assert Path(TASKS_DIR / "utils.py").is_file()


@pytest.mark.parametrize("clean_up", [False, True])
def test_every_tokens_text_is_the_one_decode_gives(clean_up):
    """The stop-sequence scan reads the vocabulary through the Rust tokenizer; each text equals ``decode([id])``,
    with and without transformers' clean-up of spaces before punctuation."""
    from lightning_fsdp.evaluation.harness import token_texts
    from tests.helpers.sft import make_tokenizer

    tokenizer = make_tokenizer("chatml")
    tokenizer.clean_up_tokenization_spaces = clean_up
    texts = token_texts(tokenizer)
    assert len(texts) == len(tokenizer) and texts == [tokenizer.decode([i]) for i in range(len(tokenizer))]
