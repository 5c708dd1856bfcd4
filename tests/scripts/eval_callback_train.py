"""A LoRA fine-tune of a tiny chat Llama under ``fsdp_custom``, with and without ``EvalHarness``, in one launch.

    python tests/scripts/eval_callback_train.py spec.json

Each run in ``spec["runs"]`` trains ``max_steps`` steps from the same seed; with ``every`` it scores the package's
multiple-choice task at step 0, every ``every`` steps and at the end. Rank 0 writes each run's per-step losses, the
callback's history and the trained adapters; with ``save`` the run's sharded checkpoint is written there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import lightning_fsdp
from lightning_fsdp.callbacks import EvalHarness
from lightning_fsdp.data import SFTDataModule
from lightning_fsdp.models import HFCausalLM


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def one_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    L.seed_everything(0, verbose=False)
    record = RecordLosses()
    callbacks: list[Callback] = [record]
    harness = None
    if run.get("every"):
        harness = EvalHarness(["python_docstring_choice"], every_n_steps=run["every"], limit=4, batch_size=4)
        callbacks.append(harness)
    strategy = lightning_fsdp.FSDPCustomStrategy(pretrained_weights=spec["model_dir"])
    trainer = L.Trainer(accelerator="cpu", devices=spec["devices"], strategy=strategy, max_steps=spec["max_steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=spec["root_dir"])
    model = HFCausalLM(spec["model_dir"], lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                       lr=1e-2)
    data = SFTDataModule(spec["data"], spec["model_dir"], val_fraction=0.0, seq_len=64, batch_size=2,
                         cache_dir=Path(spec["root_dir"]) / "cache")
    trainer.fit(model, data)
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    adapters = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": record.losses, "history": harness.history if harness else None,
            "adapters": {n: t.tolist() for n, t in adapters.items()}}


def main(spec: dict[str, Any]) -> None:
    results = {run["name"]: one_run(spec, run) for run in spec["runs"]}
    if torch.distributed.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
