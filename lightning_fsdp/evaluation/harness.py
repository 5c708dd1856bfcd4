"""An lm-eval ``LM`` over a sharded model, and the one call that scores tasks with it.

:class:`ShardedLM` is lm-eval's own Hugging Face backend (``HFLM``: its tokenization, its batching by length, its
scoring), handed the model FSDP2 sharded instead of loading one. What changes:

- every forward runs on the shards: inside the root module's forward (its hooks gather the root unit) with the
  other units gathered as ``rollout_mode`` says, once for a whole request type (``gather_once``) or unit by unit
  (``stream``: each rank then runs as many forwards as the others, which lm-eval's padding of requests and a
  batching that does not group by context ensure);
- the requests are split over the data-parallel ranks (lm-eval's evaluator splits and gathers them through this
  ``LM``'s ``rank``, ``all_gather`` and ``gather_object``, on ``torch.distributed``);
- ``generate_until`` decodes through the package's generation engine: every rank's requests are pooled, each
  ``gen_kwargs`` group is decoded with the work split evenly over the ranks, and each rank returns its own.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from torch import nn

from lightning_fsdp.generation import (
    Sampling,
    generate_on_ranks,
    in_root_forward,
    resolve_rollout_mode,
    rollout_gathering,
)
from lightning_fsdp.parallel import collectives

__all__ = ["TASKS_DIR", "ShardedLM", "check_offline", "check_task_folder", "check_tasks", "evaluate_tasks", "task_manager"]

#: the package's own tasks (lm-eval YAML over local rows): always on lm-eval's task path
TASKS_DIR = Path(__file__).with_name("tasks")
#: (tokenizer, vocabulary size, stop sequences) → the tokens whose text holds one of them
_STOP_TOKENS: dict[tuple[Any, ...], tuple[int, ...]] = {}


@contextmanager
def _lm_eval_quiet() -> Iterator[None]:
    """lm-eval's narration while this package drives it, unless the console is verbose: its log records (e.g. that
    a model instance ignores its loading arguments, which this one means to) and the progress bar each task draws
    while building its requests, on every rank."""
    from lm_eval import evaluator
    from lm_eval.api import task as task_module

    from lightning_fsdp.console import is_verbose

    if is_verbose():
        yield
        return
    logger = logging.getLogger("lm_eval")
    level, bar, git_hash = logger.level, task_module.tqdm, evaluator.get_git_commit_hash
    logger.setLevel(logging.ERROR)
    task_module.tqdm = functools.partial(bar, disable=True)
    evaluator.get_git_commit_hash = _quiet_git_hash  # its `git describe` prints "fatal: ..." outside a repository
    try:
        yield
    finally:
        logger.setLevel(level)
        task_module.tqdm = bar
        evaluator.get_git_commit_hash = git_hash


def _quiet_git_hash() -> Optional[str]:
    """The working directory's git commit, as lm-eval records it, or ``None`` outside a repository (silently)."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


