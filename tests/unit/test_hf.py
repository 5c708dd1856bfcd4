"""Hugging Face pieces in one process: directory validation, key layouts, meta-device initialisation, loading."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from torch import nn

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.hf import HFDirectory, detect_layout, load_safetensors
from lightning_fsdp.hf.init_rules import LIBRARY_RULES
from lightning_fsdp.hf.load import plan_load
from lightning_fsdp.sharding import DEFAULT_RULES, materialize_meta_module, parameters_on_meta
from tests.helpers.hf import LORA, TINY_LLAMA, write_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture
def copy(llama_dir, tmp_path):
    return shutil.copytree(llama_dir, tmp_path / "copy")


def _meta_llama(lora: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(**TINY_LLAMA)
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM(config)
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


# -- the directory ----------------------------------------------------------------------------------------------------
def test_directory_reads_headers_only(llama_dir):
    directory = HFDirectory.open(llama_dir)
    assert len(directory.files) > 3  # several shards
    assert directory.tensors["lm_head.weight"].shape == (37, 64)
    assert directory.total_bytes == sum((llama_dir / f).stat().st_size for f in directory.files)


def test_missing_shard_and_index_naming_a_missing_file(copy):
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing \(the index names it\).*incomplete"):
        HFDirectory.open(copy)


def test_index_that_disagrees_with_the_files(copy):
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.not_there.weight"] = index["weight_map"]["lm_head.weight"]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"does not agree with the files.*model\.not_there\.weight"):
        HFDirectory.open(copy)


@pytest.mark.parametrize("damage", ["corrupt_header", "truncated", "lying_offsets"])
def test_damaged_files_are_named(copy, damage):
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    if damage == "corrupt_header":
        data = data[:8] + b"{" + b"x" * (n - 1) + data[8 + n :]
    elif damage == "truncated":
        data = data[:-16]
    else:
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 64
        encoded = json.dumps(header).encode().ljust(n)
        data = data[:8] + encoded[:n] + data[8 + n :]
    shard.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is not a valid safetensors file"):
        HFDirectory.open(copy)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_non_regular_files_are_refused_without_blocking(copy, kind):
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    else:
        os.symlink("/dev/zero", shard)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        HFDirectory.open(copy)


def test_symlinked_shards_as_in_the_hub_cache_are_fine(copy, tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in copy.glob("*.safetensors"):
        target = blobs / shard.name
        shutil.move(shard, target)
        os.symlink(target, shard)
    assert HFDirectory.open(copy).tensors


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        HFDirectory.open(tmp_path)


# -- keys ---------------------------------------------------------------------------------------------------------------
def test_layouts_are_detected_for_an_attribute_and_for_peft(llama_dir):
    directory = HFDirectory.open(llama_dir)
    plain = {f"model.{k}": t for k, t in _meta_llama().state_dict().items()}
    assert detect_layout(plain, directory.tensors).prefix == "model."
    wrapped = {f"model.{k}": t for k, t in _meta_llama(lora=True).state_dict().items()}
    plan = plan_load(wrapped, directory)
    assert plan.file_key_of["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert len(plan.adapters) == 2 * 2 * 2  # lora_A and lora_B of q_proj and v_proj in two layers


def test_keys_that_match_no_layout_and_wrong_shapes(llama_dir):
    directory = HFDirectory.open(llama_dir)
    with pytest.raises(CheckpointError, match="No parameter of the model matches.*pretrained_key_map"):
        plan_load({"encoder.w": torch.zeros(2)}, directory)
    wrong = {f"model.{k}": t for k, t in _meta_llama().state_dict().items()}
    wrong["model.lm_head.weight"] = torch.zeros(36, 64, device="meta")
    with pytest.raises(CheckpointError, match=r"lm_head.weight: file shape \(37, 64\), model \(36, 64\)"):
        plan_load(wrong, directory)
    missing = {f"model.{k}": t for k, t in _meta_llama().state_dict().items()} | {"model.extra.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"missing keys \[model\.extra\.weight\]"):
        plan_load(missing, directory)


# -- meta-device initialisation --------------------------------------------------------------------------------------
def test_hf_model_on_meta_is_initialised_the_way_transformers_does_it():
    model = _meta_llama()
    rotary = model.model.rotary_emb
    assert not rotary.inv_freq.is_meta  # computed buffers stay real while parameters go to meta
    assert all(p.is_meta for p in model.parameters())
    materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    torch.testing.assert_close(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(model.model.norm.weight, torch.ones(64))  # RMSNorm: no reset_parameters, HF sets ones
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert std == pytest.approx(TINY_LLAMA.get("initializer_range", 0.02), rel=0.1)


def test_peft_adapters_on_meta_keep_peft_init():
    model = _meta_llama(lora=True)
    materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0  # the fine-tune starts from the base's outputs
    assert torch.count_nonzero(q.lora_A["default"].weight) > 0


def test_peft_inits_that_need_the_base_are_refused():
    config = transformers.LlamaConfig(**TINY_LLAMA)
    with parameters_on_meta():
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**LORA, use_dora=True))
    with pytest.raises(TypeError, match="with DoRA, which needs the pretrained base weights"):
        materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)


def test_a_module_nobody_can_initialise_is_named_unless_its_weights_are_loaded():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(TypeError, match=r"\['Scale'\] own parameters or buffers but define no `reset_parameters\(\)`"):
        materialize_meta_module(model, torch.device("cpu"))
    materialize_meta_module(model, torch.device("cpu"), loaded={"1.w"})  # pretrained weights will fill it


def test_load_safetensors_in_one_process_equals_the_files(llama_dir):
    from safetensors.torch import load_file

    model = _meta_llama()
    materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)
    plan = load_safetensors(model, llama_dir)
    assert not plan.missing and not plan.unexpected
    weights = {}
    for shard in llama_dir.glob("*.safetensors"):
        weights.update(load_file(str(shard)))
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
