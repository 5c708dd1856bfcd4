"""Hugging Face fine-tuning, run for real: a Llama-style directory written with ``save_pretrained`` (several shards),
a model built on the meta device in ``configure_model``, real transformers and PEFT, gloo processes.

- full fine-tune: the shards are read straight into each rank's parameters and the run equals ``from_pretrained``
  in one process on the same global batches (fp32 default tolerances), from bf16 files into fp32 master weights;
- LoRA: starts at the base model's loss, trains only the adapters, saves checkpoints that refer to the base
  instead of storing it, resumes exactly, refuses a base that changed or went missing, and exports a HF model
  (merged) and a PEFT adapter that transformers and PEFT load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_fsdp.commands.consolidate import main as consolidate
from tests.distributed.test_parity import assert_parity
from tests.helpers.hf import LORA, write_llama
from tests.helpers.launch import train
from tests.scripts.ckpt_jobs import errors_by_rank, job

pytest.importorskip("transformers")
pytest.importorskip("peft")

GLOBAL_BATCH = 8
STEPS = 6
#: Adam normalises each update, so a weight whose gradient is ~0 moves by ±lr on noise alone; at fine-tuning
#: rates (1e-3) that noise stays within the fp32 default tolerance, as in the package's other parity tests
LR = 1e-3
LORA_LR = 1e-2


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("bf16") / "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def reference(bf16_llama, tmp_path_factory):
    """``AutoModelForCausalLM.from_pretrained`` in one process, the global batch in the sharded runs' order."""
    hf = {"model_dir": str(bf16_llama), "from_pretrained": True, "lr": LR, "loss_chunk": None}  # the whole logits
    spec = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "hf": hf}
    return train(spec, tmp_path_factory.mktemp("reference"), "reference")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: test_parity in default
def test_full_finetune_from_sharded_safetensors_equals_from_pretrained(bf16_llama, reference, tmp_path, world):
    spec = {
        "strategy": "fsdp_custom",
        "devices": world,
        "batch_size": GLOBAL_BATCH // world,
        "max_steps": STEPS,
        "strategy_kwargs": {"pretrained_weights": str(bf16_llama)},
        "hf": {"model_dir": str(bf16_llama), "lr": LR, "loss_chunk": 5},  # chunked: 5 divides no batch's count
    }
    result = train(spec, tmp_path, f"sharded{world}")
    assert result["wrapped_units"] == ["model.model.layers.0", "model.model.layers.1", ""]
    assert_parity(result, reference)  # step 0 included: the loaded weights are the file's
    stderr = result["proc"].stderr
    assert stderr.count("converted to the model's dtypes while loading") == 1, stderr[-3000:]  # one notice, rank 0


# -- LoRA -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """Two epochs of LoRA and one of a full fine-tune, with checkpoints; the LoRA run resumed from its first epoch."""
    root = tmp_path_factory.mktemp("lora")
    base = write_llama(root / "base")
    weights = {"pretrained_weights": str(base)}

    def run(name: str, epochs: int, lora_cfg=LORA, **extra):
        hf = {"model_dir": str(base), "lora": lora_cfg, "lr": LORA_LR}
        spec = {"devices": 2, "max_epochs": epochs, "hf": hf, "strategy_kwargs": weights, **extra}
        return job(spec, root, name, timeout=240)

    every_epoch = {"save_top_k": -1}
    runs = {
        "lora": run("lora", 2, checkpoint_dir=str(root / "lora_ckpt"), checkpoint_kwargs=every_epoch),
        "full": run("full", 1, lora_cfg=None, checkpoint_dir=str(root / "full_ckpt")),
    }
    first_epoch = next((root / "lora_ckpt").glob("epoch=0-*.ckpt"))
    runs["resumed"] = run("resumed", 2, ckpt_path=str(first_epoch))
    return root, base, runs


