"""Tokenize once, keep on disk: the prepared form of a fine-tuning data set, keyed by what it depends on.

The key covers the data files' bytes, the tokenizer (its vocabulary and merges, special tokens, chat template) and
every setting that changes a token (format, ``train_on``, ``seq_len``, ``long_samples``, the split, packing). One
process prepares it (Lightning's ``prepare_data``: local rank 0, with a progress bar) into a hidden folder that is
renamed into place when complete; every rank then memory-maps the Arrow files, so no rank holds a copy in RAM.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_fsdp.data.sft.encoding import RowEncoder, Status
from lightning_fsdp.data.sft.packing import first_fit_decreasing
from lightning_fsdp.cache import build_once
from lightning_fsdp.data.sft.source import content_digest, data_files, train_val_sources
from lightning_fsdp.formatting import format_count as count

log = logging.getLogger(__name__)

__all__ = ["PreparedSet", "Recipe", "describe", "prepare", "recipe_key", "tokenizer_identity"]

#: bump when the way rows become tokens changes, so old caches are not reused
ENCODING_VERSION = 2


@dataclass(frozen=True)
class Recipe:
    """Everything besides the tokenizer that decides the prepared tokens."""

    path: str
    val_path: Optional[str]
    val_fraction: float
    seed: int
    fmt: str
    train_on: str
    chat_template: Optional[str]
    seq_len: int
    long_samples: str
    packing: bool


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of what makes a tokenizer tokenize the way it does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        type(tokenizer).__name__,
        backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
        str(getattr(tokenizer, "chat_template", None)),
        str(getattr(tokenizer, "add_bos_token", None)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def recipe_key(recipe: Any, tokenizer: Any, version: int) -> str:
    """The cache key of a prepared set: the bytes of its files (``recipe.path`` and ``recipe.val_path``), every
    other field of the recipe (a dataclass), the tokenizer's identity and the encoding's ``version``."""
    files = data_files(recipe.path) + (data_files(recipe.val_path) if recipe.val_path else [])
    return content_digest(files, {"recipe": {**asdict(recipe), "path": None, "val_path": None},
                                  "tokenizer": tokenizer_identity(tokenizer), "version": version})


def cache_key(recipe: Recipe, tokenizer: Any) -> str:
    return recipe_key(recipe, tokenizer, ENCODING_VERSION)


@dataclass
class PreparedSet:
    """A prepared directory, opened: the tokenized splits (memory-mapped), packing plans and counts."""

    root: Path
    train: Any
    val: Any
    val_source: Any
    train_bins: Optional[list[list[int]]]
    val_bins: Optional[list[list[int]]]
    stats: dict[str, Any]

    @classmethod
    def open(cls, root: Path) -> PreparedSet:
        import datasets

        stats = json.loads((root / "stats.json").read_text())
        bins = {split: _read_bins(root / f"{split}_bins.npz") for split in ("train", "val")}
        def split(name: str) -> Any:
            path = root / name
            return datasets.load_from_disk(str(path)) if path.exists() else datasets.Dataset.from_dict({})

        return cls(root, split("train"), split("val"), split("val_source"), bins["train"], bins["val"], stats)


def describe(stats: dict[str, Any]) -> str:
    """The counts a user should see once: what was kept, truncated and dropped, per split."""
    lines = []
    for split in ("train", "val"):
        s = stats[split]
        rows = f", packed into {count(s['rows'])} rows" if s.get("rows") is not None else ""
        lines.append(f"{split}: {count(s['samples'])} samples ({describe_split(s)}), {count(s['tokens'])} tokens{rows}")
    return "; ".join(lines)


def prepare(recipe: Recipe, encoder: RowEncoder, cache_root: Path, num_proc: Optional[int] = None) -> Path:
    """The prepared directory for ``recipe`` under ``cache_root``, built here if it is not there yet."""
    root = cache_root / f"sft-{cache_key(recipe, encoder.tokenizer)}"
    if (root / "stats.json").exists():
        return root
    build_once(root, lambda out: _build(recipe, encoder, cache_root, out, num_proc), complete="stats.json")
    log.info("Prepared %s: %s", root, describe(json.loads((root / "stats.json").read_text())))
    return root


def _build(recipe: Recipe, encoder: RowEncoder, cache_root: Path, tmp: Path, num_proc: Optional[int]) -> None:
    import datasets

    train_source, val_source = train_val_sources(recipe, cache_root / "sources")
    stats: dict[str, Any] = {}
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "labels": datasets.Sequence(datasets.Value("int32")),
                                  "length": datasets.Value("int32"), "status": datasets.Value("int8")})
    for split, source in (("train", train_source), ("val", val_source)):
        tokenized = source.map(
            encoder.encode_batch, batched=True, remove_columns=source.column_names, num_proc=num_proc,
            desc=f"Tokenizing {split}", cache_file_name=str(tmp / f"{split}-all.arrow"), features=features,
            new_fingerprint=f"{tmp.name}-{split}-all",
        ) if len(source) else datasets.Dataset.from_dict({name: [] for name in features}, features=features)
        statuses = np.asarray(tokenized["status"], dtype=np.int64)
        kept = tokenized.select(np.flatnonzero(statuses <= Status.TRUNCATED).tolist())
        counts = np.bincount(statuses, minlength=len(Status.NAMES))
        stats[split] = {"samples": len(source), "tokens": int(np.asarray(kept["length"]).sum()) if len(kept) else 0,
                        **{name: int(counts[code]) for code, name in Status.NAMES.items()}}
        if split == "train" and len(kept) == 0:
            raise ValueError(f"No training sample is left after filtering: {describe_split(stats[split])}. "
                             + _empty_hint(recipe))
        if len(kept):  # datasets cannot read back an empty saved set; a missing split opens as empty
            kept.save_to_disk(str(tmp / split))
        if recipe.packing:
            bins = first_fit_decreasing(np.asarray(kept["length"]).tolist(), recipe.seq_len) if len(kept) else []
            _write_bins(tmp / f"{split}_bins.npz", bins)
            stats[split]["rows"] = len(bins)
    if len(val_source):
        val_source.save_to_disk(str(tmp / "val_source"))
    for leftover in tmp.glob("*-all.arrow"):
        leftover.unlink()
    (tmp / "stats.json").write_text(json.dumps({**stats, "recipe": asdict(recipe)}, indent=2))


def describe_split(s: dict[str, Any]) -> str:
    """``"12 kept, 1 truncated"``: the non-zero counts of one split."""
    return ", ".join(f"{count(s[name])} {name}" for name in Status.NAMES.values() if s.get(name)) or "none"


def _empty_hint(recipe: Recipe) -> str:
    if recipe.long_samples == "drop":
        return f"Raise seq_len={recipe.seq_len} or pass long_samples='truncate'."
    return (f"Check train_on={recipe.train_on!r} against the data (a conversation without an assistant turn has"
            " nothing to train) and format=.")


def _write_bins(path: Path, bins: Sequence[Sequence[int]]) -> None:
    sizes = np.asarray([len(b) for b in bins], dtype=np.int64)
    flat = np.asarray([i for b in bins for i in b], dtype=np.int64)
    with path.open("wb") as f:
        np.savez(f, sizes=sizes, flat=flat)


def _read_bins(path: Path) -> Optional[list[list[int]]]:
    if not path.exists():
        return None
    with np.load(path) as data:
        ends = np.cumsum(data["sizes"])
        flat = data["flat"].tolist()
    starts = np.concatenate([[0], ends[:-1]]).tolist() if len(ends) else []
    return [flat[s:e] for s, e in zip(starts, ends.tolist())]
