"""The ``lightning-fsdp`` subcommands that work on checkpoints; each module has ``main(argv) -> int``."""
