"""One benchmark configuration, run in fresh processes: ``python benchmarks/worker.py SPEC.json``.

Lightning's launcher re-runs this same command for ranks 1..N-1, so every rank imports this file, records its
import-only memory baseline and wraps the ``torch.distributed`` collectives before anything else happens. Rank 0
writes one JSON result to ``spec["out"]``.

Peers (``spec["peer"]``), all training the package's GPT on the same data, seed and thread settings:

==========================  ============================================================================
``single``                  one process, no process group, the same per-rank batch (compute-only reference)
``fsdp_custom``             this package's strategy, default settings
``fsdp_custom_offload``     the same with ``cpu_offload=True``
``mp_fsdp2``                Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``
                            with ``fully_shard`` per block and on the root written in ``configure_model``
``ddp``                     Lightning's ``DDPStrategy``
``fsdp1``                   Lightning's ``FSDPStrategy`` (FSDP1; CUDA only), blocks as units
==========================  ============================================================================
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

# Modules the peers would otherwise import lazily during setup (our checkpoint and failure handling, DCP,
# Lightning's other strategies): imported here so that code, for every peer alike, sits below the baseline.
import lightning.pytorch.strategies.model_parallel  # noqa: E402,F401
import torch  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  (registers the strategy names)
import lightning_fsdp.checkpoint  # noqa: E402,F401
import lightning_fsdp.resilience  # noqa: E402,F401
from lightning_fsdp import MemoryReport  # noqa: E402
from lightning_fsdp.memory import (  # noqa: E402
    current_rss,
    global_state_bytes,
    local_state_bytes,
    peak_rss,
    reset_peak_rss,
)
from lightning_fsdp.models import GPTLightningModule  # noqa: E402
from lightning_fsdp.parallel.process_group import destroy_process_group_at_exit  # noqa: E402

#: RSS once torch, Lightning and the package are imported: peak memory is reported above it
IMPORT_BASELINE = current_rss()
reset_peak_rss()


# -- collective bytes ------------------------------------------------------------------------------------------------
class CollectiveCounter:
    """Counts the bytes of every ``torch.distributed`` collective called from Python while :attr:`active`.

    FSDP2 and FSDP1 (``all_gather_single``/``reduce_scatter_single`` in torch 2.13; older releases use the
    ``*_into_tensor``/``*_tensor`` names, also wrapped) and Lightning's reductions call these through the
    ``torch.distributed`` namespace;
    DDP's reducer runs in C++, so the DDP peer registers the stock ``allreduce_hook``, which calls
    ``torch.distributed.all_reduce`` per gradient bucket. Bytes are those of the full-size buffer: the output of
    an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or broadcast — the convention in
    which ZeRO-3 moves 3× the parameter bytes per step (gather for forward, gather for backward, reduce-scatter).
    """

    #: function name → which argument holds the full-size buffer (position, keyword)
    OPS = {
        "all_gather_single": (0, "output_tensor"),
        "all_gather_into_tensor": (0, "output_tensor"),
        "_all_gather_base": (0, "output_tensor"),
        "reduce_scatter_single": (1, "input"),
        "reduce_scatter_tensor": (1, "input"),
        "_reduce_scatter_base": (1, "input"),
        "all_reduce": (0, "tensor"),
        "broadcast": (0, "tensor"),
        "all_gather": (0, "tensor_list"),
        "reduce_scatter": (1, "input_list"),
    }

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name, (position, keyword) in self.OPS.items():
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_counted", False):
                continue
            setattr(dist, name, self._wrap(name, original, position, keyword))

    def _wrap(self, name, original, position, keyword):
        def counted(*args, **kwargs):
            if self.active:
                buffer = args[position] if len(args) > position else kwargs.get(keyword)
                self.bytes[name] = self.bytes.get(name, 0) + _nbytes(buffer)
                self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        counted._counted = True  # type: ignore[attr-defined]
        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


COUNTER = CollectiveCounter()
COUNTER.install()


# -- the hand-written peer -----------------------------------------------------------------------------------------
class HandShardedGPT(GPTLightningModule):
    """What a user writes for Lightning's ``ModelParallelStrategy`` today: ``fully_shard`` each block, then the root."""

    def __init__(self, *args, mp_dtype: str | None = None, compile_blocks: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mp_dtype = mp_dtype
        self.compile_blocks = compile_blocks

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        super().configure_model()
        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, self.mp_dtype), reduce_dtype=torch.float32) if self.mp_dtype else MixedPrecisionPolicy()
        for block in self.net.blocks:
            if self.compile_blocks:  # as a user would: compile each block in place, then shard it
                block.compile()
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self.net, mesh=mesh, mp_policy=mp)


