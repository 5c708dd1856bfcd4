"""``lightning-fsdp seal DIR``: accept a DCP checkpoint another tool wrote (Lightning's ``ModelParallelStrategy``,
plain DCP) as a lightning_fsdp checkpoint: it is checked for completeness, its state read without running code,
its files hashed and a manifest written. Loading keeps refusing code in it (the restricted unpickler)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_fsdp.checkpoint.seal import seal
from lightning_fsdp.commands import checkpoint_command


def main(argv: Optional[list[str]] = None) -> int:
    return checkpoint_command("seal", __doc__, argv, ("DIR", "a DCP checkpoint directory without manifest.json"), _seal)


def _seal(args: argparse.Namespace) -> int:
    summary = seal(args.path)
    print(
        f"sealed {summary['path']}: {summary['tensors']} tensors in {summary['files']} files, saved on"
        f" {summary['world_size']} rank(s), {summary['optimizers']} optimizer state(s),"
        f" {'with' if summary['lightning_state'] else 'without'} Lightning's loop state. It loads with fsdp_custom now."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
