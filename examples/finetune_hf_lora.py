"""LoRA fine-tuning of a Hugging Face model, fully sharded, then exported as a HF model and as a PEFT adapter.

Run: ``python examples/finetune_hf_lora.py [MODEL_DIR] [max_steps]``. Without MODEL_DIR (or when it does not
exist) the script first writes a small random Llama-style model there, as ``save_pretrained`` would (several
safetensors shards, an index, a byte-level tokenizer): nothing is downloaded. With your own Llama/Mistral/Qwen
directory, the same code fine-tunes it (give the text data its tokenizer's vocabulary).

What happens: the model is built on the meta device in ``configure_model``; ``pretrained_weights=MODEL_DIR`` reads
each rank's shards straight from the safetensors files; PEFT's LoRA adapters start at zero and are the only
trainable parameters; the sharded checkpoint stores the adapters and optimizer state and refers to MODEL_DIR for
the frozen base. After training, ``lightning-fsdp consolidate`` writes a merged HF model and the adapter, which
transformers and PEFT load in a plain process.
"""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.commands.consolidate import main as consolidate
from lightning_fsdp.data import TextCorpusDataModule
from lightning_fsdp.models import HFCausalLM
from lightning_fsdp.models.hf_causal_lm import write_random_model

OUT = Path("outputs/finetune_hf_lora")
SMALL_LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def main(model_dir: Path, max_steps: int = 100) -> None:
    if not model_dir.exists() and int(__import__("os").environ.get("LOCAL_RANK", 0)) == 0:
        write_random_model(model_dir, SMALL_LLAMA)  # before Lightning starts the second process
    L.seed_everything(0)
    model = HFCausalLM(model_dir, lora=LORA, lr=2e-3)
    data = TextCorpusDataModule(seq_len=128, batch_size=8, max_bytes=300_000, cache_dir=str(OUT / "data"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPCustomStrategy(pretrained_weights=str(model_dir)),  # each rank reads its own shards
        max_steps=max_steps,
        limit_val_batches=4,
        val_check_interval=max_steps,
        logger=False,
        default_root_dir=str(OUT),
        callbacks=[ModelCheckpoint(dirpath=OUT / "checkpoints", save_last=True)],
    )
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return
    last = trainer.checkpoint_callback.last_model_path
    consolidate([last, str(OUT / "hf_model"), "--format", "hf"])  # merged: a plain HF model for serving
    consolidate([last, str(OUT / "adapter"), "--format", "peft"])  # the adapter alone, for PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(OUT / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(OUT / "hf_model")
    ids = merged.generate(**tokenizer("Return the ", return_tensors="pt"), max_new_tokens=40, do_sample=False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trained {trained:,} of {sum(p.numel() for p in model.parameters()):,} parameters; exported to {OUT}")
    print(repr(tokenizer.decode(ids[0])))


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT / "base_model"
    main(directory, int(sys.argv[2]) if len(sys.argv) > 2 else 100)
