"""The default job without Hydra: a GPT-style decoder sharded over 2 CPU processes, configured in plain Python.

Run: `python examples/gpt_without_hydra.py [max_steps]`. Shows the strategy object with explicit policies (class
names as in YAML), a model built on the meta device in `configure_model`, a sharded checkpoint, and generation
from the sharded model (every rank runs it: FSDP all-gathers the parameters as in training).
"""

import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.data import TextCorpusDataModule
from lightning_fsdp import MemoryReport
from lightning_fsdp.models import GPTLightningModule


def main(max_steps: int = 100) -> None:
    L.seed_everything(0)
    model = GPTLightningModule.from_preset("gpt-5m", seq_len=128, lr=2e-3, warmup_steps=20, max_steps=max_steps)
    data = TextCorpusDataModule(seq_len=128, batch_size=8, cache_dir="outputs/gpt_without_hydra/data")
    strategy = FSDPCustomStrategy(
        auto_wrap_policy=["TransformerBlock"],  # one FSDP unit per block (what "auto" finds too)
        activation_checkpointing_policy=None,  # ["TransformerBlock"] trades compute for activation memory
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        val_check_interval=50,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        gradient_clip_val=1.0,
        default_root_dir="outputs/gpt_without_hydra",
        callbacks=[ModelCheckpoint(dirpath="outputs/gpt_without_hydra/checkpoints", save_last=True), MemoryReport()],
    )
    trainer.fit(model, datamodule=data)
    ids = model.generate(data.encode("Return the "), max_new_tokens=120, temperature=0.8, top_k=20)  # every rank
    if trainer.is_global_zero:
        print(f"{model.num_params:,} parameters, {len(strategy.wrapped_units)} FSDP units: {strategy.wrapped_units}")
        print(data.decode(ids[0]))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
