"""How numbers and lists read in messages, tables and reports: written once, used by every module."""

from __future__ import annotations

from collections.abc import Iterable

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_BINARY_UNITS = (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_COUNT_UNITS = (("B", 1e9), ("M", 1e6), ("K", 1e3))
_PARSE_UNITS = {
    "tib": 1024**4, "gib": GiB, "mib": MiB, "kib": KiB,
    "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3,
    "t": 1024**4, "g": GiB, "m": MiB, "k": KiB, "b": 1,
}


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.50 KiB"``: the largest binary unit that keeps the number at or above one."""
    for unit, size in _BINARY_UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_mib(n: float | None, digits: int = 1) -> str:
    """Bytes in MiB with thousands separators, for tables whose column header names the unit; ``–`` for None."""
    return "–" if n is None else f"{n / MiB:,.{digits}f}"


def format_count(n: float) -> str:
    """``1.2e9`` parameters → ``"1.20B"``."""
    for unit, size in _COUNT_UNITS:
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"512MiB"``, ``"5GB"``, ``"1.5e9"`` → bytes (GB = 10⁹, GiB = 2³⁰)."""
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(_PARSE_UNITS, key=len, reverse=True):
        if s.endswith(suffix) and s[: -len(suffix)]:
            return int(float(s[: -len(suffix)]) * _PARSE_UNITS[suffix])
    return int(float(s))


def short_list(items: Iterable[str], limit: int = 8) -> str:
    """``[a, b, c, ... 12 more]``: enough names to act on, without flooding a message."""
    items = list(items)
    if not items:
        return "[]"
    shown = ", ".join(items[:limit])
    more = f", ... {len(items) - limit} more" if len(items) > limit else ""
    return f"[{shown}{more}]"
