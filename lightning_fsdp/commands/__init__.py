"""The ``lightning-fsdp`` subcommands besides ``train`` and ``estimate``: checkpoint tools (``consolidate``, ``verify``,
``inspect``, ``seal``), ``import`` of GGUF files and ``chat``; each module has ``main(argv) -> int``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def command_parser(name: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """``lightning-fsdp NAME``'s parser, described by the first line of its module docstring."""
    return argparse.ArgumentParser(prog=f"lightning-fsdp {name}", description=(doc or "").splitlines()[0])


def arguments(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def fail(name: str, err: BaseException) -> int:
    """Report a refused input on stderr as ``lightning-fsdp NAME: error: ...``; the exit code is 1."""
    print(f"lightning-fsdp {name}: error: {err}", file=sys.stderr)
    return 1
