"""A verifiable task from the code domain: what does a Python expression evaluate to?

Each prompt shows one expression built from builtins, ``str``/``list`` methods and the ``math`` module (``len('tulip')``,
``sorted([3, 1, 2])``, ``'a-b'.split('-')``, ``math.gcd(12, 18)``) and asks for its value; the ``answer`` column holds
the value's ``repr``, which a program checks (:func:`lightning_fsdp.rewards.expressions.correct_value`). Python itself
computes every answer, so the data is right by construction and nothing is downloaded. The expressions come from
templates filled with seeded random words and numbers; the held-out split uses its own seed, and no held-out
expression appears in training.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union

from lightning_fsdp.cache import build_once

__all__ = ["DEMO_FAMILIES", "EXPRESSION_FAMILIES", "expression_rows", "write_expression_prompts"]

WORDS = ("apple", "river", "stone", "tulip", "cloud", "piano", "lemon", "tiger", "ocean", "maple", "cabin", "pixel",
         "robot", "spark", "delta", "honey", "quilt", "zebra", "mango", "olive")
PROMPT = "What does the Python expression `{}` evaluate to? Reply with the value only."
SYSTEM = "You are a Python interpreter. Reply with the value of the expression only, as Python would print its repr."


def _small(rng: random.Random) -> int:
    return rng.randint(2, 12)


def _numbers(rng: random.Random) -> str:
    return "[" + ", ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 5))) + "]"


def _word(rng: random.Random) -> str:
    return repr(rng.choice(WORDS))


#: name → a template drawing one expression (as source text) from a seeded generator
EXPRESSION_FAMILIES: dict[str, Callable[[random.Random], str]] = {
    "add": lambda r: f"{r.randint(10, 99)} + {r.randint(10, 99)}",
    "multiply": lambda r: f"{_small(r)} * {_small(r)}",
    "floor_divide": lambda r: f"{r.randint(20, 99)} // {_small(r)}",
    "modulo": lambda r: f"{r.randint(20, 99)} % {_small(r)}",
    "power": lambda r: f"{r.randint(2, 5)} ** {r.randint(2, 3)}",
    "len_str": lambda r: f"len({_word(r)})",
    "len_list": lambda r: f"len({_numbers(r)})",
    "upper": lambda r: f"{_word(r)}.upper()",
    "capitalize": lambda r: f"{_word(r)}.capitalize()",
    "index": lambda r: f"{_word(r)}[{r.randint(0, 4)}]",
    "reverse": lambda r: f"{_word(r)}[::-1]",
    "slice": lambda r: f"{_word(r)}[:{r.randint(2, 4)}]",
    "repeat": lambda r: f"'{r.choice(WORDS)[:2]}' * {r.randint(2, 3)}",
    "concat": lambda r: f"{_word(r)} + {_word(r)}",
    "count": lambda r: f"{_word(r)}.count('{r.choice('aeiou')}')",
    "find": lambda r: f"{_word(r)}.find('{r.choice('aeiou')}')",
    "max": lambda r: f"max({_numbers(r)})",
    "min": lambda r: f"min({_numbers(r)})",
    "sum": lambda r: f"sum({_numbers(r)})",
    "sorted": lambda r: f"sorted({_numbers(r)})",
    "abs": lambda r: f"abs(-{r.randint(2, 99)})",
    "range": lambda r: f"list(range({r.randint(2, 6)}))",
    "split": lambda r: "'" + "-".join(r.sample(WORDS, 3)) + "'.split('-')",
    "join": lambda r: "'-'.join([" + ", ".join(repr(w) for w in r.sample(WORDS, 2)) + "])",
    "int": lambda r: f"int('{r.randint(10, 999)}')",
    "str": lambda r: f"str({r.randint(10, 99)}) + '{r.randint(0, 9)}'",
    "bool": lambda r: f"bool({r.choice(['0', '1', repr(''), repr('x'), '[]'])})",
    "gcd": lambda r: f"math.gcd({_small(r) * 2}, {_small(r) * 3})",
    "factorial": lambda r: f"math.factorial({r.randint(2, 5)})",
    "sqrt": lambda r: f"math.sqrt({r.randint(2, 9) ** 2})",
    "add_digits": lambda r: f"{r.randint(1, 9)} + {r.randint(1, 9)}",
    "subtract_digits": lambda r: f"{r.randint(5, 9)} - {r.randint(1, 4)}",
    "compare": lambda r: f"{r.randint(1, 20)} {r.choice(['>', '<', '=='])} {r.randint(1, 20)}",
    "contains": lambda r: f"'{r.choice('aeiou')}' in {_word(r)}",
    "not": lambda r: f"not {r.choice(['True', 'False'])}",
    "max2": lambda r: f"max({r.randint(1, 9)}, {r.randint(10, 30)})",
    "min2": lambda r: f"min({r.randint(1, 9)}, {r.randint(10, 30)})",
    "round": lambda r: f"round({r.randint(1, 9)}.{r.choice([2, 3, 7, 8])})",
    "float": lambda r: f"float({r.randint(1, 9)})",
    "type": lambda r: f"type({r.choice(['3', '2.5', repr('a'), '[1]', 'True'])}).__name__",
    "len_short": lambda r: f"len({r.choice(WORDS)[:r.randint(1, 3)]!r})",
    "upper_letter": lambda r: f"{r.choice('abcdefgh')!r}.upper()",
    "int_digit": lambda r: f"int('{r.randint(1, 9)}')",
}


#: the families of the GRPO demo: those SmolLM2-135M-Instruct answers right sometimes, but not always, before
#: training (greedy and sampled, measured on the model), so its rewards carry signal from the first step
DEMO_FAMILIES = ("add_digits", "subtract_digits", "multiply", "compare", "not", "bool", "min2", "max2", "float",
                 "int_digit", "int", "abs", "upper_letter", "type", "gcd", "round")


def evaluate(expression: str) -> Any:
    """The value of one of this module's expressions (builtins and ``math`` only)."""
    return eval(expression, {"__builtins__": __builtins__, "math": math})  # noqa: S307 - our own templates only


