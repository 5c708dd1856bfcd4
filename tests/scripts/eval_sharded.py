"""lm-eval tasks on a Hugging Face Llama sharded over Fabric's ranks, as ``lightning-fsdp eval`` shards it.

    python tests/scripts/eval_sharded.py spec.json

For each rollout mode in ``spec["modes"]``: lm-eval's results with every sample, and the most decoder layers seen
unsharded at once while a layer runs (a forward pre-hook counts the layers whose parameters are plain tensors, as
FSDP2 swaps them in while gathered). Rank 0 writes the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_fsdp.fabric import FSDPCustomFabricStrategy


def unsharded_layers(layers: list[torch.nn.Module]) -> int:
    from torch.distributed.tensor import DTensor

    return sum(not any(isinstance(p, DTensor) for p in layer.parameters()) for layer in layers)


def main(spec: dict[str, Any]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lightning_fsdp.evaluation.harness import evaluate_tasks

    fabric = L.Fabric(accelerator="cpu", devices=spec["devices"],
                      strategy=FSDPCustomFabricStrategy(pretrained_weights=spec["model_dir"]))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["model_dir"]))
    model = fabric.setup_module(model).module
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    layers = list(model.model.layers)
    seen: list[int] = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(unsharded_layers(layers)))
    out: dict[str, Any] = {"layers": len(layers)}
    for mode in spec["modes"]:
        seen.clear()
        results = evaluate_tasks(model, model, tokenizer, spec["tasks"], limit=spec["limit"], batch_size=4,
                                 rollout_mode=mode, log_samples=True)
        out[mode] = {
            "metrics": {task: {k: v for k, v in r.items() if "," in k and "stderr" not in k}
                        for task, r in results["results"].items()},
            "samples": {task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
                        for task, rows in results["samples"].items()},
            "most_unsharded_layers": max(seen, default=0),
            "all_sharded_after": unsharded_layers(layers) == 0,
        }
    if fabric.global_rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
