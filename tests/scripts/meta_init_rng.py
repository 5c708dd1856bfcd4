"""Build three models on the meta device under fsdp_custom on ``devices`` ranks, one ``fit`` each (no step), and save
every parameter's full tensor after materialisation (rank 0): the packaged GPT, a randomly initialised Hugging Face
Llama, and that Llama's pretrained weights with LoRA adapters (only the adapters random). On several ranks the GPT is
built once more with each rank seeded differently (``seed + rank``), and on 4 ranks the random Llama once more on a
2 x 2 HSDP mesh.

    python meta_init_rng.py OUT_DIR DEVICES LLAMA_DIR
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
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_fsdp import FSDPCustomStrategy  # noqa: E402
from lightning_fsdp.models import HFCausalLM  # noqa: E402
from lightning_fsdp.models.gpt_module import GPTLightningModule  # noqa: E402
from tests.helpers.hf import LORA  # noqa: E402

OUT, DEVICES, LLAMA = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
SECONDS: dict[str, float] = {}


class SaveFullParameters(L.Callback):
    """After sharding and materialisation, before any step: every parameter whole, on rank 0."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        full = {n: p.full_tensor().detach().clone() for n, p in pl_module.named_parameters()}
        assert all(type(p).__name__ == "DTensor" for p in pl_module.parameters())
        if trainer.is_global_zero:
            torch.save(full, OUT / f"{self.name}.pt")


class RankSeededGPT(GPTLightningModule):
    """Each rank seeds its own stream before building, as ``seed_everything(seed + rank)`` does."""

    def configure_model(self) -> None:
        torch.manual_seed(torch.distributed.get_rank())
        super().configure_model()


def fit(name: str, model: L.LightningModule, vocab: int, **strategy: object) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES, strategy=FSDPCustomStrategy(**strategy), max_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        callbacks=[SaveFullParameters(name)],
    )
    tokens = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))
    SECONDS[name] = round(time.perf_counter() - started, 2)


def main() -> None:
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|max_steps=0|`is_gradient_checkpointing`).*")
    L.seed_everything(0)  # every fit starts from this seed: the strategy re-seeds each rank from it
    fit("gpt", GPTLightningModule(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=16), 256)
    fit("llama", HFCausalLM(model_dir=str(LLAMA)), 37)
    fit("llama_lora", HFCausalLM(model_dir=str(LLAMA), lora=LORA), 37, pretrained_weights=str(LLAMA))
    if DEVICES > 1:
        fit("gpt_rank_seeded", RankSeededGPT(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=16), 256)
    if DEVICES == 4:
        fit("llama_hsdp", HFCausalLM(model_dir=str(LLAMA)), 37, replicate_size=2)
    if torch.distributed.get_rank() == 0:
        (OUT / "seconds.json").write_text(json.dumps(SECONDS))


if __name__ == "__main__":
    main()
