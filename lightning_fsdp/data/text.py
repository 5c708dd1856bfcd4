"""A byte-level language-modelling corpus that exists on every machine: the docstrings of Python's standard library.

The text is read from the standard library's own source files with :mod:`ast` (nothing is imported or downloaded),
in sorted file order, so the same Python version gives the same bytes everywhere. Where the sources are missing
(some minimal installs ship only bytecode) a generated corpus from a small fixed grammar is used instead.

Tokens are bytes (vocabulary 256), so no tokenizer is needed and any text can be encoded.
"""

from __future__ import annotations

import ast
import os
import random
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_fsdp.data._loaders import SplitDataModule

__all__ = [
    "VOCAB_SIZE",
    "TextCorpusDataModule",
    "TokenWindows",
    "build_corpus",
    "decode",
    "encode",
    "generated_corpus",
    "stdlib_docstrings",
]

VOCAB_SIZE = 256
CorpusName = Literal["stdlib", "generated"]
#: below this many bytes the standard-library corpus is considered unavailable
_MIN_STDLIB_BYTES = 50_000


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``long`` tensor of token ids."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: Union[Tensor, list[int]]) -> str:
    """Token ids back to text; invalid UTF-8 (a sample cut mid-character) is replaced, not raised."""
    values = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(v % VOCAB_SIZE for v in values).decode("utf-8", errors="replace")


def stdlib_docstrings(max_bytes: int, stdlib_dir: Optional[Path] = None) -> str:
    """Docstrings (module, class, function) of the top-level standard-library modules, in sorted file order.

    Stops once ``max_bytes`` of UTF-8 text are collected. Files that do not parse are skipped.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
                    size += len(doc.encode("utf-8")) + 2
        if size >= max_bytes:
            break
    return "\n\n".join(parts).encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


_SUBJECTS = ["the parser", "a module", "this function", "the sharded model", "each rank", "the optimizer", "a tensor",
             "the loader", "the checkpoint", "every block", "the trainer", "a process group"]
_VERBS = ["returns", "reads", "writes", "gathers", "splits", "checks", "builds", "updates", "saves", "loads"]
_OBJECTS = ["a list of names", "the local shard", "one value per key", "the full state", "its parameters",
            "the next batch", "a new dictionary", "the mean loss", "every gradient", "the default group"]
_TAILS = ["", " when it is called", " before the step", " after the barrier", " if the path exists",
          " for every module", " in sorted order"]


def generated_corpus(n_bytes: int, seed: int = 0) -> str:
    """Deterministic English-like sentences from a fixed grammar: learnable structure, no download."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
        sentence = sentence[0].upper() + sentence[1:] + ("\n" if rng.random() < 0.2 else " ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_bytes]


def build_corpus(name: CorpusName, max_bytes: int, stdlib_dir: Optional[Path] = None) -> str:
    """The named corpus, at most ``max_bytes`` long (``"stdlib"`` falls back to ``"generated"`` with a warning)."""
    if name == "generated":
        return generated_corpus(max_bytes)
    if name != "stdlib":
        raise ValueError(f"Unknown corpus {name!r}; choose 'stdlib' or 'generated'.")
    text = stdlib_docstrings(max_bytes, stdlib_dir)
    if len(text) < min(_MIN_STDLIB_BYTES, max_bytes):
        warnings.warn(
            f"Only {len(text)} bytes of standard-library docstrings found (sources not installed?);"
            " using the generated corpus instead.",
            stacklevel=2,
        )
        return generated_corpus(max_bytes)
    return text


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens → (input, next-token target) pairs."""

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for one window of seq_len={seq_len} (+1).")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextCorpusDataModule(SplitDataModule):
    """Byte-level LM data from :func:`build_corpus`, split into train (head) and validation (tail).

    Args:
        corpus: ``"stdlib"`` (standard-library docstrings) or ``"generated"``.
        seq_len: tokens per example (match the model's ``seq_len``).
        batch_size: examples per batch *per rank*.
        max_bytes: corpus size cap.
        val_fraction: share of the corpus (its tail) held out for validation.
        cache_dir: where the corpus is written once (by one process per node in ``prepare_data``) and read by every
            rank; ``None`` builds it in memory on each rank.
        num_workers: DataLoader workers.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        corpus: CorpusName = "stdlib",
        seq_len: int = 256,
        batch_size: int = 16,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        cache_dir: Optional[Union[str, Path]] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        if seq_len < 1 or batch_size < 1 or max_bytes < 1:
            raise ValueError(f"seq_len, batch_size and max_bytes must be positive, got {seq_len}, {batch_size}, {max_bytes}.")
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.max_bytes, self.val_fraction, self.num_workers = max_bytes, val_fraction, num_workers
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None

    @property
    def cache_file(self) -> Optional[Path]:
        if self.cache_dir is None:
            return None
        version = f"py{sys.version_info.major}{sys.version_info.minor}"
        return self.cache_dir / f"{self.corpus}-{version}-{self.max_bytes}.txt"

    def prepare_data(self) -> None:
        """Write the corpus file once per node (Lightning calls this on local rank 0 only, then waits)."""
        path = self.cache_file
        if path is None or path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(build_corpus(self.corpus, self.max_bytes), encoding="utf-8")
        os.replace(tmp, path)  # atomic: a reader never sees half a file

    def load_text(self) -> str:
        """The cached corpus, or (no cache, or a rank whose ``cache_dir`` differs from its node's) built in memory:
        only ``prepare_data`` writes files."""
        path = self.cache_file
        if path is None or not path.exists():
            return build_corpus(self.corpus, self.max_bytes)
        return path.read_text(encoding="utf-8")

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        tokens = encode(self.load_text())
        split = int(tokens.numel() * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.seq_len)
        self.val_set = TokenWindows(tokens[split:], self.seq_len)

    # the trained model's sample is printed through these
    encode = staticmethod(encode)
    decode = staticmethod(decode)
