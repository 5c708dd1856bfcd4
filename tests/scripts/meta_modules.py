"""One 2-rank launch for meta-device initialisation of modules as people write them (``test_meta_modules.py``).

1. ``LayersAndMetrics`` (``nn.TransformerEncoder``, a ``weight_norm`` head, torchmetrics made three ways) built
   under ``trainer.init_module(empty_init=True)`` and trained 2 epochs with validation: the full parameters at fit
   start and end, the per-step losses, each epoch's metric values, and every metric's states after ``reset()``.
2. Every ``torch.nn`` class that owns parameters (``tests/helpers/nn_zoo.py``) built under the strategy's meta
   context, sharded, materialised: per class, how its whole tensors compare with an eager build's.
3. ``fit(torch.compile(model))``: the error each rank gets.

Rank 0 writes ``argv[1]/result.json``, ``initial.pt`` and ``final.pt``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_fsdp  # noqa: E402,F401
from lightning_fsdp.preparation import Preparation, prepare_model  # noqa: E402
from lightning_fsdp.sharding import ShardingPlan  # noqa: E402
from tests.helpers import nn_zoo  # noqa: E402
from tests.helpers.meta_models import LayersAndMetrics, RecordLosses, _metrics, loaders, trainer_kwargs  # noqa: E402

OUT = Path(sys.argv[1])


class SaveInitial(Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        params = nn_zoo.state(trainer.strategy.model)  # a collective
        if trainer.is_global_zero:
            torch.save(params, OUT / "initial.pt")


def states_after_reset(model: LayersAndMetrics) -> dict[str, bool]:
    """Each metric, reset, holds exactly the states of a freshly built one (its reset defaults are intact)."""
    fresh = _metrics()
    out = {}
    for set_name, metrics in model.metric_sets().items():
        for name, metric in metrics.items():
            for sub, m in (metric.items() if hasattr(metric, "items") else [(name, metric)]):
                m.reset()
                ref = fresh[name][sub] if sub != name else fresh[name]
                out[f"{set_name}/{sub}"] = all(
                    torch.equal(m.metric_state[k], ref.metric_state[k]) for k in ref.metric_state
                ) and str(m.device) == "cpu"
    return out


def main() -> None:
    started = time.perf_counter()
    L.seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("ignore", message=r".*(init_module|does not have many workers|enable_nested_tensor).*")
    recorder = RecordLosses()
    trainer = L.Trainer(devices=2, strategy="fsdp_custom", callbacks=[recorder, SaveInitial()], **trainer_kwargs())
    with trainer.init_module(empty_init=True):
        model = LayersAndMetrics(meta_metrics=True)
    train, val = loaders(trainer.world_size)
    trainer.fit(model, train, val)
    final = nn_zoo.state(trainer.strategy.model)
    result = {
        "wrapped_units": trainer.strategy.wrapped_units,
        "losses": recorder.losses,
        "history": model.history,
        "states_after_reset": states_after_reset(model),
        "fit_seconds": time.perf_counter() - started,
    }

    # 2. every torch.nn class that owns parameters: eager on one process vs built on meta, sharded, materialised
    mesh = trainer.strategy.device_mesh
    builders, skipped = nn_zoo.zoo()
    zoo = {}
    for i, (name, build) in enumerate(builders.items()):
        torch.manual_seed(100 + i)
        eager = nn_zoo.state(build())
        torch.manual_seed(100 + i)
        with trainer.strategy.tensor_init_context(empty_init=True):
            module = build()
        prepare_model(module, mesh, Preparation(ShardingPlan(), torch.device("cpu")))
        meta = nn_zoo.state(module)
        zoo[name] = {
            "problems": nn_zoo.distribution_problems(eager, meta),
            "exact": sorted(k for k in eager if torch.equal(eager[k], meta[k])),
            "tensors": len(eager),
            "sharded": sorted({type(p).__name__ for p in module.parameters()}),
        }
    result.update(zoo=zoo, skipped=skipped, zoo_seconds=time.perf_counter() - started - result["fit_seconds"])

    # 3. a compiled module passed to fit: the error, on every rank, before anything runs
    again = L.Trainer(devices=2, strategy="fsdp_custom", **trainer_kwargs())
    try:
        again.fit(torch.compile(LayersAndMetrics()), train, val)
        error = None
    except TypeError as err:
        error = str(err)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    result["compiled_errors"] = errors
    if trainer.is_global_zero:
        torch.save(final, OUT / "final.pt")
        (OUT / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
