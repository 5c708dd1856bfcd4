"""Train, save and resume the test model for the checkpoint tests; the Lightning launcher re-runs it for every rank.

``python ckpt_train.py SPEC.json``. Spec keys (all optional unless said):

- ``devices``, ``batch_size``, ``max_epochs``, ``data`` (``{"n": ...}``), ``model`` (TinyLM kwargs),
  ``strategy_kwargs`` (``FSDPCustomStrategy`` kwargs), ``empty_init``
- ``checkpoint_dir`` + ``checkpoint_kwargs``: a ``ModelCheckpoint`` (``save_last=True`` unless given)
- ``stage``: ``"fit"`` (default) or ``"validate"``; ``ckpt_path``: passed to that stage
- ``save_path``: ``trainer.save_checkpoint`` after the stage; ``full_save_path``: the same with
  ``state_dict_type="full"``
- ``fail_write``: ``{"rank": r, "path": p, "async_then": p2}``: after the saves, limit rank ``r``'s file size
  (``RLIMIT_FSIZE``, a real ``EFBIG`` from the OS) and save to ``p``; with ``async_then``, save again to ``p2``
  (an async save's failure surfaces there)
- ``pid_dir``: every rank writes ``rank<R>.pid`` once its process group is up
- ``error_dir``: every rank that raises writes ``rank<R>.txt`` (type and message) and exits with code 3
- ``pretrained_probe``: after sharding, every rank resets its peak RSS, calls ``load_pretrained`` on this file and
  reports the peak increase in bytes (``probe_peak_bytes``, per rank); ``pretrained_probe_sharded``: the same with
  ``load_safetensors`` on a safetensors directory (``probe_sharded_peak_bytes``)
- ``pause_after_write_s``: every rank sleeps this long after writing its shard files, before the ranks agree that
  the save is complete (so the test can kill a rank mid-save)
- ``load_each`` (with ``error_dir``): ``{case: checkpoint path}``, loaded one after another after the stage through the
  strategy's ``load_checkpoint`` (what the Trainer calls); every rank writes ``<case>-rank<R>.txt`` with the error it
  raised (or ``loaded``), and the job goes on: many refused loads in one start-up

Rank 0 writes ``out`` (JSON): per-step losses, ``global_step``, ``world_size``, ``params_path`` (gathered params).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_fsdp  # noqa: E402
from tests.helpers.models import build_model, loader  # noqa: E402


class Record(Callback):
    """Rank-averaged loss of every step; pid files; the pretrained-load memory probe."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.losses: list[float] = []
        self.probe: dict[str, list[int]] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        if self.spec.get("pid_dir"):
            Path(self.spec["pid_dir"], f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))

    def on_fit_start(self, trainer, pl_module) -> None:
        self._probe(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._probe(trainer)

    def _probe(self, trainer) -> None:
        if self.probe:
            return
        from lightning_fsdp.checkpoint import load_pretrained
        from lightning_fsdp.hf import load_safetensors

        for key, load in (("pretrained_probe", load_pretrained), ("pretrained_probe_sharded", load_safetensors)):
            if self.spec.get(key):
                trainer.strategy.barrier()
                before = _reset_peak_rss()
                load(trainer.strategy.model, self.spec[key])
                peak = _peak_rss() - before
                self.probe[key] = trainer.strategy.all_gather(torch.tensor([peak])).reshape(-1).tolist()


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux) and return it in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmHWM") * 1024


def _peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def full_params(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float().clone() for k, v in sd.items()}


