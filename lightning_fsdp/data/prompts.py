"""``PromptDataModule``: prompts for online RL (GRPO), in TRL's prompt-only formats, from the user's own files.

Each row has a ``prompt``: a string, or a conversation (a list of ``role``/``content`` messages, run through the
model's chat template with the generation prompt, as TRL does). Every other column (``answer``, ``tests``, ...) is
kept as it is and handed to the reward functions by name. Prompts are tokenized once into the package's cache
(keyed by the files' bytes, the tokenizer and every setting) and memory-mapped; a prompt longer than
``max_prompt_length`` is an error naming how many there are and the longest, before any process starts
(``long_prompts="drop"`` leaves them out instead).

Training batches come in *rollout windows* (:class:`RolloutLoader`): one optimizer step's prompts (``batch_size``
per rank × ``accumulate_grad_batches``, in the global order of :mod:`~lightning_fsdp.data.order`), handed to the
model with every micro-batch, so it can sample every completion of the step at once (as TRL generates one
generation batch per step) and train on them part by part; with ``num_iterations`` > 1 the same window comes back
for that many steps. The loader's state counts whole windows, so a checkpoint resumes at the next one at any world
size whose window divides the prompts consumed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fsdp.cache import cache_root
from lightning_fsdp.data.order import GlobalOrderSampler, data_parallel_rank
from lightning_fsdp.data.prepared_splits import PreparedSplits, SplitKind, SplitSources
from lightning_fsdp.data.sft.module import check_model_fits, load_tokenizer
from lightning_fsdp.data.sft.source import column_names

log = logging.getLogger(__name__)

__all__ = ["LONG_PROMPTS", "PromptDataModule", "PromptEncoder", "PromptRows", "RolloutLoader", "is_conversation"]

#: what happens to a prompt longer than ``max_prompt_length``
LONG_PROMPTS = ("error", "drop")
#: bump when the way prompts become tokens changes
PROMPT_ENCODING_VERSION = 1
KEPT, TOO_LONG = 0, 1


def is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


@dataclass(frozen=True)
class PromptRecipe(SplitSources):
    max_prompt_length: int
    long_prompts: str
    chat_template: Optional[str]


@dataclass
class PromptEncoder:
    """One row → its prompt's token ids, its other columns (JSON) and whether it fits; picklable."""

    tokenizer: Any
    max_prompt_length: int
    chat_template: Optional[str] = None

    def prompt_ids(self, prompt: Any) -> list[int]:
        if is_conversation(prompt):
            encoded = self.tokenizer.apply_chat_template([dict(m) for m in prompt], tokenize=True,
                                                         add_generation_prompt=True, return_dict=True,
                                                         chat_template=self.chat_template)
            return list(encoded["input_ids"])
        return list(self.tokenizer(str(prompt))["input_ids"])

    def encode(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """One row: its prompt's ids, their length, whether it is kept, and the whole row (as JSON) for the rewards."""
        ids = self.prompt_ids(row["prompt"])
        status = KEPT if 0 < len(ids) <= self.max_prompt_length else TOO_LONG
        return {"prompt_ids": ids, "length": len(ids), "status": status, "row": json.dumps(dict(row), default=str)}


def _judge_prompts(recipe: PromptRecipe, split: str, data: Any, encoded: Any) -> tuple[dict[str, Any], list[int]]:
    statuses = np.asarray(encoded["status"], dtype=np.int64)
    lengths = np.asarray(encoded["length"], dtype=np.int64)
    too_long = int((statuses == TOO_LONG).sum())
    stats = {"prompts": len(data), "kept": len(data) - too_long, "too_long": too_long, "longest": int(lengths.max())}
    if too_long and recipe.long_prompts == "error":
        raise ValueError(
            f"{too_long} of {len(data)} {split} prompts are longer than max_prompt_length="
            f"{recipe.max_prompt_length} tokens (the longest: {int(lengths.max())}), or empty. Raise"
            " data.max_prompt_length (the model must hold prompt + max_completion_length tokens), shorten them,"
            " or leave them out with data.long_prompts=drop."
        )
    keep = np.flatnonzero(statuses == KEPT).tolist()
    if split == "train" and not keep:
        raise ValueError(f"No training prompt fits max_prompt_length={recipe.max_prompt_length}.")
    return stats, keep


#: tokenized prompts per split and their counts
PROMPTS = SplitKind("prompts", PROMPT_ENCODING_VERSION, {"prompts": 0, "kept": 0, "too_long": 0, "longest": 0},
                    _judge_prompts)


class PromptRows(Dataset):
    """Tokenized prompts: row ``i`` is ``{"index", "prompt_ids", "prompt", "columns"}`` (the other columns)."""

    def __init__(self, tokenized: Any) -> None:
        self.tokenized = tokenized

    def __len__(self) -> int:
        return len(self.tokenized) if self.tokenized is not None else 0

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.tokenized[int(index)]
        row = json.loads(item["row"])
        prompt = row.pop("prompt")
        return {"index": int(index), "prompt_ids": list(item["prompt_ids"]), "prompt": prompt, "columns": row}


class RolloutLoader(DataLoader):
    """This rank's prompts, one rollout window at a time (see the module's docstring).

    Each item is a micro-batch ``{"window": [rows of the whole window], "part": j, "parts": k, "iteration": i,
    "window_id": (epoch, w)}``; rows are this rank's ``batch_size`` prompts of each of the window's ``k`` rounds, in
    order (part ``j`` trains on the completions of the ``j``-th). ``state_dict`` is the position in whole windows.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, accumulate: int = 1, iterations: int = 1,
                 num_replicas: int = 1, rank: int = 0, seed: int = 0) -> None:
        sampler = GlobalOrderSampler(len(dataset), batch_size, num_replicas, rank, shuffle=True, seed=seed)  # type: ignore[arg-type]
        super().__init__(dataset, batch_size=None, sampler=sampler)
        self.global_sampler, self.accumulate, self.iterations = sampler, int(accumulate), int(iterations)
        self._windows_done = 0
        self._resume: Optional[tuple[int, int]] = None

    @property
    def window_samples(self) -> int:
        """Prompts per window over every rank."""
        return self.global_sampler.round_size * self.accumulate

    @property
    def windows(self) -> int:
        return self.global_sampler.dataset_len // self.window_samples

    def __len__(self) -> int:
        return self.windows * self.accumulate * self.iterations

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.global_sampler
        start = 0
        if self._resume is not None and self._resume[0] == sampler.epoch:
            if self._resume[1] % self.window_samples:
                raise ValueError(
                    f"The checkpoint's data position is {self._resume[1]} prompts into epoch {sampler.epoch}, not a"
                    f" whole number of this run's rollout windows (ranks × batch_size × accumulate_grad_batches ="
                    f" {self.window_samples}). Resume with a window that divides it."
                )
            start = self._resume[1] // self.window_samples
        self._resume = None
        order = sampler.order()
        rounds = sampler.round_size
        for w in range(start, self.windows):
            self._windows_done = w
            positions = [(w * self.accumulate + j) * rounds + sampler.rank * sampler.batch_size + b
                         for j in range(self.accumulate) for b in range(sampler.batch_size)]
            rows = [self.dataset[order[p]] for p in positions]
            for position, row in zip(positions, rows):
                row["position"] = sampler.epoch * sampler.dataset_len + position  # the prompt's place in the run
            for i in range(self.iterations):
                for j in range(self.accumulate):
                    if i == self.iterations - 1 and j == self.accumulate - 1:
                        self._windows_done = w + 1  # counted as the window's last micro-batch leaves
                    yield {"window": rows, "part": j, "parts": self.accumulate, "iteration": i,
                           "window_id": (sampler.epoch, w)}
        self._windows_done = 0

    def state_dict(self) -> dict[str, Any]:
        sampler = self.global_sampler
        return {"epoch": sampler.epoch, "samples_consumed": self._windows_done * self.window_samples,
                "num_samples": sampler.dataset_len, "seed": sampler.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.global_sampler
        if int(state["num_samples"]) != sampler.dataset_len:
            raise ValueError(f"The checkpoint's prompts were {state['num_samples']} rows, this run has"
                             f" {sampler.dataset_len}: the data changed since it was saved. Resume with the same data.")
        self._resume = (int(state["epoch"]), int(state["samples_consumed"]))
        sampler.seed = int(state.get("seed", sampler.seed))
        sampler.set_epoch(int(state["epoch"]))


class PromptDataModule(PreparedSplits):
    """Prompts (and the columns their rewards need) from a file, folder or saved data set.

    Args:
        path: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a folder of one kind, or a ``save_to_disk`` set, with
            a ``prompt`` column (a string or a message list).
        tokenizer: a model or tokenizer directory, or a ``.gguf`` model file.
        val_path: held-out prompts; else ``val_fraction`` of ``path`` (seeded).
        max_prompt_length: the longest prompt in tokens; ``long_prompts`` says what happens to a longer one.
        batch_size: prompts per rank per micro-batch (each is completed ``num_generations`` times).
        chat_template: a Jinja chat template for tokenizers without one (or to override theirs).
        seed: shuffling seed (epoch ``e`` uses ``seed + e``) and the validation split's.
        cache_dir: where prepared sets are kept (default ``$LIGHTNING_FSDP_CACHE/prompts``).
    """

    kind = PROMPTS

    def __init__(
        self,
        path: Union[str, Path],
        tokenizer: Union[str, Path],
        val_path: Optional[Union[str, Path]] = None,
        val_fraction: float = 0.05,
        max_prompt_length: int = 512,
        long_prompts: str = "error",
        batch_size: int = 1,
        chat_template: Optional[str] = None,
        seed: int = 0,
        cache_dir: Optional[Union[str, Path]] = None,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
    ) -> None:
        super().__init__()
        if long_prompts not in LONG_PROMPTS:
            raise ValueError(f"long_prompts={long_prompts!r} is not one of {LONG_PROMPTS}.")
        if max_prompt_length < 1 or batch_size < 1 or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"max_prompt_length ≥ 1, batch_size ≥ 1 and 0 ≤ val_fraction < 1 are needed; got"
                             f" {max_prompt_length}, {batch_size}, {val_fraction}.")
        for source in [path] + ([val_path] if val_path else []):
            if "prompt" not in column_names(source):
                raise ValueError(f"{source}: no 'prompt' column (found {column_names(source)}). GRPO data has TRL's"
                                 " prompt-only format: a 'prompt' string or message list, plus any columns the"
                                 " rewards read.")
        from lightning_fsdp.hf.gguf import resolve_model_source

        tokenizer = resolve_model_source(tokenizer)
        self.tokenizer = load_tokenizer(tokenizer)
        check_model_fits(Path(tokenizer), self.tokenizer, int(max_prompt_length), "max_prompt_length")
        self.recipe = PromptRecipe(str(Path(path).expanduser().resolve()),
                                   str(Path(val_path).expanduser().resolve()) if val_path else None,
                                   float(val_fraction), int(seed), int(max_prompt_length), long_prompts, chat_template)
        self.encoder = PromptEncoder(self.tokenizer, int(max_prompt_length), chat_template)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.batch_size, self.seed, self.num_workers, self.num_proc = batch_size, int(seed), num_workers, num_proc
        self.max_prompt_length = int(max_prompt_length)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root("prompts")

    @override
    def rows(self, tokenized: Any) -> PromptRows:
        return PromptRows(tokenized)

    @override
    def describe(self, stats: dict[str, Any]) -> Optional[str]:
        train = stats["train"]
        if not train["too_long"]:
            return None
        return (f"Prompts: {train['too_long']} of {train['prompts']} training prompts longer than"
                f" max_prompt_length={self.max_prompt_length} were left out")

    def train_dataloader(self) -> DataLoader:
        """Rollout windows of this rank's prompts; the window is one optimizer step's (``accumulate_grad_batches``
        micro-batches), repeated for the module's ``num_iterations`` steps."""
        assert self.train_set is not None, "call setup() first"
        replicas, rank = data_parallel_rank(self.trainer)
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1)) if self.trainer is not None else 1
        module = self.trainer.lightning_module if self.trainer is not None else None
        iterations = int(getattr(module, "num_iterations", 1) or 1)
        return RolloutLoader(self.train_set, self.batch_size, accumulate=accumulate, iterations=iterations,
                             num_replicas=replicas, rank=rank, seed=self.seed)

    def val_dataloader(self) -> DataLoader:
        """Held-out prompts, each once, as plain rows (scored by :class:`~lightning_fsdp.callbacks.HeldOutRewards`)."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, collate_fn=list)

    def held_out_rows(self, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """The first ``limit`` held-out prompts as rows (all of them by default)."""
        if self.stats is None:
            self.setup()
        rows = self.val_set
        assert isinstance(rows, PromptRows)
        count = len(rows) if limit is None else min(limit, len(rows))
        return [rows[i] for i in range(count)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
