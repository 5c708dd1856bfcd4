"""A hand-written Fabric loop fine-tuning a Hugging Face causal LM, as a Fabric user writes it.

    python tests/scripts/fabric_loop.py spec.json

``Fabric(strategy=..., devices=N).launch()`` starts the ranks. Every run in ``spec["runs"]`` builds the model with
``AutoModelForCausalLM.from_config`` under ``fabric.init_module(empty_init=...)``, starts from
``fabric.load_raw(<full state file>)`` or resumes with ``fabric.load``, trains on rank ``r``'s slice of fixed global
batches (``self.model(input_ids=x).logits``, cross-entropy, ``fabric.backward``, ``fabric.clip_gradients``), and
rank 0 writes the losses, gradient norms, the gathered final parameters and what each rank held. With
``"average"``, a ``lightning_fsdp.ShardedAverage`` follows the weights too, as a Fabric user keeps an EMA.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_fsdp  # registers the strategy names for Fabric
from lightning_fsdp.loss import TokenWeightedLoss, causal_lm_token_loss


class ReduceScatterCounter:
    """Counts FSDP2's gradient reduce-scatters (to show ``no_backward_sync`` skips them while accumulating)."""

    def __init__(self) -> None:
        self.calls = 0
        self.name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self.original = getattr(dist, self.name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        setattr(dist, self.name, counted)


def batches(spec: dict[str, Any], vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (spec["steps"], spec["global_batch"], spec["seq"]), generator=generator)


def local_bytes(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().float().clone() for k, v in get_model_state_dict(model, options=options).items()}


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def one_run(fabric: L.Fabric, spec: dict[str, Any], run: dict[str, Any], counter: ReduceScatterCounter) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec["model_dir"])
    sharded = spec["strategy"] != "auto"
    torch.manual_seed(0)
    with fabric.init_module(empty_init=sharded):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if run.get("joint_setup"):  # fabric.setup(model, optimizer): the optimizer is built before sharding
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=spec["lr"]))
    start = 0
    result: dict[str, Any] = {"losses": [], "norms": []}
    if run.get("resume"):
        state = {"model": model, "optimizer": optimizer, "step": 0}
        result["remainder"] = sorted(fabric.load(run["resume"], state))
        start = state["step"]
    else:  # a full state-dict file, or (``raw``) any other source load_raw takes, e.g. the HF directory
        fabric.load_raw(run.get("raw", spec["raw_state"]), model)
    data = batches(spec, config.vocab_size)
    average = lightning_fsdp.ShardedAverage(decay=run["average"]) if run.get("average") else None
    world, rank = fabric.world_size, fabric.global_rank
    per_rank = spec["global_batch"] // world
    accumulate = run.get("accumulate", 1)
    context = getattr(fabric.strategy, "context_parallel", 1)
    reader = rank // context  # the ranks of a context-parallel group read the same batch, split along the sequence
    per_rank = spec["global_batch"] * context // world
    token_loss = TokenWeightedLoss()
    for step in range(start, spec["steps"]):
        x = data[step][reader * per_rank:(reader + 1) * per_rank]
        before = counter.calls
        if context > 1:  # as a Fabric user writes a context-parallel step: the summed token loss, one global count
            with fabric.strategy.sequence_split({"input_ids": x}) as part:
                logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
                total, count = causal_lm_token_loss(logits, part["shift_labels"], shift=False)
                fabric.backward(token_loss.add(total, count))
            loss = token_loss.finish_step(model.parameters(), fabric.world_size)
            result["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=spec["clip"])))
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(float(loss))
            continue
        for i, micro in enumerate(x.chunk(accumulate)):
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                logits = model(input_ids=micro).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), micro[:, 1:].reshape(-1))
                fabric.backward(loss / accumulate)
        result.setdefault("reduce_scatters", []).append(counter.calls - before)
        result["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=spec["clip"])))
        optimizer.step()
        optimizer.zero_grad()
        if average is not None:
            average.update(model)
        result["losses"].append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        if run.get("raise_rank") == rank:
            raise RuntimeError(f"a bug on rank {rank} at step {step}")
        if run.get("save_at") == step + 1:
            fabric.save(run["save"], {"model": model, "optimizer": optimizer, "step": step + 1, "note": "mid-run"})
        if run.get("signal_rank") == rank and run.get("signal_at") == step + 1:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before preempting one node
        if run.get("signal_at") is not None and fabric.strategy.stop_requested():
            fabric.save(run["save"], {"model": model, "optimizer": optimizer, "step": step + 1})
            result["stopped_at"] = _gather(step + 1)
            break
    result["local_bytes"] = fabric.all_gather(torch.tensor(local_bytes(model))).flatten().tolist()
    result["full_bytes"] = sum(p.numel() * p.element_size() for p in full_state(model).values()) if sharded else None
    params = full_state(model) if sharded else plain_state(model)
    if average is not None:  # the model holds the average while it is evaluated, then its own weights again
        average.swap(model)
        averaged = full_state(model) if sharded else plain_state(model)
        average.swap(model)
        result["average_bytes"] = fabric.all_gather(torch.tensor(average.average_bytes())).flatten().tolist()
    if rank == 0:
        path = Path(spec["out"]).with_suffix(f".{run['name']}.pt")
        torch.save(params, path)
        result["params_path"] = str(path)
        if average is not None:
            torch.save(averaged, path.with_suffix(".average.pt"))
            result["average_path"] = str(path.with_suffix(".average.pt"))
    if run.get("frozen_copy"):  # DPO's/GRPO's reference=copy under Fabric: sharded beside the model, 1/N per rank
        result["frozen_copy"] = frozen_copy_held(fabric, spec["model_dir"], sharded)
    if run.get("damaged"):  # last: a refused load may have restored some entries already
        result["refusals"] = refusal(fabric, run["damaged"], model, optimizer)
    return result


def frozen_copy_held(fabric: L.Fabric, model_dir: str, sharded: bool) -> dict[str, Any]:
    """What each rank holds of a frozen copy of ``model_dir`` built through ``fabric.strategy``, and whether the
    gathered copy equals the directory's safetensors files."""
    from safetensors.torch import load_file

    from lightning_fsdp.models.reference import frozen_copy

    reference = frozen_copy(model_dir, 64, fabric.strategy)
    files = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        files.update(load_file(path))
    gathered = {k.removeprefix("model."): v for k, v in (full_state(reference) if sharded else plain_state(reference)).items()}
    equal = fabric.global_rank != 0 or all(torch.equal(gathered[k], v.float()) for k, v in files.items())  # rank 0 gathers
    return {
        "local_bytes": fabric.all_gather(torch.tensor(local_bytes(reference))).flatten().tolist(),
        "full_bytes": sum(v.numel() * v.element_size() for v in files.values()),
        "trainable": any(p.requires_grad for p in reference.parameters()),
        "equals_files": equal and len(files) > 5,
    }


def refusal(fabric: L.Fabric, source: str, model: Any, optimizer: Any) -> list[str]:
    """A copy of ``source`` with one byte of a shard flipped: ``fabric.load`` must refuse it on every rank."""
    damaged = Path(source).with_name("damaged.ckpt")
    if fabric.global_rank == 0:
        shutil.copytree(source, damaged)
        shard = sorted(damaged.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    fabric.barrier()
    try:
        fabric.load(damaged, {"model": model, "optimizer": optimizer, "step": 0})
        message = "loaded"
    except Exception as err:  # the test reads every rank's message
        message = f"{type(err).__name__}: {err}"
    return _gather(message)


def _gather(message: str) -> list[str]:
    if not dist.is_initialized():
        return [message]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    strategy = spec["strategy"]
    if spec.get("strategy_kwargs"):
        strategy = lightning_fsdp.FSDPCustomFabricStrategy(**spec["strategy_kwargs"])
    fabric = L.Fabric(accelerator="cpu", devices=spec["devices"], strategy=strategy,
                      precision=spec.get("precision", "32-true"))
    fabric.launch()
    counter = ReduceScatterCounter()
    results = {run["name"]: one_run(fabric, spec, run, counter) for run in spec["runs"]}
    if fabric.global_rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
