"""Reward functions for the GRPO tests, importable by dotted path (``tests.helpers.rewards.<name>``) in every rank."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def length_near_target(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], target: list[int],
                       **_: Any) -> list[float]:
    """A continuous reward a random model has signal in: closeness of the completion's length to ``target``."""
    return [-abs(len(ids) - t) / 4.0 for ids, t in zip(completion_ids, target)]


def has_word(prompts: list[Any], completions: list[Any], word: list[str], **_: Any) -> list[float]:
    """1.0 when the completion contains the row's ``word``."""
    return [float(w in _text(c)) for c, w in zip(completions, word)]


def raises(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    raise KeyError("a missing column")


def returns_nan(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    return [float("nan")] * len(completions)


def returns_too_few(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    return [0.0] * (len(completions) - 1)


def positional_only(a: Any, b: Any) -> list[float]:
    return []


def mean_token_id(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A continuous reward a random model has signal in (samples differ): its tokens' mean id over 100."""
    return [sum(ids) / max(len(ids), 1) / 100.0 for ids in completion_ids]
