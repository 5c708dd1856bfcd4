"""Rewards for the expression task (:mod:`lightning_fsdp.data.expressions`): is the stated value the right one?

:func:`stated_value` reads the value a completion states the way a grader of short answers does: what follows
"evaluates to" (or "returns", "equals", ...) up to the end of that sentence or clause, or the code span right there
(``evaluates to `44` because ...``); else the first code span that is not the expression itself; else the first
line. :func:`correct_value` compares it with the ``answer`` column as Python values (``ast.literal_eval``), so
``8.0`` matches ``8.0`` but not ``8``, and a string matches with or without its quotes. :func:`concise` rewards
answering with the value alone, as the prompt asks.
"""

from __future__ import annotations

import ast
import re
from typing import Any

__all__ = ["concise", "correct_value", "is_correct", "stated_value"]

_SPAN = re.compile(r"`+([^`]+)`+")
_AFTER = re.compile(r"(?:evaluates? to|returns|is equal to|equals|result is|gives)\s*:?\s*(.+)", re.IGNORECASE | re.DOTALL)
_END = re.compile(r"\n|\s+(?:because|since|as|which)\b|\.(?=\s|$)")


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: the assistant message
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def stated_value(text: str, expression: str = "") -> str:
    """The value ``text`` states for ``expression`` (see the module docstring)."""
    text = text.strip()
    match = _AFTER.search(text)
    if match:
        tail = match.group(1).strip()
        span = _SPAN.match(tail)
        return span.group(1).strip() if span else _END.split(tail)[0].strip().rstrip(",;:").strip()
    spans = [s.strip() for s in _SPAN.findall(text) if s.strip().replace(" ", "") != expression.replace(" ", "")]
    if spans:
        return spans[0]
    return text.splitlines()[0].strip().rstrip(".").strip() if text else ""


def is_correct(stated: str, answer: str) -> bool:
    """Whether ``stated`` is the value whose repr is ``answer``."""
    try:
        expected = ast.literal_eval(answer)
    except (ValueError, SyntaxError):
        return stated == answer
    try:
        value = ast.literal_eval(stated)
        return type(value) is type(expected) and value == expected
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return isinstance(expected, str) and stated.strip("'\"") == expected


def correct_value(prompts: list[Any], completions: list[Any], answer: list[str], expression: list[str],
                  **_: Any) -> list[float]:
    """1.0 when the completion states the expression's value, else 0.0."""
    return [float(is_correct(stated_value(_text(c), e), a)) for c, a, e in zip(completions, answer, expression)]


def concise(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is the value alone (a short single line), else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        text = _text(completion).strip().strip("`").strip()
        out.append(float("\n" not in text and len(text) <= max(12, 2 * len(expected))))
    return out
