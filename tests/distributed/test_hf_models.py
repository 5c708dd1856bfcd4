"""The Hugging Face models people fine-tune, as users write them: ``self.model(input_ids=x).logits`` with the
model's default config (``use_cache=True``), built on the meta device, loaded with ``pretrained_weights=<dir>``.

- a Llama whose head is tied to the embedding (the files hold the tensor once) under activation checkpointing
  equals ``from_pretrained`` in one eager process (compiled: in one process compiled alike); the tie survives the
  checkpoint, a resume at another world size and the export;
- Mistral, Mixtral and Qwen2-MoE (whose experts transformers fuses while loading) equal ``from_pretrained``; the
  Mixtral export is what ``save_pretrained`` writes, and loading it adds well under a full copy per rank.

All single-process references start in one process; every sharded run is a real 2-rank gloo job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_fsdp.commands.consolidate import main as consolidate
from tests.distributed.test_parity import _checkpoint_keys, assert_parity
from tests.helpers.hf import FAMILIES, write_family, write_llama
from tests.helpers.launch import train, train_many
from tests.helpers.parity import assert_params_up_to_adam_noise

pytest.importorskip("transformers")

GLOBAL_BATCH = 8
STEPS = 6
LR = 1e-3
HEAD, EMBEDDING = "model.lm_head.weight", "model.model.embed_tokens.weight"
NO_CACHE_NOTICE = "run the training forward with use_cache=False"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    dirs = {"tied_llama": write_llama(root / "tied_llama", tie_word_embeddings=True)}
    for family in FAMILIES:
        dirs[family] = write_family(root / family, family)
    return dirs


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    """``AutoModelForCausalLM.from_pretrained`` of every model in one process, on the sharded runs' global batches."""
    def spec(path: Path) -> dict:
        hf = {"model_dir": str(path), "from_pretrained": True, "lr": LR, "loss_chunk": None}  # the whole logits
        return {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "hf": hf}

    return train_many({name: spec(path) for name, path in models.items()}, tmp_path_factory.mktemp("refs"), timeout=300)


def _sharded(path: Path, world: int = 2, **strategy_kwargs) -> dict:
    return {
        "strategy": "fsdp_custom",
        "devices": world,
        "batch_size": GLOBAL_BATCH // world,
        "max_steps": STEPS,
        "empty_init": True,  # on the meta device: no rank ever materialises the model
        "strategy_kwargs": {"pretrained_weights": str(path), **strategy_kwargs},
        # the chunked loss, 5 tokens a chunk (no batch's count divides by it), against the references' whole logits
        "hf": {"model_dir": str(path), "lr": LR, "loss_chunk": 5},
    }


def _assert_parity_up_to_adam_noise(run: dict, reference: dict) -> None:
    """Losses at fp32 defaults; parameters up to Adam's noise (:func:`assert_params_up_to_adam_noise`)."""
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]))
    assert_params_up_to_adam_noise(run["params"], reference["params"], LR)


def _assert_tied(params: dict) -> None:
    assert torch.equal(params[HEAD], params[EMBEDDING])


# -- a tied Llama under activation checkpointing ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied_run(models, tmp_path_factory):
    """2 ranks, activation checkpointing on every decoder layer, a checkpoint at step 3; then that checkpoint resumed
    on 1 rank, saved at the end."""
    root = tmp_path_factory.mktemp("tied")
    spec = _sharded(models["tied_llama"], activation_checkpointing_policy="auto")
    spec.update(checkpoint_dir=str(root / "ckpt"), checkpoint_kwargs={"every_n_train_steps": 3, "save_last": False,
                                                                      "save_top_k": -1})
    run = train(spec, root, "ac")
    resume = {**_sharded(models["tied_llama"], world=1), "ckpt_path": str(root / "ckpt" / "epoch=0-step=3.ckpt"),
              "save_path": str(root / "resumed.ckpt")}
    resume["strategy_kwargs"] = {}  # the checkpoint holds every weight of a full fine-tune: no base to read
    return root, run, train(resume, root, "resumed")


@pytest.mark.slow  # CI: the 2-rank runs here cover the chunked loss under full sharding
def test_tied_llama_on_a_2x2_hsdp_mesh_with_the_chunked_loss_equals_the_whole_logits(models, references, tmp_path):
    run = train(_sharded(models["tied_llama"], world=4, replicate_size=2, shard_size=2), tmp_path, "hsdp")
    assert_parity(run, references["tied_llama"])
    _assert_tied(run["params"])


