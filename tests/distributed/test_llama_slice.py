"""The planner told truthfully at 70B shapes: QLoRA of a slice of Llama-2-70B (its real hidden, MLP, head and
vocabulary sizes; one of its 80 layers) trained through the Trainer on 2 gloo ranks, as the README's 70B rows are
planned: ``32-true``, LoRA r=4 on q/v, activation checkpointing, 128 tokens.

Each of the planner's per-rank terms that a CPU run can see is held to 10% of what the run measures: the parameter
and optimizer bytes (the local shards), and the peak RSS above the imports while training. Loading adds no more
than the rank's share: what training starts with, above the imports, is the rank's own state plus at most 10% of
its share of the files (the rows it read and quantized are released, file pages included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.hf import write_llama_slice
from tests.helpers.launch import run_python

pytest.importorskip("peft")
pytest.importorskip("torchao")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llama_slice.py"
LAYERS, STEPS, SEQ, WORLD = 1, 2, 128, 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("llama_slice")
    base = write_llama_slice(root / "llama-2-70b-slice", LAYERS)
    out = root / "measured.json"
    proc = run_python([str(SCRIPT), str(base), str(out), str(STEPS), str(SEQ)], timeout=1200,
                      env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    return base, json.loads(out.read_text())


def _plan(base: Path):
    from lightning_fsdp.models.hf_causal_lm import DEFAULT_CHUNK_TOKENS
    from lightning_fsdp.planner import PlanOptions, estimate
    from lightning_fsdp.planner.llama import llama_dims, llama_model_spec, with_lora
    from tests.scripts.llama_slice import LORA

    config = json.loads((base / "config.json").read_text())
    spec = llama_model_spec(with_lora(llama_dims(config, SEQ), LORA["r"], LORA["target_modules"]))
    return estimate(spec, PlanOptions(world_size=WORLD, batch_size=1, seq_len=SEQ, quantize_base="nf4",
                                      activation_checkpointing=True, loss_chunk=DEFAULT_CHUNK_TOKENS))


@pytest.mark.slow
def test_the_planner_is_within_10_percent_of_a_llama_2_70b_slice(measured):
    base, rows = measured
    plan = _plan(base)
    for row in rows:
        assert plan.params == pytest.approx(row["params"], rel=0.10), (plan.params, row)
        assert plan.optimizer == pytest.approx(row["optimizer"], rel=0.10), (plan.optimizer, row)
        assert plan.peak == pytest.approx(row["train_peak"], rel=0.10), (plan.as_dict(), row)


@pytest.mark.slow
def test_loading_a_llama_2_70b_slice_adds_no_more_than_the_ranks_share(measured):
    base, rows = measured
    share = sum(f.stat().st_size for f in base.glob("*.safetensors")) / WORLD
    for row in rows:
        above_state = row["loaded_anon"] + row["loaded_file"] - row["params"]
        assert above_state <= 0.10 * share, (above_state / 2**20, share / 2**20, row)