def test_lora_starts_at_the_base_loss_and_trains_only_adapters(lora):
    from safetensors.torch import load_file

    root, base, runs = lora
    result, full = runs["lora"], runs["full"]
    assert result["losses"][0] == pytest.approx(full["losses"][0], rel=0, abs=0)  # lora_B = 0: the base's output
    file_weights = {}
    for shard in base.glob("*.safetensors"):
        file_weights.update(load_file(str(shard)))
    trainable = result["trainable"]
    assert trainable and all(".lora_A." in k or ".lora_B." in k for k in trainable)
    assert all(result["params"][k].abs().sum() > 0 for k in trainable if ".lora_B." in k)  # the adapters trained
    for key, value in result["params"].items():
        if key not in trainable:  # every frozen weight is still exactly the pretrained one
            file_key = key.removeprefix("model.base_model.model.").replace(".base_layer", "")
            assert torch.equal(value, file_weights[file_key]), key
    trainable_bytes = sum(result["params"][k].numel() * 4 for k in trainable)
    for params, grads, optimizer in result["state_bytes"]:
        # AdamW state for the adapters only, sharded: ~2 × trainable / 2 ranks (row rounding: within 25%)
        assert optimizer == pytest.approx(trainable_bytes, rel=0.25), (optimizer, trainable_bytes)


def test_lora_checkpoint_refers_to_the_base_and_resumes_exactly(lora):
    root, base, runs = lora
    lora_bytes = _dir_bytes(root / "lora_ckpt" / "last.ckpt")
    full_bytes = _dir_bytes(root / "full_ckpt" / "last.ckpt")
    print(f"checkpoint per save: LoRA {lora_bytes / 1024:.0f} KiB, full fine-tune {full_bytes / 1024:.0f} KiB")
    assert lora_bytes <= 0.2 * full_bytes
    straight, resumed = runs["lora"], runs["resumed"]
    steps_per_epoch = len(straight["losses"]) // 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][steps_per_epoch:]))
    for key, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, msg=lambda m: f"{key}: {m}")
    # what `inspect` tells of it: the base it refers to, the HF model and adapter, the tensors not trained
    from lightning_fsdp.checkpoint.summary import describe_checkpoint, format_description

    info = describe_checkpoint(root / "lora_ckpt" / "last.ckpt")
    assert info["referenced_base"]["path"] == str(base) and info["referenced_base"]["frozen_keys"] > 0
    assert info["hf_model"]["adapters"] == ["default"] and info["hf_model"]["class"].endswith("LlamaForCausalLM")
    assert info["not_optimized"] == [] and info["tensors"]["model"]["tensors"] < info["referenced_base"]["frozen_keys"]
    assert "frozen base not stored" in format_description(info)