def test_tied_llama_loads_from_files_holding_the_tensor_once(models, tied_run, references):
    from safetensors import safe_open

    files = list(models["tied_llama"].glob("*.safetensors"))
    keys = {k for f in files for k in safe_open(str(f), framework="pt").keys()}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # as transformers writes it
    _, run, _ = tied_run
    assert_parity(run, references["tied_llama"])  # activation checkpointing with the default use_cache=True
    _assert_tied(run["params"])
    assert run["proc"].stderr.count(NO_CACHE_NOTICE) == 1, run["proc"].stderr[-3000:]  # one notice, rank 0


def test_tied_llama_resumes_on_another_world_size_and_exports_tied(tied_run, tmp_path):
    from transformers import AutoModelForCausalLM

    root, run, resumed = tied_run
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(run["losses"][3:]))
    for name, value in run["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, msg=lambda m: f"{name}: {m}")
    _assert_tied(resumed["params"])
    assert consolidate([str(root / "resumed.ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    index = tmp_path / "hf" / "model.safetensors.index.json"
    from safetensors import safe_open

    written = set(json.loads(index.read_text())["weight_map"]) if index.exists() else set(
        safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt").keys())
    assert "lm_head.weight" not in written  # what from_pretrained expects of a tied model
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed["params"]["model." + name]), name


@pytest.mark.slow  # the default suite compiles a sharded model in tests/distributed/test_parity.py
def test_compiled_blocks_with_activation_checkpointing_equal_one_process(models, tmp_path):
    """Against one process whose decoder layers are checkpointed and compiled as the strategy does (inductor's fused
    kernels may round differently from eager by more than fp32's default tolerances on some CPUs)."""
    kwargs = {"activation_checkpointing_policy": "auto", "compile": True}
    spec = {**_sharded(models["tied_llama"], **kwargs), "count_compiles_after": 2,
            "save_path": str(tmp_path / "compiled.ckpt")}
    hf = {"model_dir": str(models["tied_llama"]), "from_pretrained": True, "lr": LR, "loss_chunk": None}
    reference = {"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "hf": hf,
                 "compile_like_strategy": kwargs}
    run, one = train(spec, tmp_path, "compiled", timeout=400), train(reference, tmp_path, "compiled_one", timeout=400)
    assert_parity(run, one)
    keys = _checkpoint_keys(tmp_path / "compiled.ckpt")  # compiled units keep their eager names
    assert "state_dict/model.model.layers.0.self_attn.q_proj.weight" in keys and not any("_orig_mod" in k for k in keys)
    graphs = run["compiled_graphs"]
    assert graphs["after_warmup"] == graphs["at_end"], graphs  # no recompile after warm-up
    assert graphs["at_end"] <= 2, graphs  # both decoder layers share one graph: no recompile per layer


# -- other families ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_into_the_shards_and_equals_from_pretrained(models, references, family, tmp_path):
    spec = _sharded(models[family])
    env = None
    if family == "mixtral":
        spec.update(probe_sharded_load=str(models[family]), save_path=str(tmp_path / "trained.ckpt"))
        env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # every large buffer mapped and unmapped: peaks are visible
    run = train(spec, tmp_path, family, env=env)
    _assert_parity_up_to_adam_noise(run, references[family])
    if family != "mixtral":
        return
    file_bytes = sum(f.stat().st_size for f in models[family].glob("*.safetensors"))
    peaks = run["sharded_load_peaks"]
    print(f"Mixtral: peak RSS added by the sharded load per rank {[f'{p / 2**20:.2f} MiB' for p in peaks]},"
          f" files {file_bytes / 2**20:.2f} MiB")
    assert all(p <= 0.25 * file_bytes for p in peaks), (peaks, file_bytes)
    _assert_exports_as_save_pretrained(tmp_path / "trained.ckpt", models[family], run["params"], tmp_path / "hf")


def _assert_exports_as_save_pretrained(ckpt: Path, original: Path, trained: dict, out: Path) -> None:
    """``--format hf`` writes the file layout ``save_pretrained`` writes (per-expert tensors under their original
    names), and ``from_pretrained`` of it holds the trained weights."""
    from transformers import AutoModelForCausalLM

    assert consolidate([str(ckpt), str(out), "--format", "hf", "--max-shard-size", "64KB"]) == 0
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    expected = json.loads((original / "model.safetensors.index.json").read_text())["weight_map"]
    assert written.keys() == expected.keys()
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained["model." + name]), name
