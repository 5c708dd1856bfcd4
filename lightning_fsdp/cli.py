"""The ``lightning-fsdp`` command: ``train``, ``consolidate``, ``estimate``, ``chat`` and the checkpoint tools.

Each subcommand lives in its own module, imported only when used, whose ``main(argv) -> int`` receives the
arguments after the subcommand's name. ``python -m lightning_fsdp ...`` is the same command.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

#: subcommand → (module with `main(argv) -> int`, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("lightning_fsdp.train", "compose the Hydra config and fit (arguments: Hydra overrides, -m, --help)"),
    "consolidate": (
        "lightning_fsdp.commands.consolidate",
        "a sharded checkpoint → one .ckpt/.safetensors, a Hugging Face model directory or a PEFT adapter",
    ),
    "estimate": ("lightning_fsdp.planner.cli", "estimate per-rank memory of a model/strategy before running it"),
    "verify": ("lightning_fsdp.commands.verify", "check a checkpoint is intact (exit 0) or say what is wrong (exit 1)"),
    "inspect": ("lightning_fsdp.commands.inspect", "what a checkpoint holds: step, world size, mesh, sizes, versions"),
    "seal": ("lightning_fsdp.commands.seal", "make a DCP checkpoint another tool wrote loadable: check, hash, manifest"),
    "import": ("lightning_fsdp.commands.import_gguf", "a GGUF model file → a Hugging Face model directory"),
    "chat": ("lightning_fsdp.commands.chat", "talk to a model: a HF directory, an export, a GGUF file or a checkpoint"),
    "eval": ("lightning_fsdp.commands.eval", "lm-eval tasks on a HF directory or GGUF file, sharded over the ranks"),
    "check": ("lightning_fsdp.commands.check", "a self-check of this machine or cluster: devices, bandwidth, parity,"
              " throughput, the planner"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: lightning-fsdp <command> [arguments]", "", "commands:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    lines += ["", "`lightning-fsdp <command> --help` describes a command's arguments; `--verbose` anywhere shows every",
              "library's output (by default the console shows only this project's)."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Dispatch to a subcommand; returns its exit code (2 for a usage error)."""
    from lightning_fsdp.console import quiet_console, take_verbose_flag

    args = take_verbose_flag(sys.argv[1:] if argv is None else argv)
    quiet_console()
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from lightning_fsdp import __version__

        print(f"lightning-fsdp {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"lightning-fsdp: unknown command {command!r}.\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    code = module.main(rest)
    return int(code) if code is not None else 0


if __name__ == "__main__":
    sys.exit(main())
