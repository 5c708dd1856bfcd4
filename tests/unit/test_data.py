"""The example data: a byte-level corpus present on every machine, and generated shape images."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.data import ShapesDataModule, TextCorpusDataModule
from lightning_fsdp.data.shapes import SHAPES, SyntheticShapes
from lightning_fsdp.data.text import (
    VOCAB_SIZE,
    TokenWindows,
    build_corpus,
    decode,
    encode,
    generated_corpus,
    stdlib_docstrings,
)
from lightning_fsdp.data.shapes import render_shape


def test_encode_decode_round_trip_bytes():
    text = "Return the value — naïve ∑ 🙂"
    ids = encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < VOCAB_SIZE
    assert decode(ids) == text
    assert decode(ids[:-1]).endswith("\ufffd")  # cut mid-character: replaced, not raised


def test_stdlib_docstrings_are_deterministic_and_capped():
    a = stdlib_docstrings(100_000)
    b = stdlib_docstrings(100_000)
    assert a == b
    assert 90_000 < len(a.encode("utf-8")) <= 100_000
    assert "Return" in a  # real English docstrings, not code


def test_build_corpus_falls_back_to_generated_without_sources(tmp_path):
    assert stdlib_docstrings(10_000, tmp_path) == ""
    with pytest.warns(UserWarning, match="generated corpus"):
        text = build_corpus("stdlib", 5_000, stdlib_dir=tmp_path)
    assert text == generated_corpus(5_000)
    with pytest.raises(ValueError, match="Unknown corpus"):
        build_corpus("wikipedia", 10)  # type: ignore[arg-type]


def test_generated_corpus_is_reproducible():
    assert generated_corpus(3_000, seed=1) == generated_corpus(3_000, seed=1) != generated_corpus(3_000, seed=2)
    assert len(generated_corpus(3_000)) == 3_000


def test_token_windows_are_next_token_pairs():
    tokens = torch.arange(23)
    ds = TokenWindows(tokens, seq_len=5)
    assert len(ds) == 4
    x, y = ds[3]
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(ValueError, match="too few"):
        TokenWindows(torch.arange(5), seq_len=5)


def test_text_datamodule_caches_the_corpus_and_splits_head_and_tail(tmp_path):
    dm = TextCorpusDataModule(corpus="generated", seq_len=32, batch_size=4, max_bytes=20_000, cache_dir=tmp_path)
    dm.prepare_data()
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [dm.cache_file.name]  # no temporary file left behind
    assert files[0].read_text() == generated_corpus(20_000)
    dm.setup("fit")
    assert len(dm.train_set) == (18_000 - 1) // 32 and len(dm.val_set) == (2_000 - 1) // 32
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(dm.val_set.tokens, encode(generated_corpus(20_000))[18_000:])
    assert dm.decode(dm.encode("ok")) == "ok"


def test_text_datamodule_in_memory_and_argument_checks():
    dm = TextCorpusDataModule(corpus="generated", seq_len=8, max_bytes=2_000)
    dm.setup()
    assert dm.cache_file is None and len(dm.train_set) > 0
    with pytest.raises(ValueError, match="val_fraction"):
        TextCorpusDataModule(val_fraction=1.5)


@pytest.mark.parametrize("kind", SHAPES)
def test_render_shape_draws_inside_the_image(kind):
    mask = render_shape(kind, 32, 16.0, 16.0, 6.0)
    assert mask.shape == (32, 32) and mask.sum() > 20
    assert mask[0].sum() == 0 and mask[:, 0].sum() == 0  # nothing at the border
    with pytest.raises(ValueError, match="Unknown shape"):
        render_shape("hexagon", 32, 16.0, 16.0, 6.0)


def test_shapes_are_deterministic_balanced_and_distinct():
    ds = SyntheticShapes(8, image_size=24, noise=0.1, seed=5)
    x0, y0 = ds[0]
    assert x0.shape == (1, 24, 24) and y0.item() == 0
    assert torch.equal(ds[3][0], SyntheticShapes(8, image_size=24, noise=0.1, seed=5)[3][0])
    assert not torch.equal(ds[3][0], SyntheticShapes(8, image_size=24, noise=0.1, seed=6)[3][0])
    assert [ds[i][1].item() for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(IndexError):
        ds[8]


def test_shapes_datamodule_loaders():
    dm = ShapesDataModule(num_train=64, num_val=16, batch_size=8)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 32, 32) and y.shape == (8,)
    assert len(dm.val_dataloader()) == 2
    assert dm.val_set.seed != dm.train_set.seed
