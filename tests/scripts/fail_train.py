"""Train the test model with one injected fault, for the failure, preemption and non-finite tests.

``python fail_train.py SPEC.json``; the Lightning launcher re-runs this file for the other ranks (or torchrun
starts them). The spec is the one ``train.py`` takes, plus ``inject`` (what goes wrong, on which rank, at which
global step). Rank 0 appends one JSON line per optimizer step to ``spec["log"]`` as it goes, so the record
survives a crash or a preemption:
``{"step", "loss", "params"?, "skipped"?}`` (``params`` when ``record_params``: the full flattened parameters).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

import lightning_fsdp  # noqa: E402,F401
from lightning_fsdp import resilience  # noqa: E402
from tests.helpers.models import TinyLM, loader, token_dataset  # noqa: E402


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class Faulty(TinyLM):
    """TinyLM whose ``training_step``/hooks misbehave on one rank at one global step, as the spec says."""

    def __init__(self, inject: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inject = inject

    def _hit(self, kind: str) -> bool:
        spec = self.inject
        hit = (
            spec.get("kind") == kind
            and _rank() in _as_list(spec.get("rank", 0))
            and self.trainer.global_step in _as_list(spec.get("step", 0))
        )
        if hit:
            _stamp(spec)
        return hit

    def training_step(self, batch, batch_idx):
        if self._hit("raise_step"):
            raise ValueError(f"injected failure in training_step on rank {_rank()}")
        if self._hit("sigkill"):  # what the OOM killer does: no traceback, no exception, no abort record
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit("sleep"):
            time.sleep(float(self.inject.get("seconds", 60)))
        if self._hit("wait_signal"):
            Path(self.inject["marker"]).write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not resilience.preemption_requested() and time.monotonic() < deadline:
                time.sleep(0.02)
        loss = self.loss(batch)
        if self._hit("nan"):
            loss = loss * float("nan")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if self._hit("raise_validate"):
            raise ValueError(f"injected failure in validation_step on rank {_rank()}")
        return super().validation_step(batch, batch_idx)

    def on_train_start(self):
        if self.inject.get("kind") == "uneven":
            _stamp(self.inject)  # the fault is in the data: count from the start of training

    def on_train_batch_start(self, batch, batch_idx):
        if self._hit("raise_hook"):
            raise RuntimeError(f"injected failure in on_train_batch_start on rank {_rank()}")


def _stamp(inject: dict) -> None:
    """Record when the fault fires, so the test can measure how long the ranks take to end after it."""
    if inject.get("stamp"):
        Path(inject["stamp"]).write_text(str(time.time()))


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class FailingIterable(IterableDataset):
    """Yields pairs from a token dataset and raises when the sample ``fail_at`` is reached on the failing rank."""

    def __init__(self, n: int, fail_rank: int, fail_at: int, limit: int | None = None, inject: dict | None = None) -> None:
        self.data = token_dataset(n)
        self.fail_rank, self.fail_at, self.limit = fail_rank, fail_at, limit
        self.inject = inject or {}

    def __iter__(self):
        for i in range(self.limit if self.limit is not None else len(self.data)):
            if i == self.fail_at and _rank() == self.fail_rank:
                _stamp(self.inject)
                raise OSError(f"injected failure reading sample {i} on rank {_rank()}")
            yield self.data[i]


class Record(Callback):
    """Rank 0 appends each optimizer step's rank-averaged loss (and optionally the full parameters) to a file."""

    def __init__(self, path: str, record_params: bool) -> None:
        self.path, self.record_params = path, record_params

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean"))
        row = {"step": trainer.global_step, "loss": loss}
        if self.record_params:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if trainer.is_global_zero:
                row["params"] = torch.cat([v.float().flatten() for _, v in sorted(sd.items())]).tolist()
        guard = getattr(trainer.strategy.resilience, "nonfinite", None)
        if guard is not None:
            row["skipped"] = guard.skipped
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def build_loader(spec: dict, model: TinyLM) -> DataLoader:
    data = spec.get("data", {})
    inject = spec.get("inject", {})
    batch_size = spec.get("batch_size", 4)
    if inject.get("kind") == "raise_data":
        return DataLoader(FailingIterable(data.get("n", 64), inject.get("rank", 0), inject.get("sample", 8), inject=inject), batch_size=batch_size)
    if inject.get("kind") == "uneven":
        counts = inject["batches"]  # batches per rank
        n = counts[_rank()] * batch_size
        if inject.get("iterable"):
            return DataLoader(FailingIterable(64, -1, -1, limit=n), batch_size=batch_size)
        return DataLoader(torch.utils.data.Subset(token_dataset(64), range(n)), batch_size=batch_size)
    return loader(data.get("n", 64), batch_size, model.hparams.vocab, model.hparams.seq, data.get("seed", 0))


def main(spec: dict) -> None:
    L.seed_everything(spec.get("seed", 0), workers=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    strategy = lightning_fsdp.FSDPCustomStrategy(**spec.get("strategy_kwargs", {}))
    callbacks: list[Callback] = [Record(spec["log"], spec.get("record_params", False))]
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_last=True, **spec.get("checkpoint_kwargs", {})))
    if spec.get("on_exception_dir"):
        callbacks.append(lightning_fsdp.SafeOnExceptionCheckpoint(spec["on_exception_dir"]))
    uneven = spec.get("inject", {}).get("kind") == "uneven"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec.get("devices", 2),
        num_nodes=spec.get("num_nodes", 1),
        strategy=strategy,
        max_steps=spec.get("max_steps", -1),
        max_epochs=spec.get("max_epochs", None),
        enable_checkpointing=bool(spec.get("checkpoint_dir") or spec.get("on_exception_dir")),
        use_distributed_sampler=not uneven,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=spec.get("limit_val_batches", 0),
        callbacks=callbacks,
        default_root_dir=spec.get("root_dir", os.getcwd()),
    )
    model = Faulty(spec.get("inject", {}), **spec.get("model", {}))
    trainer.fit(model, build_loader(spec, model), ckpt_path=spec.get("ckpt_path"))
    if spec.get("validate_after"):  # a second Trainer stage in the same processes
        trainer.validate(model, build_loader(spec, model))
    if trainer.is_global_zero and spec.get("done"):
        Path(spec["done"]).write_text(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
