"""``lightning-fsdp seal DIR``: accept a DCP checkpoint another tool wrote (Lightning's ``ModelParallelStrategy``,
plain DCP) as a lightning_fsdp checkpoint: it is checked for completeness, its state read without running code,
its files hashed and a manifest written. Loading keeps refusing code in it (the restricted unpickler)."""

from __future__ import annotations

import sys
from typing import Optional

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.seal import seal
from lightning_fsdp.commands import arguments, command_parser, fail


def main(argv: Optional[list[str]] = None) -> int:
    parser = command_parser("seal", __doc__)
    parser.add_argument("path", metavar="DIR", help="a DCP checkpoint directory without manifest.json")
    args = arguments(parser, argv)
    try:
        summary = seal(args.path)
    except CheckpointError as err:
        return fail("seal", err)
    print(
        f"sealed {summary['path']}: {summary['tensors']} tensors in {summary['files']} files, saved on"
        f" {summary['world_size']} rank(s), {summary['optimizers']} optimizer state(s),"
        f" {'with' if summary['lightning_state'] else 'without'} Lightning's loop state. It loads with fsdp_custom now."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
