"""Data for the example jobs; nothing is downloaded.

- :class:`TextCorpusDataModule`: byte-level LM text from the docstrings of Python's own standard library.
- :class:`ShapesDataModule`: generated images of four shapes, for the CNN.
"""

from lightning_fsdp.data.shapes import SHAPES, ShapesDataModule, SyntheticShapes
from lightning_fsdp.data.text import (
    VOCAB_SIZE,
    TextCorpusDataModule,
    TokenWindows,
    build_corpus,
    decode,
    encode,
    generated_corpus,
    stdlib_docstrings,
)

__all__ = [
    "SHAPES",
    "VOCAB_SIZE",
    "ShapesDataModule",
    "SyntheticShapes",
    "TextCorpusDataModule",
    "TokenWindows",
    "build_corpus",
    "decode",
    "encode",
    "generated_corpus",
    "stdlib_docstrings",
]
