"""``lightning-fsdp train [overrides]``: compose the Hydra config, instantiate every object, fit.

Processes and folders:

- The process the user starts runs Hydra (``hydra.main``): it composes the config, creates the run folder
  (or one folder per job with ``-m``) and runs :func:`run`.
- Lightning's launcher starts ranks ``1..N-1`` by re-running the same command. Before fitting, the launcher
  process puts the *resolved* job config into the environment (:data:`RANK_CONFIG_ENV`); a process started by the
  launcher finds it there and runs that exact job: no second composition, no Hydra, no folder of its own, even
  under ``-m`` (where re-running the command line would start the whole sweep again).
- With ``-m`` each job runs in a fresh process (:data:`JOB_CONFIG_ENV`), which then launches its ranks as above:
  no process group, global state or device memory leaks from one job into the next.
- Ranks started by an external launcher (torchrun, srun) with a global rank above 0 compose the same overrides
  without Hydra's run machinery, so they create no folders either; give every rank the same
  ``hydra.run.dir=...`` there (see ``examples/multinode.md``).

Everything that can be checked from the config alone (unknown arguments, a mesh that does not fit the devices)
fails in :func:`validate_config`, before any process or process group exists.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_fsdp import _warm_start
from lightning_fsdp.train_config import (  # noqa: F401 - part of this command's API
    ConfigError,
    accepted_arguments,
    check_init_args,
    check_mesh,
    ensure_demo_data,
    ensure_pretrained,
    instantiate_group,
    validate_config,
    world_size_of,
)

log = logging.getLogger(__name__)

CONFIG_MODULE = "lightning_fsdp.configs"
CONFIG_NAME = "train"
#: the resolved job config (YAML) handed from the launching process to the ranks it starts
RANK_CONFIG_ENV = "LIGHTNING_FSDP_RANK_CONFIG"
#: the resolved config of one multirun job, handed to the process that runs it
JOB_CONFIG_ENV = "LIGHTNING_FSDP_JOB_CONFIG"


# -- one job, on every rank ------------------------------------------------------------------------------------------
def run(cfg: DictConfig, *, is_launcher: bool = True) -> dict[str, Any]:
    """Validate, instantiate, fit, print the sample; returns (and on rank 0 writes) the job summary.

    ``is_launcher``: this process starts the job (global rank 0); it prepares files the other ranks read.
    """
    import lightning as L
    from hydra.utils import instantiate

    import lightning_fsdp  # noqa: F401  (registers the strategy names)

    _warm_start.resume_collection()  # imported: the collector, off since this process began, runs again
    validate_config(cfg)
    if is_launcher:
        ensure_demo_data(cfg)
        ensure_pretrained(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)

    strategy = instantiate(cfg.strategy, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
    loggers = instantiate_group(cfg.get("logger"), "logger")
    trainer: L.Trainer = instantiate(
        cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False, _convert_="all"
    )

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    sample = None
    if cfg.get("sample") and callable(getattr(model, "generate", None)) and hasattr(datamodule, "encode"):
        sample = generate_sample(model, datamodule, cfg.sample)  # every rank: FSDP gathers parameters
        if trainer.is_global_zero:
            print(f"\nSample from the trained model (prompt {cfg.sample.prompt!r}):\n{sample}\n", flush=True)

    summary = summarize(trainer, sample)
    if cfg.get("export") and cfg.export.get("formats") and trainer.is_global_zero:  # formats: [] exports nothing
        summary["exports"] = export_last_checkpoint(trainer, cfg.export)
        if "hf" in summary["exports"]:
            print(f"\nChat with the fine-tuned model:\n  lightning-fsdp chat {summary['exports']['hf']}\n", flush=True)
    if trainer.is_global_zero:
        output_dir = Path(str(cfg.paths.output_dir)) if cfg.get("paths") else Path(trainer.default_root_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _wait_for_ranks(trainer)
    return summary


def export_last_checkpoint(trainer: Any, export_cfg: DictConfig) -> dict[str, str]:
    """Rank 0, after fit: ``lightning-fsdp consolidate`` of the last checkpoint into each configured format."""
    from lightning_fsdp.commands.consolidate import main as consolidate

    last = getattr(trainer.checkpoint_callback, "last_model_path", "")
    if not last:
        raise RuntimeError("`export` needs a checkpoint: keep the model_checkpoint callback with save_last: true.")
    suffix = {"ckpt": "model.ckpt", "safetensors": "model.safetensors", "hf": "hf_model", "peft": "adapter",
              "gguf": "model.gguf"}
    written = {}
    for fmt in export_cfg.formats:
        if fmt == "peft" and not any(".lora_" in name for name, _ in trainer.lightning_module.named_parameters()):  # e.g. experiment=dpo with model.lora=null: the hf export is the model
            print("not exported as peft: a full fine-tune has no adapters (the hf export holds every weight)", flush=True)
            continue
        dst = Path(str(export_cfg.dir)) / suffix[fmt]
        replace = ["--force"] if fmt == "gguf" else []  # as the other formats replace an earlier run's export
        if consolidate([last, str(dst), "--format", fmt, "--no-progress", *replace]) != 0:
            raise RuntimeError(f"Exporting {last} as {fmt} failed; see the error above.")
        print(f"exported {last} as {fmt}: {dst}", flush=True)
        written[fmt] = str(dst)
    return written


def generate_sample(model: Any, datamodule: Any, sample_cfg: DictConfig) -> str:
    prompt_ids = datamodule.encode(str(sample_cfg.prompt))
    ids = model.generate(
        prompt_ids,
        max_new_tokens=int(sample_cfg.get("max_new_tokens", 100)),
        temperature=float(sample_cfg.get("temperature", 1.0)),
        top_k=sample_cfg.get("top_k"),
        seed=int(sample_cfg.get("seed", 0)),
    )
    return datamodule.decode(ids[0])


def summarize(trainer: Any, sample: Optional[str]) -> dict[str, Any]:
    """Plain numbers and paths a user or a test can read back from ``summary.json``."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    ckpt = trainer.checkpoint_callback
    strategy = trainer.strategy
    summary: dict[str, Any] = {
        "state": str(trainer.state.status.value),
        "global_step": int(trainer.global_step),
        "world_size": int(trainer.world_size),
        "warm_started_ranks": _warm_start.handed_over,  # local ranks that imported alongside the first
        # objects the garbage collector skips: what this process imported, with the collector off, before the job
        "frozen_objects": gc.get_freeze_count(),
        "strategy": getattr(strategy, "strategy_name", type(strategy).__name__),
        "metrics": metrics,
        "last_checkpoint": getattr(ckpt, "last_model_path", "") or None,
        "best_checkpoint": getattr(ckpt, "best_model_path", "") or None,
        "sample": sample,
    }
    if hasattr(strategy, "wrapped_units"):
        summary["wrapped_units"] = list(strategy.wrapped_units)
        summary["mesh_shape"] = list(strategy.mesh_shape.sizes)
    from lightning_fsdp.trainer.memory import MemoryReport

    for callback in trainer.callbacks:
        if isinstance(callback, MemoryReport) and callback.rows:
            summary["memory"] = {
                "ranks": [{"rank": r.rank, "params": r.params, "grads": r.grads, "optimizer": r.optimizer,
                           "peak": r.peak} for r in callback.rows],
                "unsharded": callback.unsharded.as_dict() if callback.unsharded is not None else None,
                "shard_size": callback.shard_size,
            }
    return summary


