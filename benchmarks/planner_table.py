"""The README's planner tables (bf16-mixed, activation checkpointing, batch 1 × 2048 tokens, LoRA r=16 on q and v).

``python benchmarks/planner_table.py`` prints both:

- full fine-tune and LoRA of Llama-2-70B and Llama-3-8B on 8×80 GB, 4×24 GB and 2×24 GB;
- LoRA and QLoRA (``quantize_base="nf4"``) of the same models on 2×24 GB and 1×24 GB, with the host memory that CPU
  offload needs per rank.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fsdp import planner  # noqa: E402
from lightning_fsdp.formatting import format_bytes, parse_bytes  # noqa: E402
from lightning_fsdp.planner.llama import PRESETS, llama_dims, llama_model_spec, with_lora  # noqa: E402

MODELS = ("llama-2-70b", "llama-3-8b")


def cell(spec, world: int, memory: str, offload: bool, quantize=None) -> str:
    options = planner.PlanOptions(world_size=world, precision="bf16-mixed", batch_size=1, seq_len=2048,
                                  activation_checkpointing=True, cpu_offload=offload, quantize_base=quantize)
    estimate, verdict = planner.estimate(spec, options), planner.verdict(spec, options, parse_bytes(memory))
    host = f" (+{format_bytes(estimate.host)} host)" if offload else ""
    return f"{format_bytes(estimate.device)} {'✓' if verdict.fits else '✗'}{host}"


def spec_of(model: str, lora: bool):
    dims = llama_dims(PRESETS[model], 2048)
    return llama_model_spec(with_lora(dims, 16, ("q_proj", "v_proj")) if lora else dims)


def sharding_table() -> list[str]:
    lines = ["| model | fine-tune | 8×80 GB | 8×80 GB + offload | 4×24 GB | 4×24 GB + offload | 2×24 GB | 2×24 GB + offload |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in MODELS:
        for mode, lora in (("full", False), ("LoRA r=16 (q,v)", True)):
            spec = spec_of(model, lora)
            cells = [cell(spec, n, mem, off) for n, mem in [(8, "80GB"), (4, "24GB"), (2, "24GB")] for off in (False, True)]
            lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    return lines


def qlora_table() -> list[str]:
    lines = ["| model | fine-tune | 2×24 GB | 2×24 GB + offload | 1×24 GB | 1×24 GB + offload |",
             "|---|---|---:|---:|---:|---:|"]
    for model in MODELS:
        spec = spec_of(model, lora=True)
        for mode, quantize in (("LoRA r=16 (q,v)", None), ("QLoRA r=16 (q,v), NF4 base", "nf4")):
            cells = [cell(spec, n, "24GB", off, quantize) for n in (2, 1) for off in (False, True)]
            lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(sharding_table()))
    print()
    print("\n".join(qlora_table()))
