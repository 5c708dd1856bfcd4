"""QLoRA of a slice of Llama-2-70B (its real layer shapes) through the Trainer, measured per rank as the planner
counts it: ``python tests/scripts/llama_slice.py MODEL_DIR OUT.json [STEPS] [SEQ]`` (Lightning starts the second
rank). Each rank reports:

- ``import_rss``: its RSS once torch, Lightning and the package are imported (the baseline of everything else);
- ``loaded_anon`` / ``loaded_file``: private and file-backed RSS added by the time training starts (the model built
  on the meta device, sharded, and its safetensors rows read and quantized);
- ``load_peak``: the high-water mark above the baseline up to then;
- ``train_peak``: the high-water mark above the baseline while training (the planner's ``peak``);
- ``state``: local parameter, gradient and optimizer bytes; ``step_seconds``: the median step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import lightning_fsdp
from lightning_fsdp.memory import current_rss, local_state_bytes, peak_rss, reset_peak_rss
from lightning_fsdp.models import HFCausalLM

IMPORT_RSS = current_rss()
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Measure(Callback):
    def __init__(self) -> None:
        self.row: dict = {"import_rss": IMPORT_RSS, "import_anon": status_bytes("RssAnon"),
                          "import_file": status_bytes("RssFile")}
        self.times: list[float] = []
        self._start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.row.update(loaded_anon=status_bytes("RssAnon") - self.row["import_anon"],
                        loaded_file=status_bytes("RssFile") - self.row["import_file"],
                        load_peak=peak_rss() - IMPORT_RSS)
        reset_peak_rss()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module) -> None:
        state = local_state_bytes(trainer.strategy.model, trainer.optimizers)
        self.row.update(train_peak=peak_rss() - IMPORT_RSS, params=state.params, grads=state.grads,
                        optimizer=state.optimizer, step_seconds=statistics.median(self.times))


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    seq = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    config = json.loads((model_dir / "config.json").read_text())
    strategy = lightning_fsdp.FSDPCustomStrategy(pretrained_weights=str(model_dir), quantize_base="nf4",
                                                 activation_checkpointing_policy="auto")
    measure = Measure()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[measure])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (steps * 2, seq + 1), generator=generator)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model = HFCausalLM(str(model_dir), lora=LORA)
    trainer.fit(model, loader)
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, measure.row)
    if trainer.is_global_zero:
        out.write_text(json.dumps(gathered))


if __name__ == "__main__":
    main()