def _limit_file_size(nbytes: int) -> None:
    """A real write failure: the kernel refuses to grow any file of this process beyond ``nbytes`` (EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))


def _unlimit_file_size() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def pause_after_writing_shards(seconds: float) -> None:
    """Make every sharded save pause after this rank wrote its shard files (before `.metadata` and the commit)."""
    import time

    from lightning_fsdp.checkpoint.sharded import RecordingWriter

    write_data = RecordingWriter.write_data

    def paused(self, plan, planner):
        result = write_data(self, plan, planner)
        time.sleep(seconds)
        return result

    RecordingWriter.write_data = paused


def run(spec: dict, record: Record) -> L.Trainer:
    if spec.get("pause_after_write_s"):
        pause_after_writing_shards(float(spec["pause_after_write_s"]))
    L.seed_everything(spec.get("seed", 0), workers=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    strategy = lightning_fsdp.FSDPCustomStrategy(**spec.get("strategy_kwargs", {}))
    callbacks: list[Callback] = [record]
    if spec.get("checkpoint_dir"):
        kwargs = {"save_last": True, **spec.get("checkpoint_kwargs", {})}
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], **kwargs))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec.get("devices", 2),
        strategy=strategy,
        max_epochs=spec.get("max_epochs", 1),
        max_steps=spec.get("max_steps", -1),
        enable_checkpointing=bool(spec.get("checkpoint_dir")),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=spec.get("limit_val_batches", 0),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=spec["root_dir"],
    )
    with trainer.init_module(empty_init=spec.get("empty_init", False)):
        model, vocab, seq = build_model(spec)
    data = spec.get("data", {})
    batches = loader(
        data.get("n", 48), spec.get("batch_size", 6), vocab, seq, data.get("seed", 0)
    )
    if spec.get("stage", "fit") == "validate":
        trainer.validate(model, batches, ckpt_path=spec.get("ckpt_path"))
    else:
        trainer.fit(model, batches, ckpt_path=spec.get("ckpt_path"))
    if spec.get("save_path"):
        trainer.save_checkpoint(spec["save_path"])
    if spec.get("full_save_path"):
        strategy.state_dict_type = "full"
        trainer.save_checkpoint(spec["full_save_path"])
        strategy.state_dict_type = spec.get("strategy_kwargs", {}).get("state_dict_type", "sharded")
    for case, path in spec.get("load_each", {}).items():
        try:
            strategy.load_checkpoint(path)
            outcome = "loaded"
        except Exception as err:  # noqa: BLE001 - recorded for the test, which asserts on it
            outcome = f"{type(err).__name__}: {err}"
        Path(spec["error_dir"], f"{case}-rank{trainer.global_rank}.txt").write_text(outcome)
    fail = spec.get("fail_write")
    if fail:
        strategy.checkpointer.finalize()  # an async save still being written must not hit the limit
        if trainer.global_rank == fail["rank"]:
            _limit_file_size(fail.get("limit", 4096))
        try:
            trainer.save_checkpoint(fail["path"])
            if fail.get("async_then"):
                trainer.save_checkpoint(fail["async_then"])
        finally:
            _unlimit_file_size()
    return trainer


def main(spec: dict) -> int:
    record = Record(spec)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    try:
        trainer = run(spec, record)
    except BaseException as err:
        if spec.get("error_dir") and not isinstance(err, KeyboardInterrupt):
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else rank
            Path(spec["error_dir"], f"rank{rank}.txt").write_text(
                f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}"
            )
            return 3
        raise
    params = full_params(trainer)
    sb = trainer.strategy.state_bytes()
    state_bytes = trainer.strategy.all_gather(torch.tensor([sb.params, sb.grads, sb.optimizer])).reshape(-1, 3).tolist()
    if trainer.is_global_zero and spec.get("out"):
        out = Path(spec["out"])
        params_path = out.with_suffix(".params.pt")
        torch.save(params, params_path)
        result = {
            "losses": record.losses,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "params_path": str(params_path),
            "probe_peak_bytes": record.probe.get("pretrained_probe", []),
            "probe_sharded_peak_bytes": record.probe.get("pretrained_probe_sharded", []),
            "trainable": sorted(n for n, p in trainer.lightning_module.named_parameters() if p.requires_grad),
            "state_bytes": state_bytes,
        }
        out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(Path(sys.argv[1]).read_text())))
