"""The ``lightning-fsdp`` subcommands besides ``train`` and ``estimate``: checkpoint tools (``consolidate``, ``verify``,
``inspect``, ``seal``), ``import`` of GGUF files, ``chat``, ``eval`` and ``check``; each module has
``main(argv) -> int``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
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


def checkpoint_command(name: str, doc: Optional[str], argv: Optional[list[str]], path: tuple[str, str],
                       run: Callable[[argparse.Namespace], int], flags: Sequence[tuple[str, str]] = (),
                       refusal: Callable[[argparse.Namespace, Exception], str] = lambda args, err: f"error: {err}") -> int:
    """A subcommand over one checkpoint: ``path`` is its argument's metavar and help, ``flags`` its ``--flag``
    switches (name, help); ``run(args)`` returns the exit code, and a refused checkpoint (``CheckpointError``) is
    reported on stderr as ``lightning-fsdp NAME: <refusal(args, err)>`` with exit code 1."""
    from lightning_fsdp.checkpoint import CheckpointError

    parser = command_parser(name, doc)
    parser.add_argument("path", metavar=path[0], help=path[1])
    for flag, help in flags:
        parser.add_argument(flag, action="store_true", help=help)
    args = arguments(parser, argv)
    try:
        return run(args)
    except CheckpointError as err:
        print(f"lightning-fsdp {name}: {refusal(args, err)}", file=sys.stderr)
        return 1


def model_source_kind(path: Path) -> str:
    """What a command's MODEL argument is: ``"hf"`` (a model directory), ``"gguf"`` (a file to convert) or
    ``"checkpoint"`` (a sharded checkpoint directory); a ``ValueError`` for anything else, saying what was expected."""
    from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME
    from lightning_fsdp.hf.gguf import is_gguf

    if not path.exists():
        raise ValueError(f"{path}: no such file or directory. MODEL is a Hugging Face model directory, a .gguf file"
                         f" or a sharded checkpoint directory (holds {MANIFEST_NAME}).")
    if path.is_file():
        if is_gguf(path):
            return "gguf"
        raise ValueError(f"{path} is a file, and of the files only a .gguf model is read. Pass a Hugging"
                         " Face model directory, a .gguf file or a sharded checkpoint directory (`lightning-fsdp"
                         " consolidate CKPT DIR --format hf` turns a checkpoint into a model directory).")
    if (path / MANIFEST_NAME).is_file():
        return "checkpoint"
    if (path / "config.json").is_file():
        return "hf"
    if any(path.glob("*.distcp")):
        raise ValueError(f"{path} holds a DCP checkpoint without {MANIFEST_NAME} (written by another tool); make it"
                         f" loadable with `lightning-fsdp seal {path}` first.")
    inside = sorted(str(p.parent) for p in [*path.glob(f"*/{MANIFEST_NAME}"), *path.glob(f"*/*/{MANIFEST_NAME}")])
    hint = f" It holds checkpoints: {', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''}." if inside else ""
    raise ValueError(f"{path} is neither a Hugging Face model directory (no config.json) nor a sharded checkpoint"
                     f" directory (no {MANIFEST_NAME}).{hint}")
