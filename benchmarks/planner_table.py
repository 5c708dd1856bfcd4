"""The README's planner table: Llama-2-70B and Llama-3-8B, full fine-tune and LoRA, on 8×80 GB, 4×24 GB and 2×24 GB.

``python benchmarks/planner_table.py`` prints it (bf16-mixed, activation checkpointing, batch 1 × 2048 tokens).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fsdp import planner  # noqa: E402
from lightning_fsdp.formatting import format_bytes, parse_bytes  # noqa: E402
from lightning_fsdp.planner.llama import PRESETS, llama_dims, llama_model_spec, with_lora  # noqa: E402

rows = []
for model in ["llama-2-70b", "llama-3-8b"]:
    for mode in ["full", "LoRA r=16 (q,v)"]:
        dims = llama_dims(PRESETS[model], 2048)
        if mode != "full": dims = with_lora(dims, 16, ("q_proj", "v_proj"))
        spec = llama_model_spec(dims)
        cells = []
        for n, mem in [(8, "80GB"), (4, "24GB"), (2, "24GB")]:
            for off in (False, True):
                o = planner.PlanOptions(world_size=n, precision="bf16-mixed", batch_size=1, seq_len=2048, activation_checkpointing=True, cpu_offload=off)
                e = planner.estimate(spec, o); v = planner.verdict(spec, o, parse_bytes(mem))
                cells.append(f"{format_bytes(e.device)} {'✓' if v.fits else '✗'}" + (f" (+{format_bytes(e.host)} host)" if off else ""))
        rows.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
print("| model | fine-tune | 8×80 GB | 8×80 GB + offload | 4×24 GB | 4×24 GB + offload | 2×24 GB | 2×24 GB + offload |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))
