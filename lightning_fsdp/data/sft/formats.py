"""Which kind of fine-tuning data a table holds, told from its columns, and each row as a conversation or a text.

Accepted formats (``format="auto"`` picks the first whose columns are all present):

==================== =========================================== ==========================================
format               columns                                     trained tokens
==================== =========================================== ==========================================
``chat``             ``messages`` (``role``/``content``), or      every assistant turn (``train_on``)
                     ShareGPT ``conversations`` (``from``/``value``)
``instruction``      ``instruction``, ``output`` [, ``input``,     the response (one user, one assistant turn
                     ``system``]                                  through the chat template)
``prompt_completion`` ``prompt``, ``completion``                  the completion and EOS
``text``             ``text``                                     every token and EOS
==================== =========================================== ==========================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Optional

__all__ = ["FORMATS", "TRAIN_ON", "DataFormat", "TrainOn", "detect_format", "needs_chat_template", "row_messages"]

DataFormat = Literal["chat", "instruction", "prompt_completion", "text"]
TrainOn = Literal["assistant", "last", "all"]
TRAIN_ON: tuple[str, ...] = ("assistant", "last", "all")

#: format → the column sets that identify it (any one of them), in detection order
FORMATS: dict[str, tuple[frozenset[str], ...]] = {
    "chat": (frozenset({"messages"}), frozenset({"conversations"})),
    "instruction": (frozenset({"instruction", "output"}),),
    "prompt_completion": (frozenset({"prompt", "completion"}),),
    "text": (frozenset({"text"}),),
}

#: ShareGPT speaker names → chat roles
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "bot": "assistant"}


def _accepted() -> str:
    return "; ".join(f"{name}: " + " or ".join("+".join(sorted(cols)) for cols in sets) for name, sets in FORMATS.items())


def detect_format(columns: Iterable[str], requested: str = "auto") -> DataFormat:
    """The format of a table with ``columns``: ``requested`` checked against them, or the first that matches."""
    present = set(columns)
    if requested != "auto":
        if requested not in FORMATS:
            raise ValueError(f"format={requested!r} is not one of 'auto', {', '.join(map(repr, FORMATS))}.")
        if not any(cols <= present for cols in FORMATS[requested]):
            raise ValueError(
                f"format={requested!r} needs the columns {' or '.join(str(sorted(c)) for c in FORMATS[requested])},"
                f" but the data has {sorted(present)}. Accepted formats: {_accepted()}."
            )
        return requested  # type: ignore[return-value]
    for name, column_sets in FORMATS.items():
        if any(cols <= present for cols in column_sets):
            return name  # type: ignore[return-value]
    raise ValueError(
        f"The data's columns {sorted(present)} match no format. Accepted formats (columns): {_accepted()}."
        " Rename the columns, or pass format= with one of them."
    )


def needs_chat_template(fmt: str) -> bool:
    return fmt in ("chat", "instruction")


def row_messages(row: Mapping[str, Any], fmt: str) -> list[dict[str, str]]:
    """A ``chat`` or ``instruction`` row as a list of ``{"role", "content"}`` messages."""
    if fmt == "instruction":
        prompt = str(row["instruction"])
        extra: Optional[Any] = row.get("input")
        if extra:
            prompt = f"{prompt}\n\n{extra}"
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(row["output"])}]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": str(row["system"])})
        return messages
    if row.get("messages") is not None:
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
    out = []
    for turn in row["conversations"]:
        speaker = str(turn["from"]).lower()
        if speaker not in _SHAREGPT_ROLES:
            raise ValueError(f"ShareGPT speaker {turn['from']!r} is not one of {sorted(_SHAREGPT_ROLES)}.")
        out.append({"role": _SHAREGPT_ROLES[speaker], "content": str(turn["value"])})
    return out
