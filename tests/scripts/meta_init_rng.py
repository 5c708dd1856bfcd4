"""Build the packaged GPT on the meta device under fsdp_custom (2 ranks) and report, for every evenly split 2-D
parameter, whether rank 0's shard equals rank 1's — which happens if every shard draws the same random numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_fsdp  # noqa: F401
from lightning_fsdp.models.gpt import GPTLightningModule


class Check(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        result = {}
        for name, p in pl_module.named_parameters():
            if p.ndim == 2 and p.shape[0] % 2 == 0:
                full = p.full_tensor()
                half = full.shape[0] // 2
                result[name] = bool(torch.equal(full[:half], full[half:]))
        if trainer.is_global_zero:
            Path(sys.argv[1]).write_text(json.dumps(result))


L.seed_everything(0)
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy="fsdp_custom", max_steps=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False, callbacks=[Check()], limit_val_batches=0,
)
model = GPTLightningModule(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=16)
tokens = torch.randint(0, 256, (8, 17))
trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