def _wait_for_ranks(trainer: Any, timeout: float = 300.0) -> None:
    """The launching process waits for the ranks it started, and fails if one of them failed."""
    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or []
    failed = []
    for rank, proc in enumerate(procs, start=1):
        code = proc.wait(timeout=timeout)
        if code != 0:
            failed.append((rank, code))
    if failed:
        raise RuntimeError(f"Rank(s) started by this process failed (local rank, exit code): {failed}.")


# -- processes: who composes the config -------------------------------------------------------------------------------
def external_global_rank(env: Mapping[str, str] = os.environ) -> int:
    """The global rank an external launcher gave this process (torchrun ``RANK``, srun ``SLURM_PROCID``, or a
    manual multi-node launch's ``NODE_RANK``); 0 when started directly."""
    if env.get("RANK", "").isdigit():
        return int(env["RANK"])
    if env.get("SLURM_PROCID", "").isdigit() and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return int(env["SLURM_PROCID"])
    if env.get("NODE_RANK", "").isdigit() and "LOCAL_RANK" not in env:
        return int(env["NODE_RANK"])
    return 0


def is_launched_rank(env: Mapping[str, str] = os.environ) -> bool:
    """True in a process started by this job's launcher (Lightning's), which must run the handed-over config."""
    return RANK_CONFIG_ENV in env and env.get("LOCAL_RANK", "0") not in ("", "0")


