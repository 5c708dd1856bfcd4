"""Any LightningModule as people write it, built on the meta device and sharded over 2 real gloo ranks: torch's own
layers, parametrizations and torchmetrics come out right. One process launch (``tests/scripts/meta_modules.py``)
serves every test here; the single-process reference runs in this process.

What is exact and what is distributional: in one process a meta-device build materialises bit for bit as an eager
build (``tests/unit/test_meta_init.py``). Sharded, every random fill is drawn whole from one stream and each rank
keeps its rows, so random tensors equal eager construction too, except where torch's own construction differs from
its initialiser (the ``nn.Transformer*`` stacks deep-copy one layer: compared in distribution); training from the
sharded run's initial weights equals one process at fp32 default tolerances.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from tests.helpers import nn_zoo
from tests.helpers.launch import SCRIPTS, run_python
from tests.helpers.meta_models import LayersAndMetrics, RecordLosses, loaders, trainer_kwargs


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_modules")
    proc = run_python([str(SCRIPTS / "meta_modules.py"), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    result = json.loads((out / "result.json").read_text())
    result["initial"] = torch.load(out / "initial.pt", weights_only=True)
    result["final"] = torch.load(out / "final.pt", weights_only=True)
    return result


@pytest.fixture(scope="module")
def reference(launched):
    """The same module in one process, started from the sharded run's initial weights, on the same batches."""
    model = LayersAndMetrics(meta_metrics=False)
    model.load_state_dict(launched["initial"])
    recorder = RecordLosses()
    trainer = L.Trainer(devices=1, strategy="auto", callbacks=[recorder], **trainer_kwargs())
    trainer.fit(model, *loaders(1))
    return {"losses": recorder.losses, "history": model.history, "final": nn_zoo.state(model)}


def test_every_torch_nn_class_sharded_on_meta_matches_eager_construction(launched):
    zoo, skipped = launched["zoo"], launched["skipped"]
    builders, expected_skips = nn_zoo.zoo()
    assert set(zoo) == set(builders) and skipped == expected_skips
    problems = {name: entry["problems"] for name, entry in zoo.items() if entry["problems"]}
    assert not problems, problems
    assert all(entry["sharded"] == ["DTensor"] for entry in zoo.values())
    # deterministic parts are exact across the shards: norms' ones and zeros, attention's zero biases, BN's buffers
    assert set(zoo["BatchNorm1d"]["exact"]) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert {"in_proj_bias", "out_proj.bias"} <= set(zoo["MultiheadAttention"]["exact"])
    assert zoo["LayerNorm"]["exact"] == ["bias", "weight"]


def test_a_transformer_encoder_and_a_weight_norm_head_train_as_one_process(launched, reference):
    assert launched["wrapped_units"] == ["encoder.layers.0", "encoder.layers.1", ""]
    torch.testing.assert_close(torch.tensor(launched["losses"]), torch.tensor(reference["losses"]))
    assert launched["final"].keys() == reference["final"].keys()
    assert "head.parametrizations.weight.original0" in reference["final"]
    for name, value in reference["final"].items():
        torch.testing.assert_close(launched["final"][name], value, msg=lambda m: f"{name}: {m}")


def test_metrics_made_in_init_in_configure_model_and_on_meta_equal_one_process(launched, reference):
    """MeanMetric, SumMetric, MulticlassAccuracy and a MetricCollection, each epoch (reset in between)."""
    history, expected = launched["history"], reference["history"]
    assert len(history) == len(expected) == 2
    for epoch, (values, ref) in enumerate(zip(history, expected)):
        assert values.keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(values[key], value, msg=lambda m: f"epoch {epoch} {key}: {m}")
        by_set = {}
        for key, value in values.items():
            set_name, metric = key.split("/")
            by_set.setdefault(metric, set()).add(value)
        assert all(len(v) == 1 for v in by_set.values()), by_set  # the three sets saw the same inputs: same values
    assert launched["states_after_reset"] and all(launched["states_after_reset"].values()), launched["states_after_reset"]


def test_a_compiled_module_is_refused_on_every_rank(launched):
    errors = launched["compiled_errors"]
    assert len(errors) == 2
    for error in errors:
        assert error is not None and "Pass the plain LightningModule and `compile=True` to the strategy" in error
