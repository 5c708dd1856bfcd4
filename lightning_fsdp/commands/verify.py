"""``lightning-fsdp verify PATH``: is this checkpoint intact? Exit 0 if so, 1 with the reason if not.

A sharded directory needs a valid manifest, only regular files, and every file at its size and checksum
(``--no-checksums``: sizes only, for a quick check); a ``.ckpt`` must be an intact archive (its members' CRCs).
Nothing is unpickled beyond the manifest, and no tensor is loaded.
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning_fsdp.checkpoint import CheckpointError, verify_checkpoint
from lightning_fsdp.commands import arguments, command_parser
from lightning_fsdp.formatting import format_bytes


def main(argv: Optional[list[str]] = None) -> int:
    parser = command_parser("verify", __doc__)
    parser.add_argument("path", metavar="PATH", help="a sharded checkpoint directory or a .ckpt file")
    parser.add_argument("--no-checksums", action="store_true", help="check sizes only (no file is read through)")
    args = arguments(parser, argv)
    try:
        manifest = verify_checkpoint(args.path, checksums=not args.no_checksums)
    except CheckpointError as err:
        print(f"lightning-fsdp verify: {args.path}: NOT OK: {err}", file=sys.stderr)
        return 1
    what = "sizes" if args.no_checksums else "sizes and checksums"
    if manifest is None:
        print(f"{args.path}: OK (archive {'structure' if args.no_checksums else 'CRCs'} intact)")
    else:
        print(f"{args.path}: OK ({len(manifest.files)} files, {format_bytes(manifest.total_bytes)}: {what} match the manifest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