def expression_rows(n: int, seed: int, exclude: frozenset[str] = frozenset(),
                    families: Sequence[str] = tuple(EXPRESSION_FAMILIES)) -> list[dict[str, Any]]:
    """``n`` distinct prompts (chat messages) with ``expression``, ``answer`` (the value's repr) and ``family``,
    the ``families`` in turn, none of them in ``exclude``."""
    unknown = sorted(set(families) - set(EXPRESSION_FAMILIES))
    if unknown:
        raise ValueError(f"unknown expression families {unknown}; known: {sorted(EXPRESSION_FAMILIES)}")
    rng = random.Random(seed)
    families = list(families)
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"only {len(rows)} distinct expressions for {n} asked")
        family = families[attempts % len(families)]
        expression = EXPRESSION_FAMILIES[family](rng)
        if expression in seen:
            continue
        seen.add(expression)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT.format(expression)}]
        rows.append({"prompt": prompt, "expression": expression, "answer": repr(evaluate(expression)),
                     "family": family})
    return rows


def write_expression_prompts(dir: Union[str, Path], train: int = 600, val: int = 64, seed: int = 0,
                             families: Sequence[str] = DEMO_FAMILIES) -> Path:
    """``dir/train.jsonl`` and ``dir/val.jsonl`` (prompts in TRL's conversational format), written once."""

    def fill(tmp: Path) -> None:
        held_out = expression_rows(val, seed + 1, families=families)
        training = expression_rows(train, seed, exclude=frozenset(r["expression"] for r in held_out),
                                   families=families)
        for name, rows in (("val", held_out), ("train", training)):
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    return build_once(Path(dir), fill, complete="train.jsonl")
