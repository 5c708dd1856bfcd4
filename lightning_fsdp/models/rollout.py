"""What one rollout window holds between sampling and training, and how it is built (no Trainer needed).

A window's completions become one :class:`RolloutPart` per micro-batch: the prompts left-padded and their
completions right-padded after them (TRL's layout), positions counted per row, the completion mask (through the stop
token), each completion's advantage and, when needed, the old policy's and the reference's per-token
log-probabilities. Rewards are called once for the whole window (:func:`reward_arguments` builds TRL's arguments).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_fsdp.loss import IGNORE_INDEX
from lightning_fsdp.rewards import RewardFunctions

__all__ = ["Rollout", "RolloutPart", "build_part", "collect_metric", "completion_messages", "reward_arguments",
           "rollout_metrics"]


@dataclass
class RolloutPart:
    """One micro-batch of completions, ``(rows, prompt_width + completion_width)``."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    prompt_width: int
    completion_mask: Tensor  # (rows, completion_width): 1 through the stop token
    advantages: Tensor  # (rows,)
    truncated: Tensor  # (rows,) bool: cut at max_completion_length
    old_logps: Optional[Tensor] = None
    ref_logps: Optional[Tensor] = None

    @property
    def labels(self) -> Tensor:
        """The completion tokens where they are trained, ``-100`` elsewhere (aligned with ``input_ids``)."""
        labels = torch.full_like(self.input_ids, IGNORE_INDEX)
        completion = self.input_ids[:, self.prompt_width:]
        labels[:, self.prompt_width:] = completion.masked_fill(self.completion_mask == 0, IGNORE_INDEX)
        return labels

    def to(self, device: torch.device) -> RolloutPart:
        def move(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.to(device)

        return RolloutPart(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                           self.prompt_width, self.completion_mask.to(device), self.advantages.to(device),
                           self.truncated.to(device), move(self.old_logps), move(self.ref_logps))


@dataclass
class Rollout:
    """A window's parts (one per micro-batch), what the rollout measured, and this rank's completions as sampled
    (:class:`~lightning_fsdp.generation.Completions`)."""

    window_id: Any
    parts: list[RolloutPart]
    metrics: dict[str, float] = field(default_factory=dict)
    completions: Any = None


def build_part(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], stopped: Sequence[bool],
    advantages: Tensor, *, pad_id: int, num_generations: int, mask_truncated: bool = False,
) -> RolloutPart:
    """A part from its prompts and their completions (prompt ``i``'s are rows ``i * G .. i * G + G - 1``)."""
    rows = len(completions)
    if rows != len(prompts) * num_generations:
        raise ValueError(f"{rows} completions for {len(prompts)} prompts × num_generations={num_generations}.")
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(1, max(len(c) for c in completions))
    ids = torch.full((rows, prompt_width + completion_width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    completion_mask = torch.zeros((rows, completion_width), dtype=torch.long)
    for r, completion in enumerate(completions):
        prompt = prompts[r // num_generations]
        ids[r, prompt_width - len(prompt):prompt_width] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[r, prompt_width - len(prompt):prompt_width] = 1
        if completion:
            ids[r, prompt_width:prompt_width + len(completion)] = torch.as_tensor(list(completion), dtype=torch.long)
            mask[r, prompt_width:prompt_width + len(completion)] = 1
            completion_mask[r, :len(completion)] = 1
    truncated = torch.tensor([not s for s in stopped], dtype=torch.bool)
    if mask_truncated:  # DAPO's overlong filtering: a cut completion teaches nothing
        completion_mask = completion_mask * (~truncated).long().unsqueeze(1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return RolloutPart(ids, mask, positions, prompt_width, completion_mask, advantages.float(), truncated)


def completion_messages(prompt: Any, text: str) -> Any:
    """What a reward function receives as a completion: the text, or ``[{"role": "assistant", "content": text}]``
    when the prompt is a conversation (TRL's convention)."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": text}]
    return text


def reward_arguments(rows: Sequence[dict[str, Any]], texts: Sequence[str], completion_ids: Sequence[Sequence[int]],
                     num_generations: int) -> tuple[list[Any], list[Any], list[list[int]], dict[str, list[Any]]]:
    """``(prompts, completions, completion_ids, columns)`` with each prompt and its columns repeated for its
    completions, as TRL calls a reward function."""
    prompts = [row["prompt"] for row in rows for _ in range(num_generations)]
    completions = [completion_messages(p, t) for p, t in zip(prompts, texts)]
    names = sorted({k for row in rows for k in row["columns"]})
    columns = {k: [row["columns"].get(k) for row in rows for _ in range(num_generations)] for k in names}
    return prompts, completions, [list(c) for c in completion_ids], columns


def collect_metric(into: dict[str, float]) -> Callable[[str, float], None]:
    """TRL's ``log_metric`` hook handed to reward functions: values summed into ``into`` by name."""

    def log_metric(name: str, value: float) -> None:
        into[name] = into.get(name, 0.0) + float(value)

    return log_metric


def rollout_metrics(rewards: RewardFunctions, scores: Tensor, zero_std: Tensor, everyone: list[Any],
                     logged: dict[str, float]) -> dict[str, float]:
    """TRL's rollout metrics over every rank's completions."""
    total = rewards.total(scores)
    lengths = torch.tensor([n for _, counts, *_ in everyone for n in counts], dtype=torch.float32)
    stopped = torch.tensor([s for _, _, flags, *_ in everyone for s in flags], dtype=torch.bool)
    tokens = sum(t for *_, t, _ in everyone)
    seconds = max(s for *_, s in everyone)
    metrics = {"reward": float(torch.nanmean(total)), "reward_std": float(_std(total)),
               "frac_reward_zero_std": float(zero_std.float().mean()),
               "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
               "completions/min_length": float(lengths.min()),
               "completions/clipped_ratio": float((~stopped).float().mean()),
               "rollout/tokens_per_second": tokens / max(seconds, 1e-9)}
    for j, name in enumerate(rewards.names):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(scores[:, j]))
        metrics[f"rewards/{name}/std"] = float(_std(scores[:, j]))
    metrics.update({name: value for name, value in logged.items()})
    return metrics


def _std(values: Tensor) -> Tensor:
    kept = values[~torch.isnan(values)]
    return kept.std() if kept.numel() > 1 else torch.zeros(())
