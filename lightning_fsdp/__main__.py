"""``python -m lightning_fsdp <command> ...``: the ``lightning-fsdp`` command."""

import sys

from lightning_fsdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
