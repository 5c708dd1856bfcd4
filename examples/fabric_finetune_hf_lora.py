"""A hand-written Fabric loop: LoRA on a Hugging Face causal LM, fully sharded, then exported.

Run: ``python examples/fabric_finetune_hf_lora.py [MODEL_DIR] [steps]``. Without MODEL_DIR (or when it does not
exist) a small random Llama-style model is written there first (nothing is downloaded); with your own
Llama/Mistral/Qwen directory the same loop fine-tunes it. Add ``quantize_base="nf4"`` to the strategy for QLoRA.

What ``Fabric(strategy=FSDPCustomFabricStrategy(...))`` does that plain Fabric does not: the model is built on the
meta device (no rank holds it whole), auto-wrapped into one FSDP unit per decoder layer, and every rank reads only
its shards of the pretrained weights from the safetensors files. ``fabric.save`` writes a verified, atomic,
resharding checkpoint directory that holds only the adapters and their optimizer state (the frozen base is
referred to by its files' checksums); ``lightning-fsdp consolidate`` turns it into a HF model or a PEFT adapter.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_fsdp import FSDPCustomFabricStrategy
from lightning_fsdp.commands.consolidate import main as consolidate
from lightning_fsdp.data.text import TokenWindows, build_corpus, encode
from lightning_fsdp.loss import TokenWeightedLoss, causal_lm_token_loss
from lightning_fsdp.models.hf_causal_lm import write_random_model

OUT = Path("outputs/fabric_finetune_hf_lora")
SMALL_LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
)


def main(model_dir: Path, steps: int = 60) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    strategy = FSDPCustomFabricStrategy(pretrained_weights=str(model_dir))  # or strategy="fsdp_custom" (random init)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    if fabric.global_rank == 0 and not model_dir.exists():
        write_random_model(model_dir, SMALL_LLAMA)
    fabric.barrier()
    fabric.seed_everything(0)

    with fabric.init_module(empty_init=True):  # the meta device: nothing allocated yet
        # fp32 master weights; from_config would otherwise build in the files' dtype (often bf16)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model = fabric.setup_module(model)  # sharded, then each rank's shards read from the safetensors files
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    )
    tokens = encode(build_corpus("stdlib", max_bytes=200_000))
    loader = fabric.setup_dataloaders(DataLoader(TokenWindows(tokens, 128), batch_size=4, shuffle=True))

    # the step's gradient is Σ token losses / Σ target tokens over every rank, whatever each batch holds
    token_loss = TokenWeightedLoss()
    model.train()
    step = 0
    while step < steps:
        for x, y in loader:
            total, count = causal_lm_token_loss(model(input_ids=x).logits, y, shift=False)  # y: next-token targets
            fabric.backward(token_loss.add(total, count))
            loss = token_loss.finish_step(model.parameters(), fabric.world_size)  # FSDP averaged over the ranks
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                fabric.print(f"step {step}: loss {loss.item():.3f}")
            if step == steps:
                break

    checkpoint = OUT / "checkpoints" / f"step={step}.ckpt"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    if fabric.global_rank == 0:
        for args in (["--format", "hf"], ["--format", "peft"]):  # adapters merged into the base; the adapter alone
            if consolidate([str(checkpoint), str(OUT / ("hf_model" if "hf" in args else "adapter")), *args]) != 0:
                raise SystemExit(f"consolidate {' '.join(args)} failed")
        merged = AutoModelForCausalLM.from_pretrained(OUT / "hf_model")
        fabric.print(f"exported {sum(p.numel() for p in merged.parameters()):,} parameters to {OUT / 'hf_model'}")


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT / "base_model"
    main(directory, int(sys.argv[2]) if len(sys.argv) > 2 else 60)
