"""GRPO on a tiny chat Llama with :class:`PromptDataModule`, under ``fsdp_custom`` (N ranks) or one process.

``python grpo_train.py SPEC.json``; rank 0 writes ``spec["out"]``: the per-step global losses, every rollout's
completions and rewards keyed by the prompt's place in the run, the logged metrics, and the trainable parameters at
the end (``.params.pt``). A list of specs runs one after another in the same processes. Spec keys: model_dir,
data_dir, devices, batch_size, accumulate, max_steps, num_generations, max_completion_length, beta, loss_type,
scale_rewards, num_iterations, lora (False: a full fine-tune), reference, rollout_mode, lr, seed, checkpoint_every,
ckpt_path, strategy ("auto" for one process), held_out (add HeldOutRewards).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_fsdp
from lightning_fsdp.callbacks import HeldOutRewards
from lightning_fsdp.data import PromptDataModule
from lightning_fsdp.models import HFGRPOLM
from lightning_fsdp.parallel.collectives import all_gather_object


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})


class RecordedGRPO(HFGRPOLM):
    """Keeps every rollout's completions and rewards by (prompt position, sample)."""

    def roll_out(self, rows, parts, window_id):
        rollout = super().roll_out(rows, parts, window_id)
        group = int(self.hparams["num_generations"])
        local = {}
        per_part = len(rows) // parts
        for j, part in enumerate(rollout.parts):
            width = part.prompt_width
            for r in range(part.input_ids.shape[0]):
                row = rows[j * per_part + r // group]
                ids = part.input_ids[r, width:][part.attention_mask[r, width:].bool()].tolist()
                k = (j * per_part + r // group) * group + r % group
                local[f"{row['position']}/{r % group}"] = {"ids": ids, "advantage": float(part.advantages[r]),
                                                           "logprobs": rollout.completions.logprobs[k]}
        merged = {}
        for one in all_gather_object(local):
            merged.update(one)
        self.__dict__.setdefault("recorded", []).append(merged)
        return rollout


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
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    model = RecordedGRPO(
        spec["model_dir"], reward_funcs=spec.get("reward_funcs", ["tests.helpers.rewards.mean_token_id",
                                                                   "tests.helpers.rewards.has_word"]),
        lora=lora if spec.get("lora", True) else None, num_generations=spec.get("num_generations", 4),
        max_completion_length=spec.get("max_completion_length", 8), beta=spec.get("beta", 0.0),
        loss_type=spec.get("loss_type", "dapo"), scale_rewards=spec.get("scale_rewards", "group"),
        num_iterations=spec.get("num_iterations", 1), reference=spec.get("reference"),
        rollout_mode=spec.get("rollout_mode", "auto"), lr=spec.get("lr", 1e-2), temperature=1.0,
        from_pretrained=devices == 1 and spec.get("strategy") == "auto",
    )
    data = PromptDataModule(Path(spec["data_dir"]) / "train.jsonl", spec["model_dir"],
                            val_path=Path(spec["data_dir"]) / "val.jsonl", max_prompt_length=64,
                            batch_size=spec["batch_size"], cache_dir=Path(spec["root_dir"]) / "cache")
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    held_out = HeldOutRewards(count=None, show=0)
    if spec.get("held_out"):
        callbacks.append(held_out)
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
        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=spec["root_dir"],
    )
    trainer.fit(model, datamodule=data, ckpt_path=spec.get("ckpt_path"))
    result = {"losses": recorder.losses, "metrics": recorder.metrics, "rollouts": model.__dict__.get("recorded", []),
              "global_step": trainer.global_step, "world_size": trainer.world_size,
              "held_out": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("held_out")},
              "held_out_completions": held_out.completions}
    reference = model.__dict__.get("_reference_copy")
    if reference is not None:
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in reference.parameters()]
        result["reference"] = {"local_bytes": sum(t.numel() * t.element_size() for t in local),
                               "shapes": [list(p.shape) for p in reference.parameters()],
                               "full_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
                               "trainable": any(p.requires_grad for p in reference.parameters()),
                               "checksum": sum(float(t.double().sum()) for t in local)}
        from safetensors.torch import load_file

        files = {}
        for f in sorted(Path(spec["model_dir"]).glob("*.safetensors")):
            files.update(load_file(str(f)))
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                for n, p in reference.model.named_parameters()}
        result["reference"]["equals_file"] = all(torch.equal(full[n], files[n]) for n in files if n in full) and (
            len([n for n in files if n in full]) == len(files))
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
