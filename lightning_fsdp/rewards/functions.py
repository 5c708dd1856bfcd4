"""Reward functions as plain Python, with TRL's signature, checked at the edge.

A reward function is any callable ``reward(prompts, completions, **columns) -> list[float]``: ``prompts`` and
``completions`` are strings, or message lists for conversational data (a completion is then
``[{"role": "assistant", "content": text}]``), ``completion_ids`` holds the tokens, and every other column of the
data set arrives by name, one value per completion. A function may return ``None`` for a completion it does not
apply to (as in TRL); it must not raise, return NaN or return another number of values than completions: each is a
clear error naming the function and the fix. Functions are named in a config by dotted path
(``model.reward_funcs=[my_package.rewards.exact_match]``), each with a weight.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["RewardError", "RewardFunctions", "load_reward_function"]

RewardFunction = Callable[..., Sequence[Optional[float]]]


class RewardError(ValueError):
    """A reward function that cannot be used; the message names it, the problem and the fix."""


def load_reward_function(spec: Union[str, RewardFunction]) -> RewardFunction:
    """A callable from ``"package.module.function"`` (or the callable itself)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or "." not in spec:
        raise RewardError(f"reward function {spec!r}: give a dotted path such as 'my_package.rewards.exact_match'.")
    module_name, _, name = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward function {spec!r}: its module {module_name!r} cannot be imported ({err}). Check"
                          " the path, and that the package is installed or on PYTHONPATH in every process.") from err
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward function {spec!r}: {module_name} has no callable {name!r}"
                          f"{' (it is ' + type(function).__name__ + ')' if function is not None else ''}.")
    return function


def _name(spec: Union[str, RewardFunction], function: RewardFunction) -> str:
    return spec.rpartition(".")[2] if isinstance(spec, str) else getattr(function, "__name__", type(function).__name__)


class RewardFunctions:
    """The run's reward functions and their weights: :meth:`score` calls each, checks what it returned, and gives
    a ``(completions, functions)`` tensor (NaN where a function returned ``None``)."""

    def __init__(self, specs: Sequence[Union[str, RewardFunction]], weights: Optional[Sequence[float]] = None) -> None:
        if not specs:
            raise RewardError("GRPO needs at least one reward function: set model.reward_funcs=[package.module.function].")
        self.functions = [load_reward_function(s) for s in specs]
        self.names = [_name(s, f) for s, f in zip(specs, self.functions)]
        for name, function in zip(self.names, self.functions):
            _check_signature(name, function)
        weights = [1.0] * len(self.functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.functions):
            raise RewardError(f"{len(weights)} reward_weights for {len(self.functions)} reward functions {self.names}:"
                              " give one weight per function, or none (each weighs 1).")
        self.weights = torch.tensor(weights, dtype=torch.float32)

    def score(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], columns: Mapping[str, Any]
    ) -> torch.Tensor:
        """``(len(completions), len(functions))`` rewards, NaN where a function returned ``None``."""
        out = torch.zeros(len(completions), len(self.functions), dtype=torch.float32)
        for j, (name, function) in enumerate(zip(self.names, self.functions)):
            try:
                values = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as err:
                raise RewardError(f"The reward function {name!r} raised {type(err).__name__}: {err}. A reward function"
                                  " must return a score for every completion, including malformed ones (score them"
                                  " 0, or None where it does not apply).") from err
            values = list(values) if values is not None else []
            if len(values) != len(completions):
                raise RewardError(f"The reward function {name!r} returned {len(values)} rewards for {len(completions)}"
                                  " completions: return exactly one per completion (None where it does not apply).")
            for i, value in enumerate(values):
                if value is None:
                    out[i, j] = math.nan
                    continue
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    raise RewardError(f"The reward function {name!r} returned {value!r} for completion {i}: return"
                                      " numbers (or None where it does not apply).") from None
                if not math.isfinite(number):
                    raise RewardError(f"The reward function {name!r} returned {number} for completion {i}"
                                      f" ({str(completions[i])[:80]!r}): rewards must be finite; return None for a"
                                      " completion it cannot score.")
                out[i, j] = number
        return out

    def total(self, per_function: torch.Tensor) -> torch.Tensor:
        """The weighted sum over functions (``None`` counted as 0), NaN where every function returned ``None``."""
        weighted = (per_function * self.weights.to(per_function)).nansum(dim=1)
        return weighted.masked_fill(torch.isnan(per_function).all(dim=1), math.nan)


def _check_signature(name: str, function: RewardFunction) -> None:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [k for k in ("prompts", "completions") if k not in parameters and not takes_any]
    if missing:
        raise RewardError(f"The reward function {name!r} does not take {missing}: reward functions have TRL's"
                          " signature, reward(prompts, completions, **kwargs) -> list[float].")
