"""``lightning-fsdp chat MODEL`` as users type it: one-shot answers from the console script, a conversation in a
real pseudo-terminal, a LoRA checkpoint talked to without an export, and the refusals.

Every answer is checked against transformers' own greedy ``generate`` on the same chat-templated messages. The tiny
Llama's generation config suppresses the tokens that do not decode to printable text, so its (random) answers are
words a terminal shows as typed, and the suppression has to reach every path (directory, checkpoint) to match.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lightning_fsdp.commands import chat  # noqa: E402
from lightning_fsdp.commands.consolidate import main as consolidate  # noqa: E402
from tests.helpers.hf import LORA  # noqa: E402
from tests.helpers.launch import child_env  # noqa: E402
from tests.helpers.sft import make_tokenizer, write_chat_llama  # noqa: E402
from tests.scripts.ckpt_jobs import job  # noqa: E402

CONSOLE = Path(sys.executable).with_name("lightning-fsdp")
NEW_TOKENS = 12
FIRST, SECOND = "alpha river stone", "seven bright window"


def _readable_answers_only(model_dir: Path) -> Path:
    """Suppress, in the directory's generation config, every special token but EOS and every token that does not
    decode to printable text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    specials = {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder} - {tokenizer.eos_token_id}
    suppressed = [i for i in range(len(tokenizer)) if i in specials or not _printable(tokenizer.decode([i]))]
    config_file = model_dir / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "suppress_tokens": suppressed}, indent=2))
    return model_dir


