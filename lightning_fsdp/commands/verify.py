"""``lightning-fsdp verify PATH``: is this checkpoint intact? Exit 0 if so, 1 with the reason if not.

A sharded directory needs a valid manifest, only regular files, and every file at its size and checksum
(``--no-checksums``: sizes only, for a quick check); a ``.ckpt`` must be an intact archive (its members' CRCs).
Nothing is unpickled beyond the manifest, and no tensor is loaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_fsdp.checkpoint import verify_checkpoint
from lightning_fsdp.commands import checkpoint_command
from lightning_fsdp.formatting import format_bytes


def main(argv: Optional[list[str]] = None) -> int:
    return checkpoint_command("verify", __doc__, argv, ("PATH", "a sharded checkpoint directory or a .ckpt file"),
                              _verify, flags=[("--no-checksums", "check sizes only (no file is read through)")],
                              refusal=lambda args, err: f"{args.path}: NOT OK: {err}")


def _verify(args: argparse.Namespace) -> int:
    manifest = verify_checkpoint(args.path, checksums=not args.no_checksums)
    what = "sizes" if args.no_checksums else "sizes and checksums"
    if manifest is None:
        print(f"{args.path}: OK (archive {'structure' if args.no_checksums else 'CRCs'} intact)")
    else:
        print(f"{args.path}: OK ({len(manifest.files)} files, {format_bytes(manifest.total_bytes)}: {what} match the manifest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
