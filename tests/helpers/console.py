"""What counts as another library's line on a ``lightning-fsdp`` console: warnings, log records, tips, progress bars."""

from __future__ import annotations

import re

_FOREIGN = [
    re.compile(r"site-packages/"),  # a warning printed with its source file, a library's traceback-less notice
    re.compile(r"^\[[^\]]*\]\[(?!lightning_fsdp)[\w.]+\]\[(DEBUG|INFO|WARNING|ERROR)\]"),  # Hydra-formatted log record
    re.compile(r"^(\[rank\d+\]:)?[IWE]\d{4} \d\d:"),  # torch's own log format
    re.compile(r"\b\w*(Warning|Tip)\b:"),  # FutureWarning: ..., 💡 Tip: ...
    re.compile(r"\d+(\.\d+)?\s?(it|examples|B|kB|MB)/s\]"),  # tqdm progress bars
    re.compile(r"Failed to load|GPU available:|TPU available:|Initializing distributed:|distributed_backend=|"
               r"All distributed processes registered|`Trainer\.fit` stopped|Seed set to|was configured so"),
]


def foreign_lines(text: str) -> list[str]:
    """The lines of ``text`` (a job's stdout and stderr) that another library printed."""
    lines = [part for line in text.splitlines() for part in line.split("\r")]
    ours = re.compile(r"^\[[^\]]*\]\[lightning_fsdp[\w.]*\]")  # the project's own log records, whatever paths they name
    return [line for line in lines if not ours.search(line) and any(p.search(line) for p in _FOREIGN)]
