"""DPO/SimPO on a tiny chat Llama with :class:`PreferenceDataModule`, under ``fsdp_custom`` (N ranks) or one process.

``python preference_train.py SPEC.json``; rank 0 writes ``spec["out"]``: the per-step global losses (the logged
``train_loss``), the validation metrics, and the full trainable parameters at the end (``.params.pt``).
Spec keys: model_dir, data_dir, devices, batch_size, accumulate, max_steps, loss, beta, lr, seed,
checkpoint_every (save a checkpoint every N steps into root_dir/ckpt), ckpt_path (resume), validate (run validation at
the end), per_micro_batch_mean (the wrong normalisation, for the test that must tell them apart), reference (DPO's
reference mode), lora (False: a full fine-tune). A list of specs runs one after another in the same processes.
With a frozen reference copy, rank 0 also records its local parameter shapes and bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_fsdp
from lightning_fsdp.data import PreferenceDataModule
from lightning_fsdp.models import HFPreferenceLM


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


class PerMicroBatchMean(HFPreferenceLM):
    """Each micro-batch's mean pair loss, averaged again by Lightning and the data-parallel reduction."""

    def training_step(self, batch, batch_idx):
        scores = self.pair_scores(batch)
        mask = batch["pair_mask"].to(scores.losses)
        loss = (scores.losses * mask).sum() / mask.sum().clamp(min=1)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        pass


def trainable_params(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in trainer.lightning_module.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = full.detach().cpu().clone()
    return out


def main(spec: dict) -> None:
    L.seed_everything(spec.get("seed", 0), workers=True)
    devices = spec.get("devices", 1)
    cls = PerMicroBatchMean if spec.get("per_micro_batch_mean") else HFPreferenceLM
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    model = cls(spec["model_dir"], lora=lora if spec.get("lora", spec.get("loss", "dpo") == "dpo") else None,
                loss=spec.get("loss", "dpo"), beta=spec.get("beta", 0.5), lr=spec.get("lr", 5e-3),
                from_pretrained=devices == 1 and spec.get("strategy") == "auto", reference=spec.get("reference"))
    data = PreferenceDataModule(Path(spec["data_dir"]) / "train.jsonl", spec["model_dir"],
                                val_path=Path(spec["data_dir"]) / "val.jsonl", seq_len=96,
                                batch_size=spec["batch_size"], cache_dir=Path(spec["root_dir"]) / "cache")
    recorder = RecordLosses()
    callbacks: list[Callback] = [recorder]
    if spec.get("checkpoint_every"):
        callbacks.append(ModelCheckpoint(dirpath=str(Path(spec["root_dir"]) / "ckpt"), save_top_k=-1,
                                         every_n_train_steps=spec["checkpoint_every"], filename="{step}"))
    strategy = spec.get("strategy", "fsdp_custom")
    if strategy == "fsdp_custom":
        strategy = lightning_fsdp.FSDPCustomStrategy(pretrained_weights=spec["model_dir"])
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=spec["max_steps"], max_epochs=None,
        accumulate_grad_batches=spec.get("accumulate", 1), logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(spec.get("checkpoint_every")), limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=spec["root_dir"], deterministic=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=spec.get("ckpt_path"))
    result = {"losses": recorder.losses, "global_step": trainer.global_step, "world_size": trainer.world_size}
    if spec.get("validate"):
        trainer.limit_val_batches = 1.0
        result["val"] = {k: float(v) for k, v in trainer.validate(model, datamodule=data, verbose=False)[0].items()}
    reference = model.__dict__.get("_reference_copy")
    if reference is not None:
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in reference.parameters()]
        result["reference"] = {"local_bytes": sum(t.numel() * t.element_size() for t in local),
                               "shapes": [list(p.shape) for p in reference.parameters()],
                               "full_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
                               "trainable": any(p.requires_grad for p in reference.parameters())}
    params = trainable_params(trainer)
    if trainer.is_global_zero:
        out = Path(spec["out"])
        torch.save(params, out.with_suffix(".params.pt"))
        result["params_path"] = str(out.with_suffix(".params.pt"))
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    specs = json.loads(Path(sys.argv[1]).read_text())
    for one in specs if isinstance(specs, list) else [specs]:
        main(one)
