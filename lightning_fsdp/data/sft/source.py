"""Where a fine-tuning data set comes from: a file, a folder of files, or a ``datasets.save_to_disk`` directory,
read with Hugging Face ``datasets`` (memory-mapped Arrow), and a cache key over the files' content."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["BUILDERS", "column_names", "content_digest", "data_files", "load_source", "train_val_sources"]

#: file suffix → the ``datasets`` builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").exists() and (path / "state.json").exists()


def data_files(path: Union[str, Path]) -> list[Path]:
    """The files a ``path`` stands for, sorted; a clear error for a missing path, unknown suffixes or a mix."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Data path {str(path)!r} does not exist. Pass data.path= a .jsonl/.json/.parquet/.csv/.txt file, a folder"
            " of them, or a directory written by datasets' save_to_disk."
        )
    if _is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS)
    if not files:
        raise FileNotFoundError(f"No data files ({', '.join(BUILDERS)}) in {str(path)!r}.")
    suffixes = {BUILDERS.get(p.suffix) for p in files}
    if None in suffixes:
        raise ValueError(f"{str(files[0])!r}: unknown data file type; accepted: {', '.join(BUILDERS)}.")
    if len(suffixes) > 1:
        raise ValueError(f"{str(path)!r} mixes file types ({sorted(s for s in suffixes if s)}); keep one per folder.")
    return files


def load_source(path: Union[str, Path], cache_dir: Optional[Path] = None) -> Any:
    """The data set at ``path`` as a ``datasets.Dataset`` (Arrow on disk, memory-mapped)."""
    import datasets

    path = Path(path).expanduser()
    files = data_files(path)
    if _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    builder = BUILDERS[files[0].suffix]
    options: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    return datasets.load_dataset(
        builder, data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir) if cache_dir else None,
        **options,
    )


def column_names(path: Union[str, Path]) -> list[str]:
    """The columns of the first file, read cheaply (one record or the schema), to check a format before any work."""
    path = Path(path).expanduser()
    first = data_files(path)[0]
    if _is_saved_dataset(path):
        info = json.loads((path / "dataset_info.json").read_text())
        return sorted(info.get("features", {}))
    kind = BUILDERS[first.suffix]
    if kind == "text":
        return ["text"]
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    if kind == "csv":
        import csv

        with first.open(newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    with first.open(encoding="utf-8") as f:
        head = f.read(1 << 20).lstrip()
    if head.startswith("["):  # a JSON array of records
        records = json.loads(first.read_text(encoding="utf-8"))
        return sorted(records[0]) if records else []
    line = head.splitlines()[0] if head else "{}"
    return sorted(json.loads(line))


def content_digest(files: Sequence[Path], extra: Any) -> str:
    """A key over the files' bytes and ``extra`` (JSON-able settings): the same content gives the same key
    wherever the files are."""
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for f in files:
        digest.update(f.name.encode())
        with f.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:20]


def train_val_sources(recipe: Any, sources_cache: Path) -> tuple[Any, Any]:
    """(train, val) sources of any recipe with ``path``, ``val_path``, ``val_fraction`` and ``seed`` (SFT rows,
    preference pairs, prompts): ``val_path`` when given, else a seeded ``val_fraction`` of ``path``."""
    source = load_source(recipe.path, sources_cache)
    if recipe.val_path:
        return source, load_source(recipe.val_path, sources_cache)
    if recipe.val_fraction <= 0:
        return source, source.select([])
    split = source.train_test_split(test_size=recipe.val_fraction, seed=recipe.seed, shuffle=True)
    return split["train"], split["test"]
