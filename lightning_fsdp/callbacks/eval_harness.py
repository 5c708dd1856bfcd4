"""``EvalHarness``: lm-evaluation-harness tasks scored on the model as it trains, sharded, on the ranks that train it.

At step 0, every ``every_n_steps`` optimizer steps and at the end, the tasks run through
:func:`~lightning_fsdp.evaluation.harness.evaluate_tasks` (lm-eval's own Hugging Face backend over the shards, the
requests split over the ranks). Each task's metrics are logged as ``eval/<task>/<metric>`` at that step, put into
``trainer.callback_metrics`` (so into the job's ``summary.json``), and a before/after table is printed at the end.
The evaluation leaves training as it found it: the model's mode, its shards, and every random generator (lm-eval
seeds them), so a run with the callback trains exactly as one without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["EvalHarness", "task_metrics"]


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``results`` as flat metric names: ``eval/<task>/<metric>`` (standard errors left out)."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, _ = key.partition(",")
            if "," in key and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                metrics[f"eval/{task}/{metric}"] = float(value)
    return metrics


class EvalHarness(Callback):
    """Score lm-eval ``tasks`` at the start, every ``every_n_steps`` optimizer steps, and at the end of fit.

    Args:
        tasks: lm-eval task names: lm-eval's own, this package's (``python_docs``, ``python_docstring_choice``), or
            YAML in ``include_path``.
        every_n_steps: also evaluate after every this many optimizer steps (``None``: start and end only).
        limit, num_fewshot, apply_chat_template, include_path: as lm-eval takes them.
        batch_size: requests per forward on each rank.
        rollout_mode: how the shards are gathered while evaluating (``auto``, ``gather_once``, ``stream``).
    """

    def __init__(self, tasks: Sequence[str], every_n_steps: Optional[int] = None,
                 limit: Optional[Union[int, float]] = None, num_fewshot: Optional[int] = None,
                 apply_chat_template: bool = False, include_path: Optional[str] = None, batch_size: int = 8,
                 rollout_mode: str = "auto") -> None:
        from lightning_fsdp.evaluation import require_lm_eval

        require_lm_eval()  # before any process starts
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: evaluate every 1 or more steps, or pass None.")
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        self.every_n_steps = every_n_steps
        self.options = {"limit": limit, "num_fewshot": num_fewshot, "apply_chat_template": apply_chat_template,
                        "include_path": include_path, "batch_size": batch_size, "rollout_mode": rollout_mode}
        #: step → that evaluation's metrics
        self.history: dict[int, dict[str, float]] = {}
        self.seconds = 0.0

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_fsdp.evaluation.harness import evaluate_tasks

        step = trainer.global_step
        if step in self.history:
            return
        datamodule = getattr(trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None) or getattr(pl_module, "tokenizer", None)
        model = getattr(pl_module, "model", pl_module)
        started = time.perf_counter()
        results = evaluate_tasks(pl_module, model, tokenizer, self.tasks, **self.options)  # type: ignore[arg-type]
        self.seconds += time.perf_counter() - started
        metrics = task_metrics(results)
        self.history[step] = metrics
        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if trainer.is_global_zero:
            figures = ", ".join(f"{name.removeprefix('eval/')} {value:.4f}" for name, value in metrics.items())
            print(f"lm-eval at step {step}: {figures} ({time.perf_counter() - started:.1f} s)", flush=True)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluate(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluate(trainer, pl_module)
        if trainer.is_global_zero and len(self.history) > 1:
            print(self.before_and_after(), flush=True)

    def before_and_after(self) -> str:
        """Each metric at the first and the last evaluation, and the change."""
        first, last = self.history[min(self.history)], self.history[max(self.history)]
        width = max(len(name) for name in first) if first else 10
        lines = [f"lm-eval before and after training (steps {min(self.history)} and {max(self.history)}):",
                 f"  {'metric':<{width}}  {'before':>8}  {'after':>8}  {'change':>8}"]
        for name, before in first.items():
            after = last.get(name, float("nan"))
            lines.append(f"  {name:<{width}}  {before:8.4f}  {after:8.4f}  {after - before:+8.4f}")
        return "\n".join(lines)
