"""Train a test model from a JSON spec; the Lightning launcher re-runs this file for every other rank.

Rank 0 writes ``spec["out"]``: per-step global losses and a path to the full (gathered) final parameters.
Used by parity, resume, checkpoint and failure tests so that every test drives the real Trainer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_fsdp  # noqa: E402,F401
from tests.helpers.models import build_model, loader  # noqa: E402


class RecordLosses(Callback):
    """Collects the rank-averaged loss of every micro-batch (what the single-process reference computes)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


class RecordGradients(Callback):
    """The whole gradients each optimizer step used (normalised, before the next step zeroes them), and the step's
    logged ``train_loss`` (a token-weighted module's mean over every rank's tokens), every step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, param in pl_module.named_parameters():
            if param.grad is not None:
                grad = param.grad
                grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
        self.steps.append(grads)
        if "train_loss" in trainer.callback_metrics:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))


class CountAllGathers(Callback):
    """Counts the all-gathers (FSDP2's parameter gathers) issued during the training step with index ``at``."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self, at: int) -> None:
        import torch.distributed as dist

        self.at, self.count, self.active = at, 0, False
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.count += self.active
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.active = batch_idx == self.at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.active = False


class CountNormWork(Callback):
    """Counts, in the optimizer step of batch ``at``, what the non-finite check and clipping cost: gradient-norm
    computations, all-reduces inside them, and device→host transfers (``item``/``tolist``/``float``/``bool``/...)."""

    TRANSFERS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__")

    def __init__(self, at: int) -> None:
        import torch.distributed as dist

        from lightning_fsdp.parallel import grad_norm
        from lightning_fsdp import FSDP2Precision
        from lightning_fsdp.resilience.nonfinite import NonFiniteGuard

        self.at, self.step_active, self.in_check = at, False, False
        self.counts = {"norms": 0, "norm_all_reduces": 0, "host_transfers": 0}
        self.in_norm = False
        total = grad_norm.total_grad_norm

        def counted_norm(*args, **kwargs):
            self.counts["norms"] += self.step_active
            self.in_norm = True
            try:
                return total(*args, **kwargs)
            finally:
                self.in_norm = False

        grad_norm.total_grad_norm = counted_norm
        all_reduce = dist.all_reduce

        def counted_all_reduce(*args, **kwargs):
            self.counts["norm_all_reduces"] += self.step_active and self.in_norm
            return all_reduce(*args, **kwargs)

        dist.all_reduce = counted_all_reduce
        for cls, name in ((NonFiniteGuard, "check"), (FSDP2Precision, "clip_grad_by_norm")):
            setattr(cls, name, self._window(getattr(cls, name)))
        for name in self.TRANSFERS:
            setattr(torch.Tensor, name, self._transfer(getattr(torch.Tensor, name)))

    def _window(self, method):
        def inside(*args, **kwargs):
            self.in_check = True
            try:
                return method(*args, **kwargs)
            finally:
                self.in_check = False

        return inside

    def _transfer(self, method):
        def counted(tensor, *args, **kwargs):
            if self.step_active and self.in_check and not self.in_transfer:
                self.counts["host_transfers"] += 1
            self.in_transfer = True  # a transfer implemented through another one counts once
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self.in_transfer = False

        return counted

    in_transfer = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step_active = batch_idx == self.at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_active = False


class CountCompiles(Callback):
    """Graphs torch.compile built by the start of batch ``after`` (warm-up) and by the end of training."""

    def __init__(self, after: int) -> None:
        self.after, self.warm, self.final = after, -1, -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_fsdp._torch_compat import compiled_graph_count

        if batch_idx == self.after:
            self.warm = compiled_graph_count()

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning_fsdp._torch_compat import compiled_graph_count

        self.final = compiled_graph_count()


class ProbeShardedLoad(Callback):
    """At fit start, loads the safetensors directory ``path`` into the sharded model again, twice, and records each
    rank's smaller peak RSS increase (what loading adds on top of the allocated shards).

    RSS on a loaded CI machine carries one-off noise of about a megabyte (a heap arena growing, pages touched for
    the first time), as large as a tiny test file's share. A loader that holds more than its rows holds them on every
    load, so the smaller of two peaks keeps the check and drops the noise."""

    def __init__(self, path: str, repeats: int = 2) -> None:
        self.path, self.repeats, self.peaks = path, repeats, []

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning_fsdp.hf import load_safetensors
        from lightning_fsdp.memory import PeakMemory

        tracker = PeakMemory()
        peaks = []
        for _ in range(self.repeats):
            trainer.strategy.barrier()
            tracker.reset()
            load_safetensors(trainer.strategy.model, self.path)
            peaks.append(tracker.peak())
        self.peaks = trainer.strategy.all_gather(torch.tensor([min(peaks)])).reshape(-1).tolist()


class InitialTrainable(Callback):
    """At fit start: writes the trainable parameters to ``save`` (a one-process run), or loads them from ``load``
    into this rank's rows. Sharded runs whose adapters a CPU mesh initialises shard by shard then start from the
    reference's own initial adapters."""

    def __init__(self, save: str | None, load: str | None) -> None:
        self.save, self.load = save, load

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning_fsdp.parallel.mesh import local_rows, local_shard

        if self.save:
            torch.save({k: p.detach().clone() for k, p in pl_module.named_parameters() if p.requires_grad}, self.save)
        if self.load:
            with torch.no_grad():
                for key, full in torch.load(self.load, weights_only=True).items():
                    param = pl_module.get_parameter(key)
                    start, stop = local_rows(param)
                    local_shard(param).copy_(full[start:stop])


def full_params(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Gathered full parameters (a collective on sharded strategies)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from lightning_fsdp.sharding import nf4

    model = trainer.strategy.model
    if any(isinstance(p, DTensor) for p in model.parameters()):  # ours, or a module that sharded itself
        # torch's names, each tensor gathered and read before the next is: gathers left in flight on gloo (a whole
        # model's, then one NF4 weight's three fields) aborted loaded runs at 4 ranks and then at 2
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    else:
        sd = {k: v.detach().cpu() for k, v in trainer.lightning_module.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if isinstance(value, DTensor):
            value = _gathered_nf4(value) if nf4.is_nf4(value.to_local()) else value.full_tensor()
        out[key] = value.float().cpu().clone()  # a quantized weight: its dequantized value
        if nf4.is_nf4(value):  # and its stored fields, to compare quantizations exactly
            out.update({f"{key}.nf4.{name}": field.clone() for name, field in nf4.fields(value).items()})
    return out


def _gathered_nf4(value: Any) -> Any:
    """The whole ``NF4Tensor`` behind a sharded one, each stored field gathered by a blocking collective.

    ``full_tensor()`` goes through torchao's gather, which leaves one functional all-gather per field in flight;
    on gloo under a loaded machine that aborted a 2-rank run (``Fatal Python error: Aborted`` in the gather)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from lightning_fsdp.sharding import nf4

    (dim,) = [d for d, p in enumerate(value.placements) if isinstance(p, Shard)]
    group = value.device_mesh.get_group(dim)
    size = dist.get_world_size(group)
    local = value.to_local()
    whole = nf4.empty(value.shape, nf4.data_device(local), nf4.compute_device(local))
    gathered = nf4.fields(local)
    for name, part in gathered.items():
        if name == "scaler_mean":  # not sharded: one value for the whole weight
            continue
        gathered[name] = part.new_empty((part.shape[0] * size, *part.shape[1:]))
        dist.all_gather_into_tensor(gathered[name], part.contiguous(), group=group)
    nf4.write(whole, gathered)
    return whole


def ema_callback(spec: dict, ours: bool) -> Callback | None:
    """``spec["ema"]`` (constructor kwargs): ``ShardedEMA`` under ``fsdp_custom``, Lightning's own
    ``EMAWeightAveraging`` for the single-process reference."""
    if not spec.get("ema"):
        return None
    if ours:
        return lightning_fsdp.ShardedEMA(**spec["ema"])
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return EMAWeightAveraging(**spec["ema"])


def compile_like_strategy(model: torch.nn.Module, *, activation_checkpointing_policy, compile=True) -> None:
    """Checkpoint and compile the blocks of a one-process model as ``FSDPCustomStrategy`` does its units (the same
    functions, in the same order), so a compiled sharded run has a reference built from the same inductor kernels:
    fused kernels may round differently from eager by more than fp32's default tolerances on some CPUs."""
    from lightning_fsdp.sharding import compile_units
    from lightning_fsdp.sharding.parallelize import apply_activation_checkpointing

    if hasattr(model, "configure_model"):  # a module that builds its network there (idempotent)
        model.configure_model()
    units = apply_activation_checkpointing(model, activation_checkpointing_policy)
    compile_units(model, units, compile)


def main(spec: dict) -> None:
    L.seed_everything(spec.get("seed", 0), workers=True)
    # the reference for the frozen weights' dtype: them kept in fp32 under *-mixed, as the package once did
    import importlib

    sharding = importlib.import_module("lightning_fsdp.sharding.parallelize")
    store = sharding.__dict__.setdefault("_store_frozen", sharding.store_frozen_in_compute_dtype)
    sharding.store_frozen_in_compute_dtype = (lambda *args, **kwargs: []) if spec.get("keep_frozen_in_fp32") else store
    torch.use_deterministic_algorithms(True, warn_only=True)
    strategy = spec.get("strategy", "fsdp_custom")
    if strategy == "model_parallel":  # Lightning's own, the module shards itself (TinyLM(shard_myself=True))
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=spec.get("devices", 1), tensor_parallel_size=1)
    if spec.get("strategy_kwargs") or spec.get("precision_plugin"):
        plugin = lightning_fsdp.FSDP2Precision(spec["precision_plugin"]) if spec.get("precision_plugin") else None
        strategy = lightning_fsdp.FSDPCustomStrategy(precision_plugin=plugin, **spec.get("strategy_kwargs", {}))
    empty_init = spec.get("empty_init", False)
    recorder = RecordLosses()
    callbacks: list[Callback] = [recorder]
    gradients = RecordGradients() if spec.get("record_gradients") else None
    if gradients is not None:
        callbacks.append(gradients)
    counter = CountAllGathers(at=spec["count_all_gathers_at"]) if "count_all_gathers_at" in spec else None
    if counter is not None:
        callbacks.append(counter)
    compiles = CountCompiles(after=spec["count_compiles_after"]) if "count_compiles_after" in spec else None
    if compiles is not None:
        callbacks.append(compiles)
    norm_counter = CountNormWork(at=spec["count_norm_work_at"]) if "count_norm_work_at" in spec else None
    if norm_counter is not None:
        callbacks.append(norm_counter)
    if spec.get("save_initial") or spec.get("load_initial"):
        callbacks.append(InitialTrainable(spec.get("save_initial"), spec.get("load_initial")))
    probe = ProbeShardedLoad(spec["probe_sharded_load"]) if spec.get("probe_sharded_load") else None
    if probe is not None:
        callbacks.append(probe)
    ours = isinstance(strategy, lightning_fsdp.FSDPCustomStrategy) or str(strategy).startswith("fsdp_custom")
    ema = ema_callback(spec, ours)
    if ema is not None:
        callbacks.append(ema)
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], **{"save_last": True, **spec.get("checkpoint_kwargs", {})}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec.get("devices", 1),
        num_nodes=spec.get("num_nodes", 1),
        strategy=strategy,
        precision=None if spec.get("precision_plugin") else spec.get("precision", "32-true"),
        max_steps=spec.get("max_steps", -1),
        max_epochs=spec.get("max_epochs", None),
        accumulate_grad_batches=spec.get("accumulate_grad_batches", 1),
        gradient_clip_val=spec.get("gradient_clip_val"),
        enable_checkpointing=bool(spec.get("checkpoint_dir")),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=spec.get("root_dir", os.getcwd()),
    )
    with trainer.init_module(empty_init=empty_init):
        model, vocab, seq = build_model(spec)
    if spec.get("compile_like_strategy"):  # a one-process reference whose blocks run the strategy's compiled code
        compile_like_strategy(model, **spec["compile_like_strategy"])
    data = spec.get("data", {})
    seq = spec.get("seq", seq)
    train_loader = loader(data.get("n", 64), spec.get("batch_size", 4), vocab, seq, data.get("seed", 0),
        reference_order=not isinstance(trainer.strategy, lightning_fsdp.FSDPCustomStrategy) and trainer.world_size == 1,
        packed=data.get("packed", False),
    )
    trainer.fit(model, train_loader, ckpt_path=spec.get("ckpt_path"))
    if spec.get("save_path"):
        trainer.save_checkpoint(spec["save_path"])
    params = full_params(trainer)
    result = {"losses": recorder.losses, "global_step": trainer.global_step, "world_size": trainer.world_size}
    if counter is not None:
        result["all_gathers_in_step"] = counter.count
    if norm_counter is not None:
        result["norm_work_in_step"] = norm_counter.counts
    if probe is not None:
        result["sharded_load_peaks"] = probe.peaks
    if compiles is not None:
        result["compiled_graphs"] = {"after_warmup": compiles.warm, "at_end": compiles.final}
    if isinstance(ema, lightning_fsdp.ShardedEMA):
        mine = torch.tensor([ema.average_bytes()])
        result["ema_bytes"] = trainer.strategy.all_gather(mine).reshape(-1).tolist()
        result["ema_devices"] = sorted({str(t.device) for t in ema.average_tensors()})
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    result["dtypes"] = {  # what this rank stores: parameters (local shards) and optimizer state
        "params": sorted({str(p.dtype) for p in trainer.lightning_module.parameters()}),
        "optimizer": sorted({str(v.dtype) for st in (optimizer.state.values() if optimizer else [])
                             for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}),
    }
    if hasattr(trainer.strategy, "state_bytes"):
        sb = trainer.strategy.state_bytes().as_dict()
        gathered = trainer.strategy.all_gather(torch.tensor([sb["params"], sb["grads"], sb["optimizer"]]))
        result["state_bytes"] = gathered.reshape(-1, 3).tolist()
        result["wrapped_units"] = trainer.strategy.wrapped_units
        quantized = getattr(trainer.strategy, "quantized_base", None)
        result["quantized"] = quantized.to_dict() if quantized is not None else None
        pool = trainer.strategy.runtime.prepared.comm_buffers
        result["comm_buffers"] = None if pool is None else {"reused": pool.reused, "allocated": pool.allocated,
                                                             "held_bytes": pool.held_bytes}
    if trainer.is_global_zero and spec.get("out"):
        out = Path(spec["out"])
        torch.save(params, out.with_suffix(".params.pt"))
        result["params_path"] = str(out.with_suffix(".params.pt"))
        if gradients is not None:
            torch.save(gradients.steps, out.with_suffix(".grads.pt"))
            result["gradients_path"] = str(out.with_suffix(".grads.pt"))
            result["logged_losses"] = gradients.logged
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    specs = json.loads(Path(sys.argv[1]).read_text())
    for one in specs if isinstance(specs, list) else [specs]:  # several single-process runs share one start-up
        main(one)