def test_lora_exports_a_merged_hf_model_and_a_peft_adapter(lora, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, runs = lora
    ckpt = root / "lora_ckpt" / "last.ckpt"
    assert consolidate([str(ckpt), str(tmp_path / "merged"), "--format", "hf", "--max-shard-size", "100KB"]) == 0
    assert consolidate([str(ckpt), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    merged_files = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert "model.safetensors.index.json" in merged_files and "generation_config.json" in merged_files
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    trained = runs["lora"]["params"]
    for name, value in adapter.state_dict().items():
        if ".lora_" in name:  # the exported adapter holds the trained adapter weights
            assert torch.equal(value, trained["model." + name]), name
    expected = adapter.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, msg=lambda m: f"{name}: {m}")


def test_full_finetune_exports_an_hf_model_in_bf16(lora, tmp_path):
    from transformers import AutoModelForCausalLM

    root, base, runs = lora
    assert consolidate([str(root / "full_ckpt" / "last.ckpt"), str(tmp_path / "hf"), "--format", "hf", "--dtype", "bf16"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert model.dtype == torch.bfloat16
    trained = runs["full"]["params"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained["model." + name].to(torch.bfloat16)), name


def _refused_resume(lora, name: str, weights: dict) -> dict[int, str]:
    """Resume the LoRA run's last checkpoint on 2 ranks; it must fail on both: each rank's error."""
    root, base, _ = lora
    errors = root / f"errors_{name}"
    errors.mkdir()
    hf = {"model_dir": str(base if base.exists() else root / "moved"), "lora": LORA}
    spec = {"devices": 2, "max_epochs": 2, "hf": hf, "strategy_kwargs": weights,
            "ckpt_path": str(root / "lora_ckpt" / "last.ckpt"), "error_dir": str(errors)}
    proc = job(spec, root, name, check=False, timeout=180)["proc"]
    assert proc.returncode != 0
    found = errors_by_rank(errors)
    assert sorted(found) == [0, 1], proc.stderr[-3000:]
    return found


def test_resume_refuses_a_missing_base(lora):
    root, base, _ = lora
    os.rename(base, root / "moved")
    try:
        for text in _refused_resume(lora, "missing", {}).values():
            assert "stores only its trainable weights" in text and "cannot be read" in text
    finally:
        shutil.move(root / "moved", base)


@pytest.mark.slow  # test_qlora refuses a changed base in the default suite, through the same identity check
def test_resume_refuses_a_changed_base(lora):
    _, base, _ = lora
    shard = sorted(base.glob("model-*.safetensors"))[-1]
    original = shard.read_bytes()
    data = bytearray(original)
    data[-3] ^= 0x01  # same size, one weight's bits differ
    shard.write_bytes(bytes(data))
    try:
        for text in _refused_resume(lora, "changed", {"pretrained_weights": str(base)}).values():
            assert text.startswith("CheckpointError") and "have changed since it was saved" in text and shard.name in text
    finally:
        shard.write_bytes(original)


def test_a_broken_directory_fails_on_every_rank_before_anything_is_allocated(bf16_llama, tmp_path):
    broken = shutil.copytree(bf16_llama, tmp_path / "broken")
    missing = sorted(broken.glob("model-*.safetensors"))[2]
    missing.unlink()
    errors = tmp_path / "errors"
    errors.mkdir()
    spec = {"devices": 2, "max_epochs": 1, "hf": {"model_dir": str(broken)}, "error_dir": str(errors),
            "strategy_kwargs": {"pretrained_weights": str(broken)}}
    proc = job(spec, tmp_path, "broken", check=False, timeout=120)["proc"]
    assert proc.returncode != 0
    found = errors_by_rank(errors)
    assert sorted(found) == [0, 1], proc.stderr[-3000:]
    for text in found.values():
        assert text.startswith("CheckpointError") and f"{missing.name} is missing (the index names it)" in text


def test_bf16_mixed_holds_frozen_weights_in_bf16_with_the_same_losses_and_adapters(tmp_path):
    """LoRA and QLoRA under bf16-mixed: the frozen embedding, head and norms are held in bf16 (FSDP2 casts them to
    bf16 for every use anyway), so the run computes exactly what it did with them in fp32, in the bytes the
    planner plans."""
    from lightning_fsdp.planner.estimate import PlanOptions, state_bytes
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec, with_lora
    from tests.helpers.hf import TINY_LLAMA

    # the QLoRA base's projections hold whole NF4 scaler blocks (64 × 256 elements) at one rank
    base = write_llama(tmp_path / "base", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=4)
    specs = {}
    for quantize in (None, "nf4"):
        for fp32 in (False, True):
            specs[f"{quantize}-{'fp32' if fp32 else 'bf16'}"] = {
                "strategy": "fsdp_custom", "devices": 1, "batch_size": 4, "max_steps": 3, "precision": "bf16-mixed",
                "strategy_kwargs": {"pretrained_weights": str(base), "quantize_base": quantize},
                "hf": {"model_dir": str(base), "lora": LORA, "lr": LORA_LR}, "keep_frozen_in_fp32": fp32,
            }
    from tests.helpers.launch import train_many

    runs = train_many(specs, tmp_path)
    config = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 4}
    dims = with_lora(llama_dims(config), LORA["r"], LORA["target_modules"])
    for quantize in (None, "nf4"):
        held, reference = runs[f"{quantize}-bf16"], runs[f"{quantize}-fp32"]
        assert held["losses"] == reference["losses"]  # bit-identical compute
        adapters = [k for k in reference["params"] if "lora_" in k]
        assert adapters and all(torch.equal(held["params"][k], reference["params"][k]) for k in adapters)
        planned = state_bytes(llama_model_spec(dims), PlanOptions(precision="bf16-mixed", quantize_base=quantize))
        params, _, optimizer = held["state_bytes"][0]
        assert (params, optimizer) == (planned[0], planned[2]), (quantize, held["state_bytes"], planned)
        assert reference["state_bytes"][0][0] > params  # fp32 frozen weights: more bytes
