"""``lightning-fsdp inspect PATH [--json]``: what a checkpoint holds (step, epoch, world size, mesh, sizes,
versions, tensors by group, frozen base it refers to, HF model), read from its metadata only."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from lightning_fsdp.checkpoint.summary import describe_checkpoint, format_description
from lightning_fsdp.commands import checkpoint_command


def main(argv: Optional[list[str]] = None) -> int:
    return checkpoint_command("inspect", __doc__, argv, ("PATH", "a sharded checkpoint directory or a .ckpt file"),
                              _inspect, flags=[("--json", "print the description as JSON")])


def _inspect(args: argparse.Namespace) -> int:
    description = describe_checkpoint(args.path)
    print(json.dumps(description, indent=2, default=str) if args.json else format_description(description))
    return 0


if __name__ == "__main__":
    sys.exit(main())
