"""A domain fine-tuning set that ships with Python: questions about standard-library functions, answered by their docs.

Each sample asks what a function does (``What does `math.log10` do?``) and is answered by the first paragraph of
its docstring (``Return the base 10 logarithm of x.``): real text written by CPython's authors, in the terse voice of
the reference documentation, which a general chat model does not speak. The held-out split is by function, decided
by a hash of its qualified name, so no held-out answer is ever seen in training. Nothing is downloaded; the set
depends only on the running Python's standard library (and is cached by content like any data file).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

from lightning_fsdp.data.sft.demo import write_directory_once

__all__ = ["DOCUMENTED_MODULES", "docstring_pairs", "write_docstring_chat", "write_docstring_preferences"]

#: modules whose public functions are asked about: common, pure-Python-visible, documented one line at a time
DOCUMENTED_MODULES = (
    "math", "cmath", "statistics", "string", "textwrap", "os.path", "shutil", "json", "random", "itertools",
    "functools", "operator", "heapq", "bisect", "fnmatch", "glob", "base64", "binascii", "zlib", "difflib",
    "calendar", "html", "urllib.parse", "keyword", "copy", "csv", "secrets", "time", "struct", "re", "ipaddress",
    "hashlib", "tempfile", "gzip", "unicodedata", "colorsys", "shlex", "filecmp", "os", "sys", "inspect", "platform",
    "locale", "codecs", "pprint", "zipfile", "tarfile", "webbrowser", "mimetypes", "socket", "select", "signal",
)
#: built-in types whose methods are asked about as ``str.upper``
DOCUMENTED_TYPES = (str, bytes, list, dict, set, int, float)
_QUESTIONS = (
    "What does `{}` do?",
    "In Python, what is `{}` for?",
    "Explain `{}` in one sentence.",
    "What does the function `{}` do?",
)
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$|->")


def _first_paragraph(doc: str) -> str:
    """The first paragraph that is prose, not a ``name(args) -> result`` signature line, as one line."""
    for paragraph in doc.split("\n\n"):
        text = " ".join(line.strip() for line in paragraph.strip().splitlines())
        if text and not _SIGNATURE.search(text):
            return text
    return ""


def _documented(owner: Any, prefix: str) -> Iterator[tuple[str, str]]:
    for name in sorted(dir(owner)):
        if name.startswith("_"):
            continue
        obj = getattr(owner, name, None)
        if not callable(obj) or inspect.isclass(obj):
            continue
        if inspect.ismodule(owner) and getattr(obj, "__module__", None) not in (None, owner.__name__) and not (
            str(getattr(obj, "__module__", "")).lstrip("_") in owner.__name__  # `os.path` is `posixpath`
        ):
            continue  # re-exported from elsewhere: asked about where it is defined
        doc = inspect.getdoc(obj) or ""
        answer = _first_paragraph(doc)
        if 20 <= len(answer) <= 220:
            yield f"{prefix}.{name}", answer


def docstring_pairs() -> list[tuple[str, str]]:
    """``(qualified name, first docstring paragraph)`` of every documented function, each name once, sorted."""
    pairs: dict[str, str] = {}
    for module_name in DOCUMENTED_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a platform without it (e.g. no `select` somewhere)
            continue
        pairs.update(_documented(module, module_name))
    for owner in DOCUMENTED_TYPES:
        pairs.update(_documented(owner, owner.__name__))
    return sorted(pairs.items())


def _is_held_out(name: str, every: int) -> bool:
    return zlib.crc32(name.encode()) % every == 0


def _row(name: str, answer: str) -> dict[str, Any]:
    question = _QUESTIONS[zlib.crc32(name.encode(), 1) % len(_QUESTIONS)].format(name)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_docstring_chat(dir: Union[str, Path], held_out_every: int = 10) -> Path:
    """``dir/train.jsonl`` and ``dir/val.jsonl`` (chat ``messages``); about one function in ``held_out_every`` is
    held out. Written to a hidden sibling and renamed into place; an existing set is kept. Returns ``dir``."""

    def fill(tmp: Path) -> None:
        splits: dict[str, list[str]] = {"train": [], "val": []}
        for name, answer in docstring_pairs():
            split = "val" if _is_held_out(name, held_out_every) else "train"
            splits[split].append(json.dumps(_row(name, answer)) + "\n")
        for split, lines in splits.items():
            random.Random(0).shuffle(lines)  # the first held-out questions (those answered and shown) span the modules
            (tmp / f"{split}.jsonl").write_text("".join(lines))

    return write_directory_once(Path(dir), "val.jsonl", fill)


def write_docstring_preferences(dir: Union[str, Path], held_out_every: int = 10) -> Path:
    """``dir/train.jsonl`` and ``dir/val.jsonl`` of preference pairs (TRL's explicit conversational format): the
    question about a function, its own docstring's first paragraph as the chosen answer, and the docstring of another
    function of the same module (or type) as the rejected one, so that telling them apart takes knowing what the
    function does. The split by function is :func:`write_docstring_chat`'s."""

    def fill(tmp: Path) -> None:
        documented = docstring_pairs()
        by_owner: dict[str, list[tuple[str, str]]] = {}
        for name, answer in documented:
            by_owner.setdefault(name.rsplit(".", 1)[0], []).append((name, answer))
        splits: dict[str, list[str]] = {"train": [], "val": []}
        for name, answer in documented:
            siblings = [(n, a) for n, a in by_owner[name.rsplit(".", 1)[0]] if a != answer]
            if not siblings:
                continue
            _, wrong = siblings[zlib.crc32(name.encode(), 2) % len(siblings)]
            messages = _row(name, answer)["messages"]
            row = {"prompt": messages[:1], "chosen": messages[1:], "rejected": [{"role": "assistant", "content": wrong}]}
            splits["val" if _is_held_out(name, held_out_every) else "train"].append(json.dumps(row) + "\n")
        for split, lines in splits.items():
            random.Random(0).shuffle(lines)
            (tmp / f"{split}.jsonl").write_text("".join(lines))

    return write_directory_once(Path(dir), "val.jsonl", fill)


def held_out_eval_rows(count: int = 60, held_out_every: int = 10, choices: int = 4) -> list[dict[str, Any]]:
    """lm-eval rows over the held-out functions of :func:`write_docstring_chat` (never trained on): ``name``,
    ``answer`` (the docstring's first paragraph), and ``choices``/``gold`` (the function's name among ``choices - 1``
    other held-out functions of other modules, in a seeded order). The first ``count``, spread over the modules."""
    held = [(n, a) for n, a in docstring_pairs() if _is_held_out(n, held_out_every)]
    rng = random.Random(0)
    rng.shuffle(held)
    rows = []
    for name, answer in held[:count]:
        others = [n for n, _ in held if n.rsplit(".", 1)[0] != name.rsplit(".", 1)[0]]
        options = rng.sample(others, choices - 1) + [name]
        rng.shuffle(options)
        rows.append({"name": name, "answer": answer, "choices": options, "gold": options.index(name)})
    return rows