class ShardedLM(HFLM):
    """lm-eval's Hugging Face backend over ``model``, sharded under the FSDP2 root ``root`` (see the module).

    Args:
        root: the module ``fully_shard`` was applied to last (a LightningModule, or the model itself).
        model: the Hugging Face causal LM (PEFT-wrapped or not) inside ``root``.
        tokenizer: its tokenizer.
        batch_size: requests per forward (and prompts decoded together).
        max_length: the longest context (default: the model's).
        rollout_mode: how the shards are gathered while evaluating (``auto``, ``gather_once``, ``stream``).
    """

    def __init__(self, root: nn.Module, model: nn.Module, tokenizer: Any, *, batch_size: int = 8,
                 max_length: Optional[int] = None, rollout_mode: str = "auto") -> None:
        with _lm_eval_quiet():
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=int(batch_size),
                             max_length=max_length, logits_cache=False)
        self.root = root
        device = next(root.parameters()).device
        self.rollout_mode = resolve_rollout_mode(rollout_mode, root, device)
        self._rank, self._world_size = collectives.rank(), collectives.world_size()

    # -- lm-eval's distribution hooks, on torch.distributed ------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather_stacked(tensor.reshape(-1)).reshape(-1)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        if not collectives.is_distributed():
            return [obj]
        out: Optional[list[Any]] = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        collectives.barrier(self.device)

    # -- the model's work, on the shards -------------------------------------------------------------------------------
    def on_shards(self, work: Any) -> Any:
        """``work()`` as the root's forward with the units gathered as ``rollout_mode`` says; nested calls (each
        request type inside a whole evaluation) share the outer gathering."""

        def gathered() -> Any:
            with rollout_gathering(self.root, self.rollout_mode):
                return work()

        return in_root_forward(self.root, gathered)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.on_shards(lambda: super(ShardedLM, self).loglikelihood(requests, disable_tqdm=True))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        return self.on_shards(lambda: super(ShardedLM, self).loglikelihood_rolling(requests, disable_tqdm=True))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        mine = [req.args for req in requests]
        everyone = collectives.all_gather_object(mine)
        pooled = [args for part in everyone for args in part]
        offset = sum(len(part) for part in everyone[: self.rank])
        answers = self._generate_pooled(pooled)
        return answers[offset: offset + len(mine)]

    def _generate_pooled(self, pooled: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
        """Every pooled request's answer (the same on every rank): each ``gen_kwargs`` group decoded at once, its
        contexts encoded and cut as lm-eval's backend does, each answer cut at its stop sequences."""
        groups: dict[str, list[int]] = {}
        for i, (_, kwargs) in enumerate(pooled):
            groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        answers = [""] * len(pooled)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(pooled[members[0]][1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            prompts = [self._context_ids(pooled[i][0], self.max_length - max_gen_toks) for i in members]
            # longest first, as lm-eval's backend batches: each batch pads little, and the ranks' shares balance
            order = sorted(range(len(members)), key=lambda k: -len(prompts[k]))
            members, prompts = [members[k] for k in order], [prompts[k] for k in order]
            stop_ids = self._stop_ids() + self._stop_sequence_tokens(tuple(until))
            done = generate_on_ranks(self.root, self.model, prompts, _sampling(kwargs, max_gen_toks, stop_ids),
                                     pad_id=self._pad_id(), mode=self.rollout_mode, batch_size=self.batch_size,
                                     device=self.device)
            for k, i in enumerate(members):
                text = self.tok_decode(done.text_ids(k))
                answers[i] = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
        return answers

    def _context_ids(self, context: str, max_context: int) -> list[int]:
        ids, mask = self.tok_batch_encode([context], left_truncate_len=max_context, truncation=self.truncation)
        return ids[0][mask[0].bool()].tolist()

    def _stop_ids(self) -> tuple[int, ...]:
        """Where decoding ends: the model's own end-of-sequence ids (its generation config), as ``generate`` stops,
        not the tokenizer's, which may differ; the stop sequences cut the text after."""
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

    def _stop_sequence_tokens(self, until: tuple[str, ...]) -> tuple[int, ...]:
        """The tokens whose text holds a stop sequence (``"\\n"``: every token with a line break): a row ends at the
        first, so decoding stops where lm-eval cuts the text anyway (the cut keeps the same prefix). Special tokens
        are left out: lm-eval's text drops them before it cuts."""
        key = (self.tokenizer.name_or_path, len(self.tokenizer), until)
        if key not in _STOP_TOKENS:  # a scan of the vocabulary, once per process
            special = set(self.tokenizer.all_special_ids)
            texts = token_texts(self.tokenizer)
            _STOP_TOKENS[key] = tuple(i for i, text in enumerate(texts)
                                      if i not in special and any(s and s in text for s in until))
        return _STOP_TOKENS[key]

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eot_token_id)


def token_texts(tokenizer: Any) -> list[str]:
    """Every token's text as ``tokenizer.decode([id])`` gives it: through the Rust tokenizer's batch decode when the
    tokenizer is a fast one (0.03 s for 49k tokens, against 0.42 s through ``batch_decode``'s per-row Python)."""
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.batch_decode(ids)
    texts = backend.decode_batch(ids, skip_special_tokens=False)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [tokenizer.clean_up_tokenization(text) for text in texts]
    return texts


def _sampling(kwargs: dict[str, Any], max_new_tokens: int, stop_ids: tuple[int, ...]) -> Sampling:
    """lm-eval's generation arguments as the engine's: greedy unless ``do_sample`` (then ``temperature``, ``top_k``,
    ``top_p``), stopping at ``stop_ids``."""
    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return Sampling(max_new_tokens, temperature=0.0, stop_ids=stop_ids)
    return Sampling(max_new_tokens, temperature=float(kwargs["temperature"]), top_k=int(kwargs.get("top_k") or 0),
                    top_p=float(kwargs.get("top_p") or 1.0), stop_ids=stop_ids)


def task_manager(include_path: Union[None, str, Path, Sequence[Union[str, Path]]] = None,
                 tasks: Sequence[str] = ()) -> Any:
    """lm-eval's task index with the package's own tasks and ``include_path`` (folders of task YAML) on it; lm-eval's
    built-in tasks too unless every one of ``tasks`` is local (indexing those takes seconds)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    if include_path:
        paths += [str(p) for p in ([include_path] if isinstance(include_path, (str, Path)) else include_path)]
    with _lm_eval_quiet():
        local = TaskManager(include_path=paths, include_defaults=False)
        if tasks and all(t in local.all_tasks for t in tasks):
            return local
        return TaskManager(include_path=paths)


def check_tasks(tasks: Sequence[str], manager: Any) -> None:
    """Every task known to ``manager`` (lm-eval's, the package's, ``--include_path``'s), else an error naming the
    unknown ones, close matches, and where tasks come from."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if not unknown:
        return
    hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
    said = "; ".join(f"{t!r}" + (f" (did you mean {', '.join(hints[t])}?)" if hints[t] else "") for t in unknown)
    raise ValueError(f"Unknown lm-eval task(s): {said}. Tasks are lm-eval's own, this package's ({TASKS_DIR.name}:"
                     " python_docs, python_docstring_choice), or YAML in a folder passed as --include_path.")


def _task_yaml(path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, Any]:
    """A task YAML as data, its ``include`` merged under it and its ``!function`` tags left as text (nothing is
    imported); a file that does not parse raises ValueError naming it."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, tag, node: f"!{tag} {getattr(node, 'value', '')}")
    try:
        config = yaml.load(path.read_text(), Loader=Loader)  # noqa: S506 (a SafeLoader that keeps tags as text)
    except (yaml.YAMLError, OSError) as error:
        raise ValueError(f"Task file {path} does not parse: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"Task file {path} holds {type(config).__name__}, not a task's settings.")
    included = config.pop("include", None)
    merged: dict[str, Any] = {}
    for name in ([included] if isinstance(included, str) else included or []):
        base = (path.parent / name).resolve()
        if base not in seen:
            merged.update(_task_yaml(base, seen | {path.resolve()}))
    return {**merged, **config}


def check_task_folder(folder: Union[str, Path]) -> None:
    """Every task file in ``folder`` (``--include_path``) parses, else a ValueError naming the file."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--include_path {folder}: no such folder of task YAML files.")
    for path in sorted(root.rglob("*.yaml")):
        _task_yaml(path)


#: dataset builders that read local files (``data_files``), not the Hub
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}


def _hub_reachable(timeout: float = 3.0) -> bool:
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _cached_on_disk(dataset: str) -> bool:
    """Whether datasets' or the Hub's cache already holds ``dataset``."""
    import datasets

    hub = Path(os.path.expanduser(os.environ.get("HF_HOME", "~/.cache/huggingface"))) / "hub"
    return ((Path(datasets.config.HF_DATASETS_CACHE) / dataset.replace("/", "___")).exists()
            or (hub / f"datasets--{dataset.replace('/', '--')}").exists())


def check_offline(tasks: Sequence[str], manager: Any) -> None:
    """A task whose dataset is on the Hugging Face Hub, neither cached nor reachable, is refused before any model
    loads (lm-eval would fail only once it builds the task)."""
    needed = []
    for name in tasks:
        entry = manager.task_index.get(name)
        yaml_path = getattr(entry, "yaml_path", None)
        if yaml_path is None:
            continue
        config = _task_yaml(Path(yaml_path))
        dataset = config.get("dataset_path")
        if (not dataset or config.get("custom_dataset") or dataset in _LOCAL_BUILDERS or Path(str(dataset)).exists()
                or _cached_on_disk(str(dataset))):
            continue
        needed.append(f"{name} ({dataset})")
    if needed and not _hub_reachable():
        raise ValueError(f"Task(s) {', '.join(needed)} read their data from the Hugging Face Hub, which is not"
                         " reachable from here, and it is not in the local cache: download it where there is a"
                         " network (it is cached for later), or use tasks over local files (--include_path).")


@contextmanager
def _random_state_kept() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's generators: training after an evaluation draws as if none ran."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def evaluate_tasks(root: nn.Module, model: nn.Module, tokenizer: Any, tasks: Sequence[str], *,
                   num_fewshot: Optional[int] = None, limit: Optional[Union[int, float]] = None,
                   apply_chat_template: bool = False, include_path: Any = None, batch_size: int = 8,
                   rollout_mode: str = "auto", bootstrap_iters: int = 0, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on the sharded model (every rank calls this); returns lm-eval's
    results dictionary on every rank (``results``, ``configs``, ``versions``, ... as lm-eval writes them)."""
    from lm_eval import simple_evaluate

    manager = task_manager(include_path, tasks)
    check_tasks(tasks, manager)
    check_offline(tasks, manager)
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--apply_chat_template: this model's tokenizer has no chat template; evaluate without it, or"
                         " use a model (or tokenizer) that has one.")
    lm = ShardedLM(root, model, tokenizer, batch_size=batch_size, rollout_mode=rollout_mode)
    with _random_state_kept(), _lm_eval_quiet():
        # one gathering for the whole evaluation: every request type (and each generation group) runs inside it
        results = lm.on_shards(lambda: simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, apply_chat_template=apply_chat_template,
            task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=log_samples, verbosity="ERROR"))
    return collectives.broadcast_object(results, src=0)