def _run_handed_over() -> int:
    cfg = OmegaConf.create(os.environ[RANK_CONFIG_ENV])
    assert isinstance(cfg, DictConfig)
    run(cfg, is_launcher=False)
    return 0


def _run_as_launcher(cfg: DictConfig, command_argv: list[str], *, is_launcher: bool) -> dict[str, Any]:
    """One job in the process that starts the other local ranks; the process is left as it was found."""
    saved_env, saved_argv = dict(os.environ), list(sys.argv)
    sys.argv = command_argv  # Lightning's launcher re-runs sys.argv for the other ranks
    os.environ[RANK_CONFIG_ENV] = OmegaConf.to_yaml(cfg, resolve=True)
    try:
        return run(cfg, is_launcher=is_launcher)
    finally:
        from lightning_fsdp.parallel.process_group import release_process_group

        release_process_group()
        # the launcher sets LOCAL_RANK/WORLD_SIZE/MASTER_PORT here; a next multirun job must start from scratch
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        sys.argv = saved_argv


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose like ``hydra.main`` would, but create no folder: for ranks an external launcher started."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise ConfigError(
            f"{flags}: Hydra flags (e.g. -m/--multirun) cannot be used when torchrun/srun starts the ranks;"
            " pass only key=value overrides (one job per launch)."
        )
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(Path(str(cfg.hydra.run.dir)).absolute())
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(job, DictConfig)  # created from a DictConfig's container
    with open_dict(job):
        del job["hydra"]
    return job


def _run_job_in_subprocess(cfg: DictConfig) -> None:
    """One multirun job in a fresh process tree: no process group, global state or device memory carries over
    from one job to the next. The job's process receives the resolved config and creates no folder."""
    env = {**os.environ, JOB_CONFIG_ENV: OmegaConf.to_yaml(cfg, resolve=True)}
    proc = subprocess.run([sys.executable, "-m", "lightning_fsdp.train"], env=env, cwd=os.getcwd(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"The job's training processes failed (exit code {proc.returncode}); see their output above.")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-fsdp train``; ``argv`` are Hydra overrides/flags (default ``sys.argv[1:]``)."""
    from lightning_fsdp.console import quiet_console, take_verbose_flag

    argv = take_verbose_flag(sys.argv[1:] if argv is None else argv)
    quiet_console()  # a job's own process (`python -m lightning_fsdp.train`) comes here without the CLI
    if is_launched_rank():
        return _run_handed_over()
    if JOB_CONFIG_ENV in os.environ:  # one job of a multirun, started by `_run_job_in_subprocess`
        cfg = OmegaConf.create(os.environ.pop(JOB_CONFIG_ENV))
        assert isinstance(cfg, DictConfig)
        _run_as_launcher(cfg, list(sys.argv), is_launcher=True)
        return 0
    command_argv = list(sys.argv)
    if external_global_rank() > 0:
        cfg = compose_config(argv)
        _run_as_launcher(cfg, command_argv, is_launcher=False)
        return 0

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    @hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
    def _job(cfg: DictConfig) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            _run_job_in_subprocess(cfg)
        else:
            _run_as_launcher(cfg, command_argv, is_launcher=True)

    sys.argv = [sys.argv[0], *argv]  # what hydra.main parses
    try:
        _job()
    except SystemExit as exit_:  # Hydra reports errors itself, then exits
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = command_argv
    return 0


if __name__ == "__main__":
    if _warm_start.WARM_RANK_ENV in os.environ:  # a warm rank of `lightning-fsdp train`: wait for its command
        handed = _warm_start.wait_for_command()
        if handed is None:
            sys.exit(0)
        from lightning_fsdp.cli import main as cli_main

        sys.exit(cli_main(handed))
    sys.exit(main())
