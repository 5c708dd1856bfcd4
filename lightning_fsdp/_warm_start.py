"""Start the other local ranks of ``lightning-fsdp train`` while the first one is still importing.

Lightning's launcher starts ranks ``1..N-1`` when ``fit`` begins, by re-running the command; each then imports
torch, Lightning and transformers from scratch (~7 s on a CPU core) while rank 0 waits for them in the process group.
torchrun, by contrast, starts every rank at once. Here the ``lightning-fsdp train`` process, as the package is first
imported (before the heavy imports), starts ``devices - 1`` *warm* processes (``python -m lightning_fsdp.train``,
serving through :func:`wait_for_command`) that do those imports at the same time and then wait on a pipe. When
Lightning's launcher starts the local ranks, each command it would have run is handed to a warm process instead
(:func:`handing_over`): the process takes the launcher's environment and working directory and runs the command in
itself, as a new process would have. A command of another program is ``exec``-ed, exactly as ``Popen`` would.

Only for ``lightning-fsdp train`` started directly (not by torchrun/srun, not ``-m``), on one node, with an integer
``trainer.devices > 1`` and one of this package's strategies: anything else, or ``LIGHTNING_FSDP_WARM_START=0``,
launches as Lightning does. A warm process exits when its pipe closes without a command (the first rank ended, or
decided otherwise); unused ones are stopped at exit. This module imports only the standard library (and Hydra, to
read the devices), since it runs before anything else of the package.

Every process that runs one training job (any rank, warm or not) also imports with the cyclic garbage collector
off (:func:`pause_collection`), and freezes what it imported before the job begins (:func:`resume_collection`).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

from lightning_fsdp import console

#: ``0`` turns warm starting off
WARM_START_ENV = "LIGHTNING_FSDP_WARM_START"
#: set in a warm process (the value is its index), so that it never starts warm processes itself
WARM_RANK_ENV = "LIGHTNING_FSDP_WARM_RANK"
#: environment of a process that some launcher already started as a rank (or as one job of a multirun)
_LAUNCHED_ENV = ("LOCAL_RANK", "RANK", "LIGHTNING_FSDP_RANK_CONFIG", "LIGHTNING_FSDP_JOB_CONFIG", "NODE_RANK")

#: modules a rank imports between receiving its config and joining the process group (the model's configuration
#: and tokenizer are read when the LightningModule and DataModule are made); preloaded by warm processes
PRELOAD = ("transformers.tokenization_utils_fast", "transformers.models.auto.configuration_auto",
           "transformers.models.auto.tokenization_auto")

#: modules a Hugging Face job imports after joining the process group (its data sets, then its model classes):
#: imported by the first rank while the handed-over ranks start up, and by warm processes while they wait, so that
#: neither imports them on the way to the first step
PRELOAD_HF = ("datasets", "transformers.modeling_utils")

_warm: list[subprocess.Popen] = []
#: how many local ranks were handed to warm processes (for the job summary)
handed_over = 0


def train_overrides(argv: Sequence[str], orig_argv: Sequence[str] = ()) -> Optional[list[str]]:
    """The overrides of a ``lightning-fsdp train ...`` (or ``python -m lightning_fsdp train ...``) command line, or
    ``None`` for any other program or subcommand. While ``python -m`` imports the package, ``argv`` is ``["-m"]``
    and the command is read from ``orig_argv`` (the interpreter's own arguments)."""
    if not argv:
        return None
    if argv[0] == "-m":
        words = list(orig_argv)
        at = words.index("-m") if "-m" in words else -1
        if at < 0 or words[at + 1:at + 2] not in (["lightning_fsdp"], ["lightning_fsdp.__main__"]):
            return None
        rest = words[at + 2:]
    elif os.path.basename(argv[0]) == "lightning-fsdp" or argv[0].endswith(os.path.join("lightning_fsdp", "__main__.py")):
        rest = list(argv[1:])
    else:
        return None
    return rest[1:] if rest[:1] == ["train"] else None


def warm_rank_count(
    argv: Sequence[str], env: Mapping[str, str], compose: Any = None, orig_argv: Sequence[str] = ()
) -> int:
    """How many warm processes this command should start (0: none). ``compose(overrides)`` returns the job's
    unresolved config (default: Hydra's compose of the package's configs)."""
    overrides = train_overrides(argv, orig_argv)
    if overrides is None or env.get(WARM_START_ENV, "1") == "0" or WARM_RANK_ENV in env:
        return 0
    if any(k in env for k in _LAUNCHED_ENV) or int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return 0
    if any(a.startswith("-") for a in overrides):  # -m, --help, --cfg ...: not one plain job
        return 0
    try:
        cfg = (compose or _compose)(overrides)
        devices, nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
        target = str(cfg.strategy.get("_target_", "")) if cfg.get("strategy") else ""
    except Exception:  # an override Hydra rejects: `hydra.main` reports it in a moment
        return 0
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2 or nodes != 1:
        return 0
    return devices - 1 if target.startswith("lightning_fsdp.") else 0


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    if not os.path.isdir(config_dir):  # a source checkout: the configs live at the top level
        config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def runs_one_training_job(argv: Sequence[str], orig_argv: Sequence[str] = ()) -> bool:
    """Whether this process runs one ``lightning-fsdp train`` job (on any rank, warm or not): the command with
    plain overrides (not ``-m``, ``--help``), or ``python -m lightning_fsdp.train`` (a warm process, one job of a
    multirun)."""
    overrides = train_overrides(argv, orig_argv)
    if overrides is not None:
        return not any(a.startswith("-") for a in overrides)
    words = list(orig_argv)
    at = words.index("-m") if "-m" in words else -1
    return at >= 0 and words[at + 1:at + 2] == ["lightning_fsdp.train"]


#: whether :func:`pause_collection` turned the cyclic garbage collector off (and :func:`resume_collection` has not)
_collection_paused = False


def pause_collection() -> None:
    """Turn the cyclic garbage collector off while a training job imports its libraries (until
    :func:`resume_collection`).

    Importing torch, Lightning and transformers creates objects by the million, few of them garbage, and the
    collector's full passes over them grow with them: on 2 CPU ranks of the SmolLM2-135M job they took 1.0-1.2 s
    of each rank's 6.5-7 s to its first step, and freed a few hundred objects each.
    """
    global _collection_paused
    if gc.isenabled():
        gc.disable()
        _collection_paused = True


def collection_paused() -> bool:
    """Whether :func:`pause_collection` holds the garbage collector off."""
    return _collection_paused


def resume_collection() -> bool:
    """Once the imports are done: freeze every object there is (the collector never scans them again: modules,
    classes, functions) and turn the collector back on, so it scans only what the job creates from here (the model,
    its data, each step). False when nothing was paused (the collector is left as it was found).

    Nothing is collected first: a full pass here takes 0.3-0.45 s. What the imports and the config left as cyclic
    garbage stays, once: about 40 thousand small objects (10 MB, no tensors) on the first rank of that job.
    """
    global _collection_paused
    if not _collection_paused:
        return False
    _collection_paused = False
    gc.freeze()
    gc.enable()
    return True


def begin_if_requested(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Start the warm processes this command wants (returns how many were started), and pause the garbage
    collector for the start-up of a training job."""
    argv = list(sys.argv if argv is None else argv)
    env = os.environ if env is None else env
    if runs_one_training_job(argv, getattr(sys, "orig_argv", ())):
        pause_collection()
    count = warm_rank_count(argv, env, orig_argv=getattr(sys, "orig_argv", ()))
    for index in range(count):
        child_env = {**env, WARM_RANK_ENV: str(index + 1)}
        if "--verbose" in argv:  # the warm process imports before it sees the command
            child_env[console.VERBOSE_ENV] = "1"
        _warm.append(subprocess.Popen([sys.executable, "-m", "lightning_fsdp.train"], stdin=subprocess.PIPE,
                                      env=child_env))
    if count:
        atexit.register(release)
    return count


def release() -> None:
    """Stop the warm processes no launcher used."""
    while _warm:
        proc = _warm.pop()
        try:
            proc.stdin.close() if proc.stdin else None
        except OSError:
            pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextmanager
def handing_over(count: int) -> Iterator[None]:
    """While Lightning's launcher starts ``count`` local ranks, hand each command to a warm process instead of a new
    one. Without exactly ``count`` live warm processes, they are released and the launcher starts its own."""
    global handed_over
    if len(_warm) != count or any(p.poll() is not None for p in _warm):
        release()
        yield
        return
    original: Any = subprocess.Popen

    def hand_over(command: Sequence[str], *args: Any, env: Optional[Mapping[str, str]] = None,
                  cwd: Optional[str] = None, **kwargs: Any) -> Any:
        if args or kwargs or not _warm:
            return original(command, *args, env=env, cwd=cwd, **kwargs)
        global handed_over
        proc = _warm.pop(0)
        message = {"command": list(command), "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd()}
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.close()
        proc.stdin = None  # as a launched process without a stdin pipe: `communicate`/`wait` leave it alone
        handed_over += 1
        return proc

    setattr(subprocess, "Popen", hand_over)  # Lightning's launcher calls `subprocess.Popen(...)`
    try:
        yield
    finally:
        setattr(subprocess, "Popen", original)
    if handed_over and "transformers" in sys.modules:  # a HF job: rank 0 waits for the others to join anyway
        _preload(PRELOAD_HF)


def _preload(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def wait_for_command() -> Optional[list[str]]:
    """In a warm process (``python -m lightning_fsdp.train`` with :data:`WARM_RANK_ENV` set, the package imported):
    preload, wait for the launcher's command, take its environment and directory, and return the ``lightning-fsdp``
    arguments to run here; a command of another program replaces this process (``exec``, as ``Popen`` would have
    run it); ``None`` when the pipe closed without a command."""
    console.quiet_console()  # before the imports: some libraries speak as they are imported
    _preload((*PRELOAD, *PRELOAD_HF))  # what a rank imports before and after joining, when installed
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return None  # the first rank ended, or launched its ranks another way
    message = json.loads(line)
    command, env, cwd = message["command"], message["env"], message["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    args = _package_command_args(command)
    if args is None:
        os.execve(command[0], command, env)  # what Popen would have run
    sys.argv = ["lightning-fsdp" if command[1] == "-m" else command[1], *args]
    return args


def _package_command_args(command: Sequence[str]) -> Optional[list[str]]:
    """The arguments of a ``lightning-fsdp`` command run by this interpreter (``python -m lightning_fsdp ...`` or
    ``python .../bin/lightning-fsdp ...``, as Lightning's launcher writes them), else ``None``."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) >= 3 and command[2] in ("lightning_fsdp", "lightning_fsdp.__main__"):
        return list(command[3:])
    if os.path.basename(command[1]) == "lightning-fsdp":
        return list(command[2:])
    return None
