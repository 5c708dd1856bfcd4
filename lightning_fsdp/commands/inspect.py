"""``lightning-fsdp inspect PATH [--json]``: what a checkpoint holds (step, epoch, world size, mesh, sizes,
versions, tensors by group, frozen base it refers to, HF model), read from its metadata only."""

from __future__ import annotations

import json
import sys
from typing import Optional

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.summary import describe_checkpoint, format_description
from lightning_fsdp.commands import arguments, command_parser, fail


def main(argv: Optional[list[str]] = None) -> int:
    parser = command_parser("inspect", __doc__)
    parser.add_argument("path", metavar="PATH", help="a sharded checkpoint directory or a .ckpt file")
    parser.add_argument("--json", action="store_true", help="print the description as JSON")
    args = arguments(parser, argv)
    try:
        description = describe_checkpoint(args.path)
    except CheckpointError as err:
        return fail("inspect", err)
    print(json.dumps(description, indent=2, default=str) if args.json else format_description(description))
    return 0


if __name__ == "__main__":
    sys.exit(main())
