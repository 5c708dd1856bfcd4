"""The examples run as a user would run them (fresh processes, from a working directory of their own)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import REPO, run_python


@pytest.mark.slow  # the QLoRA example below runs the same path, with the base quantized
def test_hf_lora_example_writes_a_model_fine_tunes_it_and_exports_it(tmp_path):
    pytest.importorskip("peft")
    proc = run_python([str(REPO / "examples" / "finetune_hf_lora.py"), "base", "3"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "outputs" / "finetune_hf_lora"
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()  # several shards, as from the Hub
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (out / "hf_model").iterdir()}
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "trained 57,344 of 3,090,688 parameters" in proc.stdout


@pytest.mark.slow  # test_qlora runs the same path with its exports; the Fabric example below runs in the default suite
def test_hf_qlora_example_quantizes_the_base_fine_tunes_and_exports(tmp_path):
    pytest.importorskip("torchao")
    proc = run_python([str(REPO / "examples" / "finetune_hf_qlora.py"), "base", "3"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "outputs" / "finetune_hf_qlora"
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()
    for export in ("hf_model", "hf_model_nf4"):
        assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in (out / export).iterdir()}
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "28 base weights held in NF4" in proc.stdout  # 7 projections × 4 layers
    assert "stay unquantized" not in proc.stderr


def test_fabric_lora_example_trains_saves_base_free_and_exports(tmp_path):
    pytest.importorskip("peft")
    proc = run_python([str(REPO / "examples" / "fabric_finetune_hf_lora.py"), "base", "3"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "outputs" / "fabric_finetune_hf_lora"

    def size(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    checkpoint = out / "checkpoints" / "step=3.ckpt"
    assert (checkpoint / "manifest.json").is_file()
    assert size(checkpoint) < 0.2 * size(tmp_path / "base")  # the adapters and their optimizer state, no base
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "hf_model").iterdir()}
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "exported 791,680 parameters" in proc.stdout
