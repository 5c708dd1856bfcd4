"""``HeldOutRewards``: what RL from verifiable rewards changed, measured on prompts it never trained on.

At the start and the end of fit, the held-out prompts of a :class:`~lightning_fsdp.data.PromptDataModule` are answered
greedily (one completion each, the ranks sharing the work through the generation engine) and scored by the module's
own reward functions. Reported: the accuracy (the mean of the first reward function, or ``accuracy_reward``, which
is 1 for a right answer and 0 otherwise in the package's tasks), the mean total reward, and a few prompts with their
completions before and after, side by side. The figures go into ``trainer.callback_metrics`` as
``held_out_accuracy``/``held_out_reward`` (and ``*_at_start``), hence into the job's ``summary.json``.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["HeldOutRewards"]


class HeldOutRewards(Callback):
    """Score greedy completions of the held-out prompts at the start and the end of fit.

    Args:
        count: held-out prompts scored (the first ``count``; ``None``: all).
        show: prompts printed with their completions before and after training.
        accuracy_reward: the reward function (by name) whose mean is the accuracy (default: the first).
        max_new_tokens: the longest completion (default: the module's ``max_completion_length``).
    """

    def __init__(self, count: Optional[int] = 64, show: int = 4, accuracy_reward: Optional[str] = None,
                 max_new_tokens: Optional[int] = None) -> None:
        self.count, self.show, self.accuracy_reward, self.max_new_tokens = count, show, accuracy_reward, max_new_tokens
        self.results: dict[str, dict[str, float]] = {}
        self.completions: dict[str, list[str]] = {}  # "start"/"end" → each held-out prompt's completion
        self._before: list[str] = []

    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> Optional[tuple[dict[str, float], list[Any]]]:
        """``(metrics, rows)``: the held-out figures, and ``(prompt text, expected, completion)`` per prompt."""
        from lightning_fsdp.generation import Sampling, generate_on_ranks
        from lightning_fsdp.models.rollout import reward_arguments

        datamodule: Any = getattr(trainer, "datamodule", None)
        rewards = getattr(pl_module, "rewards", None)
        if datamodule is None or rewards is None or not hasattr(datamodule, "held_out_rows"):
            return None
        rows = datamodule.held_out_rows(self.count)
        if not rows:
            return None
        started = time.perf_counter()
        sampling = pl_module.sampling(pl_module.stop_ids(), greedy=True)
        if self.max_new_tokens is not None:
            sampling = Sampling(self.max_new_tokens, temperature=0.0, stop_ids=sampling.stop_ids)
        done = generate_on_ranks(pl_module, pl_module.model, [r["prompt_ids"] for r in rows], sampling,
                                 pad_id=datamodule.pad_id, mode=pl_module.hparams["rollout_mode"],
                                 device=trainer.strategy.root_device)
        texts = [datamodule.decode(ids) for ids in done.ids]
        prompts, completions, ids, columns = reward_arguments(rows, texts, done.ids, 1)
        scores = rewards.score(prompts, completions, ids, columns)
        which = rewards.names.index(self.accuracy_reward) if self.accuracy_reward else 0
        metrics = {"accuracy": float(torch.nanmean(scores[:, which])),
                   "reward": float(torch.nanmean(rewards.total(scores))),
                   "mean_length": sum(len(i) for i in done.ids) / len(done.ids),
                   "seconds": time.perf_counter() - started}
        shown = [(_prompt_text(r["prompt"]), r["columns"].get("answer", ""), t) for r, t in zip(rows, texts)]
        return metrics, shown

    def _measure(self, trainer: L.Trainer, pl_module: Any, when: str, suffix: str) -> list[Any]:
        evaluated = self.evaluate(trainer, pl_module)
        if evaluated is None:
            return []
        metrics, rows = evaluated
        self.results[when] = metrics
        self.completions[when] = [text for _, _, text in rows]
        for name in ("accuracy", "reward", "mean_length"):
            trainer.callback_metrics[f"held_out_{name}{suffix}"] = torch.tensor(metrics[name])
        if trainer.is_global_zero:
            label = "at step 0" if when == "start" else f"after {trainer.global_step} steps"
            print(f"Held-out prompts {label}: accuracy {metrics['accuracy']:.3f}, mean reward {metrics['reward']:.3f},"
                  f" mean completion {metrics['mean_length']:.1f} tokens ({len(rows)} prompts,"
                  f" {metrics['seconds']:.1f} s)", flush=True)
        return rows

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._measure(trainer, pl_module, "start", "_at_start")
        self._before = self.completions.get("start", [])

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self._measure(trainer, pl_module, "end", "")
        if rows and trainer.is_global_zero and self.show:
            print(self.side_by_side(rows), flush=True)

    def side_by_side(self, rows: list[tuple[str, str, str]]) -> str:
        wrap = textwrap.TextWrapper(width=100, initial_indent="    ", subsequent_indent="    ")
        lines = ["Held-out prompts, before and after training:"]
        for i, (prompt, expected, after) in enumerate(rows[: self.show]):
            before = self._before[i] if i < len(self._before) else ""
            lines.append(f"  Q: {prompt}")
            for label, text in (("expected", str(expected)), ("before", before), ("after", after)):
                lines.append(f"  {label}:")
                lines += wrap.wrap(text.strip() or "(empty)")
        return "\n".join(lines)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # the last user message
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1]["content"])
    return str(prompt)