class DDPCommHook(Callback):
    """Route DDP's bucket all-reduce through ``torch.distributed.all_reduce`` (the stock hook) so it is counted."""

    def on_fit_start(self, trainer, pl_module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)


class StepTimer(Callback):
    """Wall time between consecutive ``on_train_batch_end`` (a whole loop iteration: data, forward, backward,
    optimizer); collective bytes counted over the steps after warm-up."""

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.fit_start = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.ends.append(self._now())
        if batch_idx == self.warmup:
            COUNTER.active = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(self._now())
        self.losses.append(float(outputs["loss"].detach()))
        if batch_idx == self.warmup + self.steps - 1:
            COUNTER.active = False

    @property
    def step_times(self) -> list[float]:
        """Intervals after warm-up (the first ``warmup`` iterations include one-time setup and allocation)."""
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:])]
        return intervals[self.warmup :]


# -- building a configuration --------------------------------------------------------------------------------------
def build(spec: dict):
    """(strategy, LightningModule, callbacks, devices) for the peer in ``spec``."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    peer, world, cuda = spec["peer"], spec["world"], spec["device"] == "cuda"
    total_steps = spec["warmup"] + spec["steps"]
    model_kwargs = {**spec["model"], "max_steps": total_steps, "warmup_steps": 1}
    callbacks: list[Callback] = []
    module_cls = GPTLightningModule
    if peer == "single":
        if world != 1:
            raise ValueError("the single-process reference runs with world=1")
        strategy: object = "auto"
    elif peer == "fsdp_custom":
        strategy = "fsdp_custom"
    elif peer == "fsdp_custom_offload":
        strategy = "fsdp_custom_offload"
    elif peer in ("fsdp_custom_compiled", "fsdp_custom_offload_compiled"):
        from lightning_fsdp import FSDPCustomStrategy

        strategy = FSDPCustomStrategy(compile=True, cpu_offload="offload" in peer)
    elif peer in ("mp_fsdp2", "mp_fsdp2_compiled"):
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        module_cls = HandShardedGPT
        model_kwargs["compile_blocks"] = peer == "mp_fsdp2_compiled"
        if spec["precision"].startswith("bf16"):
            model_kwargs["mp_dtype"] = "bfloat16"
    elif peer == "ddp":
        strategy = DDPStrategy()
        callbacks.append(DDPCommHook())
    elif peer == "fsdp1":
        if not cuda:
            raise ValueError("Lightning's FSDP1 strategy runs on CUDA only")
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_fsdp.models.gpt import TransformerBlock

        strategy = FSDPStrategy(auto_wrap_policy={TransformerBlock}, sharding_strategy="FULL_SHARD")
    else:
        raise ValueError(f"unknown peer {peer!r}")
    return strategy, module_cls(**model_kwargs), callbacks


def _dataset(spec: dict) -> torch.utils.data.Dataset:
    """Random token sequences, identical for every peer and rank (Lightning's sampler splits them over ranks)."""
    m = spec["model"]
    n = (spec["warmup"] + spec["steps"] + 1) * spec["batch"] * spec["world"]
    g = torch.Generator().manual_seed(spec["seed"])
    data = torch.randint(0, m["vocab_size"], (n, m["seq_len"] + 1), generator=g)
    return torch.utils.data.TensorDataset(data[:, :-1].clone(), data[:, 1:].clone())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def _timed(trainer: L.Trainer, fn) -> float:
    trainer.strategy.barrier()
    t0 = time.perf_counter()
    fn()
    trainer.strategy.barrier()
    return time.perf_counter() - t0


def checkpoint_times(trainer: L.Trainer, root: Path, repeats: int = 2) -> dict:
    """Save then load the sharded checkpoint ``repeats`` times after one unmeasured round; the best time of each.

    The warm-up round pays, for every peer alike, what only the first checkpoint of a run pays (DCP's first plans,
    the allocator's first large buffers); the load reads what the save just wrote, from the page cache."""
    import shutil

    checkpointer = getattr(trainer.strategy, "checkpointer", None)  # ours: also time the load without checksums

    def load(verify: bool) -> float:
        if checkpointer is not None:
            checkpointer.verify_checksums = verify
        try:
            return _timed(trainer, lambda: trainer.strategy.load_checkpoint(path))
        finally:
            if checkpointer is not None:
                checkpointer.verify_checksums = True

    saves, loads, unverified, size = [], [], [], 0
    for i in range(repeats + 1):
        path = root / f"ckpt-{i}.ckpt"
        save_s = _timed(trainer, lambda: trainer.save_checkpoint(path))
        if trainer.is_global_zero:
            size = _dir_bytes(path)
        if checkpointer is not None and i % 2:  # alternate which load reads the fresh files first
            unverified_s, load_s = load(False), load(True)
        else:
            load_s = load(True)
            unverified_s = load(False) if checkpointer is not None else None
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if i > 0:
            saves.append(save_s)
            loads.append(load_s)
            if unverified_s is not None:
                unverified.append(unverified_s)
    out = {"save_s": min(saves), "load_s": min(loads), "bytes": size, "save_all_s": saves, "load_all_s": loads}
    if unverified:
        out.update(unverified_load_s=min(unverified), unverified_load_all_s=unverified)
    return out


def run(spec: dict) -> None:
    threads = int(spec.get("threads", 1))
    torch.set_num_threads(threads)
    cuda = spec["device"] == "cuda"
    # every peer, not only ours: Lightning's DDP and ModelParallel strategies leave a gloo group to the interpreter's
    # finalisation, which can abort a run that succeeded
    destroy_process_group_at_exit()
    L.seed_everything(spec["seed"], workers=True)
    strategy, model, callbacks = build(spec)
    timer = StepTimer(spec["warmup"], spec["steps"], cuda)
    report = MemoryReport(log=False)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=spec["world"],
        strategy=strategy,
        precision=spec["precision"],
        max_steps=spec["warmup"] + spec["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer, report, *callbacks],
        default_root_dir=spec["root_dir"],
    )
    loader = torch.utils.data.DataLoader(_dataset(spec), batch_size=spec["batch"], shuffle=False)
    trainer.fit(model, loader)

    # memory: before checkpointing, which allocates its own buffers
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = max(0, peak_rss() - IMPORT_BASELINE)
    optimizers = [getattr(o, "_optimizer", o) for o in trainer.strategy.optimizers]
    local = local_state_bytes(trainer.lightning_module, optimizers)
    full = global_state_bytes(trainer.lightning_module, optimizers)
    mine = torch.tensor([local.params, local.grads, local.optimizer, peak], dtype=torch.int64, device=trainer.strategy.root_device)
    per_rank = trainer.strategy.all_gather(mine).reshape(-1, 4).cpu().tolist()
    ckpt = None
    if spec.get("checkpoint") and spec["world"] > 1:
        ckpt = checkpoint_times(trainer, Path(spec["root_dir"]), spec.get("checkpoint_rounds", 2))
    if not trainer.is_global_zero:
        return
    times = timer.step_times
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    median = sorted(times)[len(times) // 2] if times else float("nan")
    if len(times) % 2 == 0 and times:
        median = (sorted(times)[len(times) // 2 - 1] + sorted(times)[len(times) // 2]) / 2
    tokens = spec["batch"] * spec["model"]["seq_len"] * spec["world"]
    param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in trainer.lightning_module.parameters()}.values())
    result = {
        "spec": spec,
        "ok": True,
        "world": trainer.world_size,
        "step_times": times,
        "first_step_s": intervals[0] if intervals else None,  # includes compilation for the compiled peers
        "median_step_s": median,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median if median == median and median > 0 else None,
        "losses": timer.losses,
        "per_rank": [{"params": r[0], "grads": r[1], "optimizer": r[2], "peak": r[3]} for r in per_rank],
        "unsharded": full.as_dict(),
        "param_bytes": param_bytes,
        "numel": sum(p.numel() for p in {id(p): p for p in trainer.lightning_module.parameters()}.values()),
        "collective_bytes_per_step": {k: v / spec["steps"] for k, v in COUNTER.bytes.items()},
        "collective_calls_per_step": {k: v / spec["steps"] for k, v in COUNTER.calls.items()},
        "peak_kind": "cuda_max_allocated" if cuda else "rss_above_import",
        "import_baseline": IMPORT_BASELINE,
        "checkpoint": ckpt,
        "startup_s": timer.fit_start - _START,
        "wall_s": time.perf_counter() - _START,
        "threads": threads,
        "units": getattr(trainer.strategy, "wrapped_units", None),
    }
    if cuda:
        result["gpu_name"] = torch.cuda.get_device_name()
    Path(spec["out"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