def _printable(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and text.isprintable()


def greedy(model: Any, tokenizer: Any, messages: list[dict[str, str]], new_tokens: int = NEW_TOKENS) -> str:
    """transformers' greedy ``generate`` after the chat template's generation prompt, decoded without specials."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    configured = model.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *([configured] if isinstance(configured, int) else configured or [])}
    output = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], do_sample=False,
                            max_new_tokens=new_tokens, eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a ChatML tokenizer and template, as a downloaded model directory holds them; its
    head tied to the embedding, as small chat models have it."""
    root = tmp_path_factory.mktemp("chat")
    model = write_chat_llama(root / "model", make_tokenizer("chatml"), tie_word_embeddings=True)
    return _readable_answers_only(model)


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``lightning-fsdp chat ARGS`` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = chat.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_prints_the_greedy_answer_and_exits(model_dir):
    import subprocess

    model, tokenizer = _load(model_dir)
    expected = greedy(model, tokenizer, [_user(FIRST)])
    assert expected.strip(), "the tiny model answers nothing; the comparison would be empty"
    args = ["chat", str(model_dir), "--prompt", FIRST, "--max-new-tokens", str(NEW_TOKENS)]
    done = subprocess.run([str(CONSOLE), *args], capture_output=True, text=True, timeout=240, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected + "\n"  # streamed token by token, then the line ends
    assert "error" not in done.stderr.lower(), done.stderr[-3000:]


def test_conversation_in_a_terminal_keeps_its_history_until_reset(model_dir):
    import pexpect

    model, tokenizer = _load(model_dir)
    first = greedy(model, tokenizer, [_user(FIRST)])
    second = greedy(model, tokenizer, [_user(FIRST), {"role": "assistant", "content": first}, _user(SECOND)])
    alone = greedy(model, tokenizer, [_user(SECOND)])
    assert second != alone, "the history changes nothing for the tiny model; pick other questions"
    child = pexpect.spawn(str(CONSOLE), ["chat", str(model_dir), "--max-new-tokens", str(NEW_TOKENS)],
                          env=child_env(), encoding="utf-8", timeout=120)
    try:
        answers = []
        child.expect_exact(chat.USER_PROMPT)
        for question in (FIRST, SECOND, chat.RESET, SECOND):
            child.sendline(question)
            if question == chat.RESET:
                child.expect_exact(chat.USER_PROMPT)
                continue
            child.expect_exact(chat.ASSISTANT_PREFIX)
            child.expect_exact("\r\n" + chat.USER_PROMPT)  # the answer's line ends, then the next prompt
            answers.append(child.before.replace("\r\n", "\n"))
        child.sendline(chat.EXIT)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert answers == [first, second, alone]
    assert child.exitstatus == 0


@pytest.fixture(scope="module")
def lora_checkpoint(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two LoRA steps at a large learning rate (adapters far from zero) saved as a sharded checkpoint that refers to
    the base directory, and its merged export."""
    root = tmp_path_factory.mktemp("chat_lora")
    spec = {"devices": 1, "max_steps": 2, "batch_size": 4, "data": {"n": 8}, "save_path": str(root / "lora.ckpt"),
            "hf": {"model_dir": str(model_dir), "lora": LORA, "lr": 0.05},
            "strategy_kwargs": {"pretrained_weights": str(model_dir)}}
    job(spec, root, "lora", timeout=240)
    assert consolidate([str(root / "lora.ckpt"), str(root / "export"), "--format", "hf", "--no-progress"]) == 0
    return root / "lora.ckpt", root / "export"


def test_a_lora_checkpoint_answers_like_its_merged_export(model_dir, lora_checkpoint, capsys):
    ckpt, export = lora_checkpoint
    in_memory, tokenizer = chat.load_chat_model(ckpt)  # the base's tokenizer
    exported, _ = chat.load_chat_model(export)
    base, _ = chat.load_chat_model(model_dir)
    assert in_memory.lm_head.weight is in_memory.model.embed_tokens.weight  # still one tensor, as trained
    merged = in_memory.state_dict()
    assert merged.keys() == exported.state_dict().keys()
    for name, value in exported.state_dict().items():
        assert torch.equal(merged[name], value), name
    assert not all(torch.equal(merged[k], v) for k, v in base.state_dict().items()), "the adapters changed nothing"
    args = ["--prompt", FIRST, "--max-new-tokens", str(NEW_TOKENS)]
    answers = {name: _cli([str(path), *args], capsys) for name, path in
               {"ckpt": ckpt, "export": export, "base": model_dir}.items()}
    assert all(code == 0 for code, _, _ in answers.values()), answers
    assert answers["ckpt"][1] == answers["export"][1]
    assert answers["ckpt"][1] != answers["base"][1]
    expected = greedy(exported, tokenizer, [_user(FIRST)])
    assert answers["ckpt"][1] == expected + "\n"
    assert chat.reply(in_memory, tokenizer, [_user(FIRST)], NEW_TOKENS) == expected  # no streamer: the text alone


def test_a_moved_base_needs_base(model_dir, lora_checkpoint, tmp_path, capsys):
    ckpt, _ = lora_checkpoint
    moved = tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    code, out, _ = _cli([str(ckpt), "--base", str(moved), "--prompt", FIRST, "--max-new-tokens", "4"], capsys)
    assert code == 0 and out.strip()
    code, _, err = _cli([str(ckpt), "--base", str(tmp_path / "nowhere"), "--prompt", FIRST], capsys)
    assert code == 1 and "--base DIR" in err, err
    # ``eval`` reads a checkpoint the same way, and refuses it the same way, before any model is built
    from lightning_fsdp.commands import eval as eval_command

    code = eval_command.main([str(ckpt), "--tasks", "python_docs", "--base", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("lightning-fsdp eval: error:") and "--base DIR" in err, err


def test_refuses_what_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("not a model")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    cases = {
        "missing": (tmp_path / "missing", "no such file or directory"),
        "neither": (tmp_path / "notes", "neither a Hugging Face model directory (no config.json) nor a sharded"),
        "other file": (tmp_path / "weights.bin", "only a .gguf model is read"),
    }
    for what, (path, message) in cases.items():
        code, out, err = _cli([str(path), "--prompt", "hi"], capsys)
        assert code == 1 and out == "", what
        assert err.startswith(f"lightning-fsdp chat: error: {path}") and message in err, (what, err)


def test_a_tokenizer_without_a_chat_template_needs_one(model_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    code, _, err = _cli([str(bare), "--prompt", FIRST], capsys)
    assert code == 1 and "has no chat template" in err and "--chat-template FILE" in err, err
    template = tmp_path / "chatml.jinja"
    template.write_text((model_dir / "chat_template.jinja").read_text())
    args = ["--prompt", FIRST, "--max-new-tokens", str(NEW_TOKENS)]
    with_template = _cli([str(bare), "--chat-template", str(template), *args], capsys)
    assert with_template[:2] == _cli([str(model_dir), *args], capsys)[:2]


@pytest.mark.slow
def test_the_real_gguf_model_answers_like_transformers():
    """SmolLM2-135M-Instruct from its GGUF file (converted once into the tests' cache) against greedy ``generate``
    on the converted directory; the template's own default system prompt applies to both."""
    import subprocess

    from tests.helpers.real_model import TEST_CACHE, smollm2_dir, smollm2_gguf

    question = "What is the capital of France?"
    model, tokenizer = _load(smollm2_dir())
    expected = greedy(model, tokenizer, [_user(question)], new_tokens=16)
    done = subprocess.run([str(CONSOLE), "chat", str(smollm2_gguf()), "--prompt", question, "--max-new-tokens", "16"],
                          capture_output=True, text=True, timeout=600,
                          env=child_env({"LIGHTNING_FSDP_CACHE": str(TEST_CACHE)}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected + "\n"
    assert "Paris" in expected
