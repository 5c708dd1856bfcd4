"""Data tokenized once into a prepared directory, then opened on every rank: what preference pairs and GRPO prompts
share (SFT rows add packing on top, in :mod:`lightning_fsdp.data.sft.prepared`).

:func:`encode_splits` tokenizes the train and val sources of a recipe (the SFT sets' split), keeps the rows a
data kind accepts, and writes each split and ``stats.json`` into the folder :func:`~lightning_fsdp.cache.build_once`
renames into place. :class:`PreparedSplits` is the DataModule half: ``prepare_data`` builds it on one process per
node, ``setup`` opens it on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from torch.utils.data import Dataset

from lightning_fsdp.cache import build_once
from lightning_fsdp.data._loaders import SplitDataModule
from lightning_fsdp.data.sft.prepared import recipe_key
from lightning_fsdp.data.sft.source import train_val_sources

__all__ = ["PreparedSplits", "SplitSources", "encode_splits", "prepare_splits"]

#: ``judge(split, source rows, encoded rows) -> (the split's stats, indices of the encoded rows to keep)``; it raises
#: to refuse the data
Judge = Callable[[str, Any, Any], tuple[dict[str, Any], Sequence[int]]]


@dataclass(frozen=True)
class SplitSources:
    """Where a recipe's rows come from: ``path``, and ``val_path`` or a seeded ``val_fraction`` of it held out
    (the recipes of each data kind add their own fields)."""

    path: str
    val_path: Optional[str]
    val_fraction: float
    seed: int


def prepare_splits(prefix: str, recipe: Any, tokenizer: Any, version: int, cache_root: Path,
                   build: Callable[[Path], None]) -> Path:
    """The prepared directory of ``recipe`` under ``cache_root`` (named ``prefix-<key>``: the recipe, the tokenizer
    and the encoding ``version``), built by ``build(folder)`` once."""
    return build_once(cache_root / f"{prefix}-{recipe_key(recipe, tokenizer, version)}", build, complete="stats.json")


def encode_splits(recipe: Any, encode_batch: Callable[[dict[str, list[Any]]], dict[str, list[Any]]], sources_root: Path,
                  out: Path, num_proc: Optional[int], noun: str, empty: dict[str, Any], judge: Judge) -> None:
    """Tokenize both splits of ``recipe`` with ``encode_batch`` into ``out`` (``noun``: what a row is, for the
    progress line; ``empty``: the stats of an empty split)."""
    stats: dict[str, Any] = {}
    for split, data in zip(("train", "val"), train_val_sources(recipe, sources_root)):
        if not len(data):
            stats[split] = dict(empty)
            continue
        encoded = data.map(encode_batch, batched=True, remove_columns=data.column_names, num_proc=num_proc,
                           desc=f"Tokenizing {split} {noun}")
        stats[split], keep = judge(split, data, encoded)
        kept = encoded.select(list(keep))
        if len(kept):
            kept.save_to_disk(str(out / split))
    (out / "stats.json").write_text(json.dumps({**stats, "recipe": asdict(recipe)}, indent=2))


class PreparedSplits(SplitDataModule):
    """A :class:`SplitDataModule` over a prepared directory: subclasses say how to build it (:meth:`prepare_root`),
    what a split's rows are (:meth:`rows`) and what to tell the user (:meth:`describe`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: Optional[dict[str, Any]] = None
        self.prepared_dir: Optional[Path] = None
        self._root: Optional[Path] = None

    def prepare_root(self) -> Path:
        """The prepared directory, built if missing (every rank may call it; one builds, the others find it)."""
        raise NotImplementedError

    def rows(self, tokenized: Any) -> Dataset:
        """A split's dataset over its tokenized rows (``None`` for a split with none)."""
        raise NotImplementedError

    def describe(self, stats: dict[str, Any]) -> Optional[str]:
        """A line printed once (rank 0) when the data is opened, or ``None``."""
        return None

    def prepare_data(self) -> None:
        """Tokenize once (Lightning calls this on one process per node; the others wait)."""
        self._root = self.prepare_root()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.stats is not None:
            return
        import datasets

        root = self._root or self.prepare_root()
        self.stats = json.loads((root / "stats.json").read_text())
        message = self.describe(self.stats)
        if message and (self.trainer is None or self.trainer.is_global_zero):
            print(message, flush=True)
        self.train_set, self.val_set = (
            self.rows(datasets.load_from_disk(str(root / name)) if (root / name).exists() else None)
            for name in ("train", "val")
        )
        self.prepared_dir = root
