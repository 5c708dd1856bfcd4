"""QLoRA, run for real: a Llama directory written with ``save_pretrained`` (bf16, several shards), the model built on
the meta device, PEFT LoRA on it, ``quantize_base="nf4"`` with torchao, gloo processes.

The reference is one process: ``from_pretrained``, LoRA, and every frozen projection weight of the decoder layers
replaced by torchao's ``to_nf4`` of its bf16 value — QLoRA's definition of the quantized base. The sharded runs
quantize as they load, each rank from its own rows, and must hold exactly that base. They start from the reference's
initial adapters, loaded, so that the comparison is about the quantized base alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_fsdp.commands.consolidate import main as consolidate
from lightning_fsdp.planner.estimate import PlanOptions, sharded_numel, state_bytes
from tests.distributed.test_parity import assert_parity
from tests.helpers.hf import LORA, write_llama
from tests.helpers.launch import train

pytest.importorskip("peft")
pytest.importorskip("torchao")

#: every projection splits into whole blocks of 64 × 256 elements at 2 and 4 ranks; the base outweighs the
#: embedding and head, as in real models
QLORA_LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
GLOBAL_BATCH = 8
STEPS = 6
LR = 1e-3
QUANTIZED_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _spec(base: Path, world: int, **extra) -> dict:
    hf = {"model_dir": str(base), "lora": LORA, "lr": LR}
    kwargs = {"pretrained_weights": str(base), "quantize_base": "nf4", **extra.pop("strategy_kwargs", {})}
    return {"devices": world, "batch_size": GLOBAL_BATCH // world, "max_steps": STEPS, "hf": hf,
            "strategy_kwargs": kwargs, "load_initial": str(base.parent / "initial_adapters.pt"), **extra}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("qlora") / "llama", dtype=torch.bfloat16, max_shard_size="300KB",
                       **QLORA_LLAMA)


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    hf = {"model_dir": str(base), "from_pretrained": True, "lora": LORA, "lr": LR, "nf4_reference": True}
    spec = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "hf": hf,
            "save_initial": str(base.parent / "initial_adapters.pt")}
    return train(spec, tmp_path_factory.mktemp("reference"), "reference")


@pytest.fixture(scope="module")
def sharded(base, reference, tmp_path_factory):
    """2 ranks, fp32: checkpoints every 3 steps, and the load probed for memory at fit start."""
    root = tmp_path_factory.mktemp("sharded")
    spec = _spec(base, 2, checkpoint_dir=str(root / "ckpt"),
                 checkpoint_kwargs={"every_n_train_steps": 3, "save_top_k": -1}, probe_sharded_load=str(base))
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # every large buffer mapped and unmapped: the load's peaks are visible
    return root, train(spec, root, "sharded", timeout=300, env=env)


def _quantized_keys(result) -> list[str]:
    return [k.removesuffix(".nf4.quantized_data") for k in result["params"] if k.endswith(".nf4.quantized_data")]


def test_qlora_at_two_ranks_equals_the_nf4_reference(sharded, reference):
    _, result = sharded
    keys = _quantized_keys(result)
    assert len(keys) == 2 * QUANTIZED_PER_LAYER and sorted(keys) == sorted(_quantized_keys(reference))
    assert sorted(result["quantized"]["keys"]) == sorted(keys) and result["quantized"]["unquantized"] == []
    # the fields of every gathered NF4 weight equal to_nf4 of the whole bf16 weight (the reference's), exactly
    for key in keys:
        for field in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(result["params"][f"{key}.nf4.{field}"], reference["params"][f"{key}.nf4.{field}"]), key
    assert_parity(result, reference)  # losses and adapters at fp32 default tolerances; the dequantized base exactly
    for key in (k for k in result["params"] if ".lora_B." in k):
        assert result["params"][key].abs().sum() > 0, key  # the adapters trained


def test_qlora_memory_per_rank(sharded, reference, base):
    """Parameter bytes per rank against the same LoRA run unquantized (fp32 master weights), and what loading the
    directory adds on top of the allocated shards."""
    _, result = sharded
    shapes = {k: tuple(v.shape) for k, v in reference["params"].items() if ".nf4." not in k}
    unquantized = max(sum(sharded_numel(s, 2, r) for s in shapes.values()) * 4 for r in range(2))
    for params, _, _ in result["state_bytes"]:
        assert params <= 0.25 * unquantized, (params, unquantized)
    file_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    for peak in result["sharded_load_peaks"]:
        assert peak <= 0.25 * file_bytes, (peak, file_bytes)
    # the planner's per-rank parameter and optimizer bytes are within 10% of the measured run
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec, with_lora

    config = json.loads((base / "config.json").read_text())
    dims = with_lora(llama_dims(config), LORA["r"], LORA["target_modules"])
    planned = state_bytes(llama_model_spec(dims), PlanOptions(world_size=2, quantize_base="nf4"))
    measured = result["state_bytes"][0]
    assert planned[0] == pytest.approx(measured[0], rel=0.10) and planned[2] == pytest.approx(measured[2], rel=0.10)


def test_qlora_checkpoint_holds_no_base_and_resumes_on_one_rank(sharded, base, tmp_path):
    from lightning_fsdp.checkpoint.summary import describe_checkpoint, format_description

    root, result = sharded
    ckpt = root / "ckpt" / "epoch=0-step=3.ckpt"
    info = describe_checkpoint(ckpt)
    assert info["referenced_base"]["path"] == str(base)
    assert info["quantized_base"]["method"] == "nf4" and info["quantized_base"]["weights"] == 2 * QUANTIZED_PER_LAYER
    assert "nf4" in format_description(info)
    assert info["tensors"]["model"]["tensors"] == 2 * 2 * len(LORA["target_modules"])  # the adapters only
    spec = _spec(base, 1, ckpt_path=str(ckpt))
    del spec["load_initial"]  # the adapters come from the checkpoint
    resumed = train(spec, tmp_path, "resumed", timeout=240)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(result["losses"][3:]))
    for key, value in result["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, msg=lambda m: f"{key}: {m}")


def test_qlora_exports_merged_into_the_original_or_the_quantized_base_and_a_peft_adapter(sharded, base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_fsdp.sharding import nf4

    root, result = sharded
    ckpt = str(root / "ckpt" / "last.ckpt")
    assert consolidate([ckpt, str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert consolidate([ckpt, str(tmp_path / "original"), "--format", "hf"]) == 0
    assert consolidate([ckpt, str(tmp_path / "quantized"), "--format", "hf", "--merge-into", "quantized"]) == 0
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    for name, value in adapter.state_dict().items():
        if ".lora_" in name:
            assert torch.equal(value, result["params"]["model." + name]), name
    expected = adapter.merge_and_unload().state_dict()  # the adapters merged into the original base
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "original").state_dict()
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, msg=lambda m: f"{name}: {m}")
    # into the dequantized NF4 base, what training saw: replace each quantized base weight, then merge
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    quantized = {k.removeprefix("model.base_model.model.").replace(".base_layer", "") for k in _quantized_keys(result)}
    with torch.no_grad():
        for name, param in adapter.get_base_model().named_parameters():
            if name.replace(".base_layer", "") in quantized:
                param.copy_(nf4.roundtrip(param))
    expected = adapter.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized").state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], expected["model.layers.0.mlp.up_proj.weight"].new_zeros(1))


def test_a_changed_base_is_refused_on_resume(sharded, base, tmp_path):
    """The base directory the checkpoint refers to changes in place (restored afterwards)."""
    root, _ = sharded
    shard = sorted(base.glob("model-*.safetensors"))[-1]
    original = shard.read_bytes()
    data = bytearray(original)
    data[-3] ^= 0x01  # one weight's bits differ; same size
    shard.write_bytes(bytes(data))
    try:
        spec = _spec(base, 1, ckpt_path=str(root / "ckpt" / "last.ckpt"))
        del spec["load_initial"]
        proc = train(spec, tmp_path, "changed", check=False, timeout=180)["proc"]
    finally:
        shard.write_bytes(original)
    assert proc.returncode != 0
    assert "CheckpointError" in proc.stderr and "have changed since it was saved" in proc.stderr, proc.stderr[-3000:]
    assert shard.name in proc.stderr


@pytest.mark.slow
def test_qlora_at_four_ranks_with_cpu_offload_equals_the_reference(base, reference, tmp_path):
    result = train(_spec(base, 4, strategy_kwargs={"cpu_offload": True}), tmp_path, "offload4", timeout=300)
    assert_parity(result, reference)


@pytest.mark.slow
def test_qlora_on_a_2x2_hsdp_mesh_in_bf16_mixed(base, reference, tmp_path):
    spec = _spec(base, 4, precision="bf16-mixed", strategy_kwargs={"replicate_size": 2, "shard_size": 2})
    result = train(spec, tmp_path, "hsdp_bf16", timeout=300)
    for key in _quantized_keys(result):  # the same base on every replica, exactly
        assert torch.equal(result["params"][f"{key}.nf4.quantized_data"], reference["params"][f"{key}.nf4.quantized_data"])
    # bf16 compute tracks the fp32 reference to bf16's resolution
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_qlora_at_context_parallel_2_trains_as_the_nf4_reference(base, reference, tmp_path):
    """Rows of 8 tokens split over 2 ranks (ring attention through the quantized base): every step's adapter
    gradients and loss equal the one-process NF4 reference on whole rows."""
    from tests.helpers.parity import assert_step_gradients_equal

    hf = {"model_dir": str(base), "from_pretrained": True, "lora": LORA, "lr": LR, "nf4_reference": True}
    initial = str(tmp_path / "initial.pt")
    common = {"max_steps": 3, "seq": 8, "record_gradients": True}
    whole = train({"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "hf": hf, "save_initial": initial,
                   **common}, tmp_path, "whole")
    split = train({**_spec(base, 2, strategy_kwargs={"context_parallel": 2}), "batch_size": GLOBAL_BATCH,
                   "load_initial": initial, **common}, tmp_path, "split", timeout=300)
    assert_step_gradients_equal(split, whole, 3)
    torch.testing.assert_close(torch.tensor(split["logged_losses"]), torch.tensor(whole["logged_losses"]))
