"""Tied weights, transformers' load-time conversions and the training-time cache hook, in one process."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.hf import HFDirectory, load_safetensors
from lightning_fsdp.hf.cache import train_without_cache
from lightning_fsdp.hf.conversion import conversion_for, revert_tensor
from lightning_fsdp.hf.init_rules import LIBRARY_RULES
from lightning_fsdp.hf.load import plan_load
from lightning_fsdp.parallel.mesh import local_rows
from lightning_fsdp.sharding import DEFAULT_RULES, materialize_meta_module, parameters_on_meta, tied_aliases
from tests.helpers.hf import FAMILIES, TINY_LLAMA, write_family, write_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    return {
        "tied": write_llama(root / "tied", tie_word_embeddings=True),
        "mixtral": write_family(root / "mixtral", "mixtral"),
        "qwen2_moe": write_family(root / "qwen2_moe", "qwen2_moe"),
    }


def _meta_model(path):
    config = transformers.AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(config)


def _file_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in path.glob("*.safetensors"):
        out.update(load_file(str(shard)))
    return out


def test_tied_aliases_name_every_other_name_of_a_shared_parameter():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": True}))
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    assert tied_aliases(untied) == {}


def test_tied_head_loads_from_the_embedding_stored_once(dirs):
    model = _meta_model(dirs["tied"])
    state = model.state_dict()  # separate tensor objects per name, as a sharded state dict has
    directory = HFDirectory.open(dirs["tied"])
    with pytest.raises(CheckpointError, match=r"missing keys \[lm_head.weight\]"):
        plan_load(state, directory)  # without the model's ties: what every user saw before
    plan = plan_load(state, directory, tied=tied_aliases(model))
    assert plan.file_key_of == {k: k for k in plan.file_key_of} and "lm_head.weight" not in plan.file_key_of
    assert "lm_head.weight" in plan.covered and not plan.missing and not plan.unexpected
    materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)
    load_safetensors(model, dirs["tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, _file_tensors(dirs["tied"])["model.embed_tokens.weight"])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_converted_checkpoints_load_as_from_pretrained_and_revert_to_the_files(dirs, family):
    reference = transformers.AutoModelForCausalLM.from_pretrained(dirs[family]).state_dict()
    model = _meta_model(dirs[family])
    conversion = conversion_for(model, HFDirectory.open(dirs[family]))
    assert conversion is not None and conversion.tensors.keys() == reference.keys()
    fused = conversion.fused["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.row_local and fused.shape == tuple(reference[fused.key].shape)
    files = _file_tensors(dirs[family])
    read_keys: list[str] = []

    def read(key: str) -> torch.Tensor:
        read_keys.append(key)
        return files[key]

    assert torch.equal(fused.rows(3, 5, read), reference[fused.key][3:5])  # the last rank's experts at 2 ranks
    assert sorted(read_keys) == sorted(k for k in fused.file_keys if ".experts.3." in k or ".experts.4." in k)
    materialize_meta_module(model, torch.device("cpu"), rules=LIBRARY_RULES + DEFAULT_RULES)
    plan = load_safetensors(model, dirs[family])
    assert not plan.missing and not plan.unexpected
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
        for file_key, part in revert_tensor(model, name, value).items():  # export writes the original layout
            assert torch.equal(part, files.pop(file_key)), file_key
    assert not files  # every file tensor is written back exactly once


def test_dense_families_need_no_conversion(tmp_path):
    path = write_family(tmp_path / "mistral", "mistral")
    assert "mistral" in FAMILIES and conversion_for(_meta_model(path), HFDirectory.open(path)) is None


def test_local_rows_of_a_plain_tensor_are_all_rows():
    assert local_rows(torch.zeros(5, 3)) == (0, 5)


def test_training_forward_builds_no_cache_while_eval_keeps_it():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    assert model.config.use_cache
    assert train_without_cache(model, ["model.layers.0"]) == [""]
    assert train_without_cache(torch.nn.Linear(2, 2), ["x"]) == []  # nothing from transformers: nothing hooked
    x = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 5))
    model.train()
    assert model(input_ids=x).cache is None
    model.eval()
    with torch.no_grad():
        assert model(input_ids=x).cache is not None  # generate and eval as the user configured them
