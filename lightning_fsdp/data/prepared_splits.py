"""Data tokenized once into a prepared directory, then opened on every rank: what preference pairs and GRPO prompts
share (SFT rows add packing on top, in :mod:`lightning_fsdp.data.sft.prepared`).

:func:`encode_splits` tokenizes the train and val sources of a recipe (the SFT sets' split), keeps the rows a
data kind accepts, and writes each split and ``stats.json`` into the folder :func:`~lightning_fsdp.cache.build_once`
renames into place. :class:`PreparedSplits` is the DataModule half: ``prepare_data`` builds it on one process per
node, ``setup`` opens it on every rank.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from torch.utils.data import Dataset

from lightning_fsdp.cache import build_once
from lightning_fsdp.data._loaders import SplitDataModule
from lightning_fsdp.data.sft.prepared import recipe_key
from lightning_fsdp.data.sft.source import train_val_sources

__all__ = ["PreparedSplits", "SplitKind", "SplitSources", "encode_rows", "encode_splits", "prepare_splits"]

#: ``judge(split, source rows, encoded rows) -> (the split's stats, indices of the encoded rows to keep)``; it raises
#: to refuse the data
Judge = Callable[[str, Any, Any], tuple[dict[str, Any], Sequence[int]]]


def encode_rows(batch: Mapping[str, list[Any]], encode: Callable[[dict[str, Any]], Mapping[str, Any]]) -> dict[str, list[Any]]:
    """A batch of columns (``datasets.map(batched=True)``) encoded row by row with ``encode(row) -> fields``, back as
    columns."""
    out: dict[str, list[Any]] = {}
    for i in range(len(next(iter(batch.values())))):
        for key, value in encode({k: v[i] for k, v in batch.items()}).items():
            out.setdefault(key, []).append(value)
    return out


@dataclass(frozen=True)
class SplitSources:
    """Where a recipe's rows come from: ``path``, and ``val_path`` or a seeded ``val_fraction`` of it held out
    (the recipes of each data kind add their own fields)."""

    path: str
    val_path: Optional[str]
    val_fraction: float
    seed: int


@dataclass(frozen=True)
class SplitKind:
    """One kind of prepared data: ``noun`` (what a row is: the cache folder's prefix and the progress line's word),
    the ``version`` of its encoding (bump it when rows become tokens differently), the stats of an ``empty`` split,
    and its ``judge(recipe, split, source rows, encoded rows) -> (stats, indices to keep)``, which raises to refuse."""

    noun: str
    version: int
    empty: Mapping[str, Any]
    judge: Callable[[Any, str, Any, Any], tuple[dict[str, Any], Sequence[int]]]


def prepare_splits(kind: SplitKind, recipe: Any, encoder: Any, cache_root: Path, num_proc: Optional[int]) -> Path:
    """The prepared directory of ``recipe`` under ``cache_root`` (named ``<noun>-<key>``: the recipe, the tokenizer and
    the encoding version), tokenized row by row by ``encoder.encode`` once."""

    def build(out: Path) -> None:
        encode_splits(recipe, functools.partial(encode_rows, encode=encoder.encode), cache_root / "sources", out,
                      num_proc, kind.noun, dict(kind.empty),
                      functools.partial(kind.judge, recipe))

    key = recipe_key(recipe, encoder.tokenizer, kind.version)
    return build_once(cache_root / f"{kind.noun}-{key}", build, complete="stats.json")


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
    """A :class:`SplitDataModule` over a prepared directory: subclasses say what kind of data it is (``kind``, with
    ``recipe``, ``encoder``, ``cache_dir`` and ``num_proc``), what a split's rows are (:meth:`rows`) and what to tell
    the user (:meth:`describe`)."""

    kind: SplitKind
    recipe: Any
    encoder: Any
    cache_dir: Path
    num_proc: Optional[int]

    def __init__(self) -> None:
        super().__init__()
        self.stats: Optional[dict[str, Any]] = None
        self.prepared_dir: Optional[Path] = None
        self._root: Optional[Path] = None

    def prepare_root(self) -> Path:
        """The prepared directory, built if missing (every rank may call it; one builds, the others find it)."""
        return prepare_splits(self.kind, self.recipe, self.encoder, self.cache_dir, self.num_proc)

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
