"""Exercise the strategy's collectives, metric syncing and meta-device initialisation in a real multi-rank fit.

Rank 0 writes a JSON report to argv[2]. argv[1] selects how the model is created:
``eager`` (full model in __init__), ``configure_model`` (built lazily, on meta) or ``empty_init``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torchmetrics  # noqa: E402

import lightning_fsdp  # noqa: E402,F401
from tests.helpers.models import TinyLM, loader  # noqa: E402

# big enough that one full copy (~190 MB of fp32 parameters) stands out above allocator noise
BIG = json.loads(__import__("os").environ.get("FEATURES_MODEL", "null")) or {"vocab": 1031, "dim": 768, "heads": 4, "layers": 8, "seq": 7}


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: that survives exec, so ranks started by rank 0 inherit its peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


class Probe(TinyLM):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.metric = torchmetrics.MeanMetric()
        self.report: dict = {}

    def on_fit_start(self) -> None:
        s = self.trainer.strategy
        rank = self.global_rank
        self.report["peak_rss_after_setup"] = peak_rss_bytes()
        self.report["reduce_mean"] = float(s.reduce(torch.tensor(float(rank)), reduce_op="mean"))
        self.report["reduce_sum"] = float(s.reduce(torch.tensor(float(rank)), reduce_op="sum"))
        self.report["all_gather"] = s.all_gather(torch.tensor([rank, 10 * rank])).tolist()
        self.report["broadcast"] = s.broadcast({"from": rank}, src=1)
        self.report["any_true"] = s.reduce_boolean_decision(rank == 1, all=False)
        self.report["all_true"] = s.reduce_boolean_decision(rank == 1, all=True)
        s.barrier("probe")
        self.report["param_dtypes"] = sorted({str(p.dtype) for p in self.parameters()})
        self.report["param_types"] = sorted({type(p).__name__ for p in self.parameters()})

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.metric.update(torch.tensor(float(self.global_rank + 1)))
        self.log("rank_value", float(self.global_rank), sync_dist=True, reduce_fx="mean")
        return loss

    def on_train_end(self) -> None:
        self.report["metric_mean"] = float(self.metric.compute())
        self.report["optimizer_state_dtypes"] = sorted(
            {str(v.dtype) for st in self.trainer.optimizers[0].state.values() for k, v in st.items() if k != "step"}
        )


def main(mode: str, out: str, precision: str = "32-true") -> None:
    L.seed_everything(0)
    baseline = peak_rss_bytes()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp_custom", precision=precision, max_steps=3,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    kwargs = {**BIG, "build_in_configure_model": mode == "configure_model"}
    with trainer.init_module(empty_init=mode == "empty_init"):
        model = Probe(**kwargs)
    full_bytes = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()) if mode != "configure_model" else None
    trainer.fit(model, loader(48, 4, BIG["vocab"], BIG["seq"]))
    report = model.report
    report["baseline_rss"] = baseline
    report["state_bytes"] = trainer.strategy.state_bytes().as_dict()
    report["full_param_bytes"] = full_bytes
    report["rank_value_logged"] = float(trainer.callback_metrics["rank_value"])
    report["final_loss"] = float(trainer.callback_metrics["train_loss"])
    reports = [None] * trainer.world_size
    torch.distributed.all_gather_object(reports, report)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(reports))


if __name__ == "__main__":
    main(*sys.argv[1:])
