"""What the command line prints: the project's own progress, tables and results, not other libraries' chatter.

Each silenced line is named here, by the logger or module that emits it and its message, never by a blanket filter:
a warning nobody listed still shows. ``lightning-fsdp --verbose`` (or ``LIGHTNING_FSDP_VERBOSE=1``) shows everything.
Where the cause of a line is ours, it is fixed at the cause instead (e.g. ``seed_everything(verbose=False)``).

Standard library only: it runs before torch is imported, in every process of a job (ranks inherit the settings
through the environment).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence

__all__ = ["VERBOSE_ENV", "quiet_console", "take_verbose_flag"]

#: ``1`` shows every library's output
VERBOSE_ENV = "LIGHTNING_FSDP_VERBOSE"

#: loggers whose records below the level carry nothing a user acts on
QUIET_LOGGERS: dict[str, int] = {
    # torchao, imported by transformers' quantizer registry whenever it is installed: optional CUDA kernels it cannot
    # load on this machine, and "no Triton" on CPU
    "torchao": logging.ERROR,
    # torch itself, when torchao registers its enums as pytree constants (deprecated in torch 2.13)
    "torch.utils._pytree": logging.ERROR,
    # Lightning's start-up notes: accelerators seen, the process group formed, tips, limits it was given
    "lightning.pytorch.utilities.rank_zero": logging.WARNING,
    "lightning.fabric.utilities.distributed": logging.WARNING,
    # gguf's writer narrating the file it writes (``consolidate --format gguf`` reports the file itself)
    "gguf.gguf_writer": logging.WARNING,
}

#: (category, message regex, module regex) of warnings raised inside other libraries that are not the user's to fix
QUIET_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # Lightning 2.6 under torch 2.13 uses a pytree API torch deprecated
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
    # Lightning's hint when an `srun` binary exists on a machine the job was not started on by Slurm
    (UserWarning, r"The `srun` command is available on your system but is not used", r"lightning\.fabric\..*"),
)

#: environment switches of libraries that draw progress bars for steps we report ourselves
QUIET_ENVIRONMENT = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # "Generating train split", "Map", "Saving the dataset"
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" and "Writing model shards"
}


def take_verbose_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--verbose``; when it was there, every process of this job from now on is verbose."""
    rest = [a for a in argv if a != "--verbose"]
    if len(rest) != len(argv):
        os.environ[VERBOSE_ENV] = "1"
    return rest


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_console() -> bool:
    """Silence the listed lines in this process (and its children) unless verbose; whether it did."""
    if is_verbose():
        return False
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for category, message, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    # libraries imported already (Lightning imports transformers) read those switches at import: tell them directly
    for module, switch in (("huggingface_hub.utils", "disable_progress_bars"),
                           ("transformers.utils.logging", "disable_progress_bar"), ("datasets", "disable_progress_bars")):
        if module in sys.modules:
            getattr(sys.modules[module], switch)()
    return True
