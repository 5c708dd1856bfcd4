"""QLoRA: LoRA on a Hugging Face model whose frozen base is held in 4-bit NF4, fully sharded, then exported.

Run: ``python examples/finetune_hf_qlora.py [MODEL_DIR] [max_steps]``. Without MODEL_DIR (or when it does not
exist) the script first writes a small random Llama-style model there, as ``save_pretrained`` would: nothing is
downloaded. With your own Llama/Mistral/Qwen directory, the same code fine-tunes it.

What happens, beyond ``finetune_hf_lora.py``: ``quantize_base="nf4"`` turns every frozen projection of the decoder
layers into a torchao NF4 tensor before sharding. Each rank reads only its rows of each weight from the safetensors
files and quantizes them as they arrive; the ranks agree the block statistics, so each holds exactly its part of
``to_nf4(weight)``. FSDP2 all-gathers the base in 4 bits and the matmul dequantizes it. Checkpoints hold the adapters
and optimizer state only. After training, the adapters are merged into the original full-precision base (what is
served) and into the base as training saw it, and written as a PEFT adapter.
"""

import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.commands.consolidate import main as consolidate
from lightning_fsdp.data import TextCorpusDataModule
from lightning_fsdp.models import HFCausalLM
from lightning_fsdp.models.hf_causal_lm import write_random_model

OUT = Path("outputs/finetune_hf_qlora")
#: every projection splits into whole NF4 blocks (64 × 256 elements) over 2 ranks
SMALL_LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def main(model_dir: Path, max_steps: int = 100) -> None:
    if not model_dir.exists() and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        write_random_model(model_dir, SMALL_LLAMA)  # before Lightning starts the second process
    L.seed_everything(0)
    model = HFCausalLM(model_dir, lora=LORA, lr=2e-3)
    data = TextCorpusDataModule(seq_len=128, batch_size=8, max_bytes=300_000, cache_dir=str(OUT / "data"))
    strategy = FSDPCustomStrategy(pretrained_weights=str(model_dir), quantize_base="nf4")  # or strategy="fsdp_custom_qlora"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=4,
        val_check_interval=max_steps,
        logger=False,
        default_root_dir=str(OUT),
        callbacks=[ModelCheckpoint(dirpath=OUT / "checkpoints", save_last=True)],
    )
    trainer.fit(model, datamodule=data)
    quantized = len(strategy.quantized_base.names) if strategy.quantized_base else 0
    bytes_per_rank = strategy.state_bytes().params
    if not trainer.is_global_zero:
        return
    last = trainer.checkpoint_callback.last_model_path
    consolidate([last, str(OUT / "hf_model"), "--format", "hf"])  # into the original base: what is served
    consolidate([last, str(OUT / "hf_model_nf4"), "--format", "hf", "--merge-into", "quantized"])  # as trained
    consolidate([last, str(OUT / "adapter"), "--format", "peft"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(OUT / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(OUT / "hf_model")
    ids = merged.generate(**tokenizer("Return the ", return_tensors="pt"), max_new_tokens=40, do_sample=False)
    print(f"{quantized} base weights held in NF4; {bytes_per_rank / 2**20:.2f} MiB of parameters on rank 0;"
          f" exported to {OUT}")
    print(repr(tokenizer.decode(ids[0])))


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT / "base_model"
    main(directory, int(sys.argv[2]) if len(sys.argv) > 2 else 100)
