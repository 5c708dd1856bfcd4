"""``HeldOutRewards``: what RL from verifiable rewards changed, measured on prompts it never trained on.

At the start and the end of fit, the held-out prompts of a :class:`~lightning_fsdp.data.PromptDataModule` are answered
greedily (one completion each, the ranks sharing the work through the generation engine) and scored by the module's
own reward functions. Reported: the accuracy (the mean of the first reward function, or ``accuracy_reward``, which
is 1 for a right answer and 0 otherwise in the package's tasks), the mean total reward, and a few prompts with their
completions before and after, side by side. The figures go into ``trainer.callback_metrics`` as
``held_out_accuracy``/``held_out_reward`` (and ``*_at_start``), hence into the job's ``summary.json``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from typing_extensions import override

from lightning_fsdp.callbacks.held_out import BeforeAndAfter, Row

__all__ = ["HeldOutRewards"]


class HeldOutRewards(BeforeAndAfter):
    """Score greedy completions of the held-out prompts at the start and the end of fit.

    Args:
        count: held-out prompts scored (the first ``count``; ``None``: all).
        show: prompts printed with their completions before and after training.
        accuracy_reward: the reward function (by name) whose mean is the accuracy (default: the first).
        max_new_tokens: the longest completion (default: the module's ``max_completion_length``).
    """

    subject = "Held-out prompts"
    expected_label = "expected"

    def __init__(self, count: Optional[int] = 64, show: int = 4, accuracy_reward: Optional[str] = None,
                 max_new_tokens: Optional[int] = None) -> None:
        super().__init__(show)
        self.count, self.accuracy_reward, self.max_new_tokens = count, accuracy_reward, max_new_tokens

    @override
    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> Optional[tuple[dict[str, float], list[Row]]]:
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

    @override
    def logged(self, metrics: dict[str, float]) -> dict[str, float]:
        return {name: metrics[name] for name in ("accuracy", "reward", "mean_length")}

    @override
    def describe(self, metrics: dict[str, float], rows: list[Row]) -> str:
        return (f"accuracy {metrics['accuracy']:.3f}, mean reward {metrics['reward']:.3f}, mean completion"
                f" {metrics['mean_length']:.1f} tokens ({len(rows)} prompts, {metrics['seconds']:.1f} s)")


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # the last user message
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1]["content"])
    return str(prompt)
