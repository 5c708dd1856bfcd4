"""Meta-device initialisation in one process: torch's own layers, parametrizations and torchmetrics come out as an
eager build does (the sharded run of the same list is ``tests/distributed/test_meta_modules.py``)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torchmetrics.classification import MulticlassAccuracy

import lightning_fsdp  # noqa: F401
from lightning_fsdp.sharding import materialize_meta_module, parameters_on_meta
from tests.helpers import nn_zoo

#: where eager construction itself makes bit equality impossible, and why (these are checked per distribution)
NOT_BIT_EXACT = {
    "TransformerEncoder": "deep-copies one initialised layer num_layers times; on meta each layer is initialised",
    "TransformerDecoder": "deep-copies one initialised layer num_layers times; on meta each layer is initialised",
    "Transformer": "its layers are deep copies too, so the RNG stream at its Xavier re-init differs",
}

BUILDERS, SKIPPED = nn_zoo.zoo()
META_CONTEXTS = {"parameters_on_meta": parameters_on_meta, "torch.device('meta')": lambda: torch.device("meta")}


def test_the_class_list_is_torch_nn_and_every_skip_has_a_reason():
    names = {c.__name__ for c in nn_zoo.torch_nn_classes()}
    covered = set(BUILDERS) - set(nn_zoo.EXTRAS)
    assert covered | set(SKIPPED) == names and not covered & set(SKIPPED)
    print("\n".join(f"skipped {name}: {why}" for name, why in sorted(SKIPPED.items())))  # pytest -rA shows them
    reasons = {why.split(":")[0] for why in SKIPPED.values()}
    assert reasons <= {"owns no parameters when built with default arguments", "lazy", "cannot be built with small arguments"}
    unbuildable = sorted(n for n, why in SKIPPED.items() if why.startswith("cannot"))
    assert unbuildable == ["DataParallel"], unbuildable  # a wrapper: its parameters are the wrapped module's
    assert {"Linear", "MultiheadAttention", "TransformerEncoderLayer", "Transformer", "LSTM", "Embedding"} <= covered
    assert len(covered) >= 37


def _eager_and_materialised(name: str, context) -> tuple[dict, dict]:
    torch.manual_seed(0)
    eager = nn_zoo.state(BUILDERS[name]())
    torch.manual_seed(0)
    with context():
        module = BUILDERS[name]()
    assert any(t.is_meta for t in module.parameters())
    materialize_meta_module(module, torch.device("cpu"))
    return eager, nn_zoo.state(module)


@pytest.mark.parametrize("context", list(META_CONTEXTS), ids=list(META_CONTEXTS))
def test_every_torch_nn_class_materialises_as_it_is_built_eagerly(context):
    """Same seed, one process: bit for bit equal to eager construction, except where eager deep-copies layers."""
    exact_problems, distribution_problems = {}, {}
    for name in BUILDERS:
        eager, meta = _eager_and_materialised(name, META_CONTEXTS[context])
        if name in NOT_BIT_EXACT:
            assert nn_zoo.exact_problems(eager, meta), f"{name} is bit exact now: drop it from NOT_BIT_EXACT"
            if problems := nn_zoo.distribution_problems(eager, meta):
                distribution_problems[name] = problems
        elif problems := nn_zoo.exact_problems(eager, meta):
            exact_problems[name] = problems
    assert not exact_problems and not distribution_problems, (exact_problems, distribution_problems)


def test_transformer_layers_are_initialised_as_torch_does():
    """``nn.Transformer``'s own ``_reset_parameters`` (Xavier over every matrix) runs after its layers' inits."""
    with parameters_on_meta():
        model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
    materialize_meta_module(model, torch.device("cpu"))
    attention = model.encoder.layers[0].self_attn
    assert torch.count_nonzero(attention.in_proj_bias) == 0 and torch.count_nonzero(attention.out_proj.bias) == 0
    bound = (6 / (16 + 8)) ** 0.5  # Xavier-uniform of the 16 x 8 linear1, not Linear's kaiming bound 1/sqrt(8)
    w = model.encoder.layers[0].linear1.weight
    assert w.abs().max() <= bound and w.abs().max() > 1 / 8**0.5


def test_a_parametrized_module_without_an_initialiser_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 2))

    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(2, 2), parametrizations.weight_norm(Scale()))
    with pytest.raises(TypeError, match=r"\['ParametrizedScale'\] own parameters or buffers but define no `reset_parameters"):
        materialize_meta_module(model, torch.device("cpu"))


def test_a_parametrization_buffer_nothing_rederives_is_refused():
    class Masked(nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("mask", (weight.abs() > 0).float())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.mask

        def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with torch.device("meta"):
        linear = nn.Linear(4, 3)
        parametrize.register_parametrization(linear, "weight", Masked(linear.weight))
    with pytest.raises(TypeError, match=r"ParametrizedLinear.weight: the parametrization Masked keeps the buffer 'mask'"):
        materialize_meta_module(linear, torch.device("cpu"))


class _WithMetrics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.sum = torchmetrics.SumMetric()
        self.min = torchmetrics.MinMetric()
        self.acc = MulticlassAccuracy(num_classes=4, average="macro")


def test_real_metric_states_and_defaults_are_never_touched():
    """The bug this replaces: ``to_empty`` over the tree made a SumMetric read uninitialised memory."""
    with parameters_on_meta():
        model = _WithMetrics()
    model.sum.update(torch.tensor([2.0, 3.0]))
    materialize_meta_module(model, torch.device("cpu"))
    assert float(model.sum.compute()) == 5.0
    model.sum.reset()
    assert float(model.sum.sum_value) == 0.0 and float(model.min.min_value) == float("inf")


def test_metrics_built_on_meta_get_real_states_and_defaults():
    with torch.device("meta"):
        model = _WithMetrics()
    assert model.sum.sum_value.is_meta and model.acc.tp.is_meta
    materialize_meta_module(model, torch.device("cpu"))
    fresh = _WithMetrics()
    for name in ("sum", "min", "acc"):
        metric, reference = getattr(model, name), getattr(fresh, name)
        assert metric.device == torch.device("cpu")
        for _ in range(2):  # as built, then after reset(): the defaults are real
            for state, value in reference.metric_state.items():
                assert torch.equal(metric.metric_state[state], value), (name, state)
            metric.reset()
    model.acc.update(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 2]))
    assert float(model.acc.compute()) == pytest.approx(2 / 3)


def test_a_metric_built_on_meta_that_cannot_be_rebuilt_is_refused_before_allocation():
    class Offset(torchmetrics.Metric):
        def __init__(self, start: float) -> None:  # `start` is not kept as an attribute
            super().__init__()
            self.add_state("total", torch.tensor(start), dist_reduce_fx="sum")

        def update(self, x: torch.Tensor) -> None:
            self.total += x.sum()

        def compute(self) -> torch.Tensor:
            return self.total

    with torch.device("meta"):
        model = nn.ModuleDict({"linear": nn.Linear(2, 2), "offset": Offset(3.0)})
    with pytest.raises(TypeError, match=r"offset \(Offset: its argument 'start' is not kept as an attribute\)"):
        materialize_meta_module(model, torch.device("cpu"))
    assert model.linear.weight.is_meta  # refused before anything was allocated


def test_a_compiled_module_is_refused_before_any_process_starts():
    from tests.helpers.meta_models import LayersAndMetrics

    model = LayersAndMetrics()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="fsdp_custom", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match=r"got a `torch.compile`d module.*plain LightningModule and `compile=True`"):
            trainer.fit(torch.compile(model))
    assert getattr(model, "_compiler_ctx", None) is None  # the module the user holds has its own methods back
    assert trainer.strategy.lightning_module is None
