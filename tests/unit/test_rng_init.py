"""Random initialisation of sharded tensors draws what one eager process draws: whole-tensor fills, and row chunks of
large tensors that give the same numbers as drawing them whole."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_fsdp._torch_compat import intercept_dispatch
from lightning_fsdp.sharding import seeded_init
from lightning_fsdp.sharding.seeded_init import _row_chunks, _whole_tensor_draws
from tests.helpers.launch import one_rank_gloo_mesh

FILLS = {
    "uniform_": (-0.5, 0.5), "normal_": (0.1, 2.0), "bernoulli_": (0.3,), "random_": (0, 100), "exponential_": (1.5,),
    "cauchy_": (0.0, 1.0), "log_normal_": (1.0, 0.5), "geometric_": (0.3,),
}
#: numel % 16 != 0, rows of 1 element, a tail below 16 elements, fewer than 16 elements in all, a row of > 16
SHAPES = [(257, 48), (3001, 37), (1000, 5), (999, 1), (7, 2), (33, 3, 7)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _filled(op, shape, dtype, args, seed=3):
    """``op`` drawn into a whole tensor, and the next draw of the stream after it."""
    torch.manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    getattr(t, op)(*args)
    return t, torch.rand(4)


def _chunked(op, shape, dtype, args, budget, seed=3):
    """The same, drawn chunk after chunk of rows as :func:`_row_chunks` cuts them for ``budget`` bytes."""
    torch.manual_seed(seed)
    parts = []
    for a, b in _row_chunks(shape[0], math.prod(shape[1:]), torch.empty((), dtype=dtype).element_size(), budget):
        chunk = torch.empty((b - a, *shape[1:]), dtype=dtype)
        getattr(chunk, op)(*args)
        parts.append(chunk)
    return torch.cat(parts), torch.rand(4)


@pytest.mark.parametrize(
    "rows,row_elements,budget",
    [(257, 48, 1000), (3001, 37, 4096), (1000, 5, 64), (999, 1, 10), (7, 2, 1), (5, 3, 1), (100, 16, 10**9)],
)
def test_row_chunks_are_multiples_of_16_elements_and_none_below_16(rows, row_elements, budget):
    bounds = _row_chunks(rows, row_elements, 4, budget)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    for a, b in bounds[:-1]:
        assert (b - a) * row_elements % 16 == 0
    if len(bounds) > 1:
        assert all((b - a) * row_elements >= 16 for a, b in bounds)


@pytest.mark.parametrize("op", list(FILLS))
def test_row_chunks_draw_what_the_whole_tensor_draws(op):
    """CPU kernels draw element after element; ``normal_`` works in blocks of 16 (with a recomputed ragged tail and a
    scalar path below 16 elements), which chunks of a multiple of 16 elements, none below 16, keep."""
    for dtype in DTYPES:
        if op == "random_" and dtype in (torch.bfloat16, torch.float16):
            continue  # 100 is beyond their exact integer range (torch warns); nothing chunk-specific
        for shape in SHAPES:
            row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
            whole, after_whole = _filled(op, shape, dtype, FILLS[op])
            for budget in (1, 7 * row_bytes, shape[0] * row_bytes // 3):
                chunked, after_chunked = _chunked(op, shape, dtype, FILLS[op], budget)
                assert torch.equal(whole, chunked), (op, dtype, shape, budget)
                assert torch.equal(after_whole, after_chunked), (op, dtype, shape, budget)


def test_chunks_that_break_the_16_element_rule_would_change_normal_values():
    """Why the rule exists: chunks of 5 or 24 elements draw other normal numbers than the whole tensor."""
    whole, _ = _filled("normal_", (96, 5), torch.float32, (0.0, 1.0))
    for rows in (1, 3):
        torch.manual_seed(3)
        parts = [torch.empty((rows, 5)).normal_(0.0, 1.0) for _ in range(96 // rows)]
        assert not torch.equal(whole, torch.cat(parts))


def test_large_tensors_chunk_exactly():
    """Sizes where kernels could take other paths (vectorised, parallel): 4096 x 4096 and 49152 x 576 in chunks."""
    for shape in [(4096, 4096), (49152, 576)]:
        for op in ("normal_", "uniform_", "bernoulli_"):
            whole, after = _filled(op, shape, torch.float32, FILLS[op])
            chunked, after_chunked = _chunked(op, shape, torch.float32, FILLS[op], 16 * 2**20)
            assert torch.equal(whole, chunked) and torch.equal(after, after_chunked), (op, shape)
            del whole, chunked


# -- DTensors on a 1-rank gloo mesh -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh():
    with one_rank_gloo_mesh() as one_rank:
        yield one_rank


def _sharded_empty(shape, mesh, dtype=torch.float32):
    return distribute_tensor(torch.empty(shape, dtype=dtype), mesh, [Shard(0)])


INITS = {
    "uniform_": lambda t, g: nn.init.uniform_(t, -0.1, 0.2, generator=g),
    "normal_": lambda t, g: nn.init.normal_(t, 0.0, 0.02, generator=g),
    "trunc_normal_": lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g),
    "trunc_normal_rejection": lambda t, g: nn.init.trunc_normal_(t, mean=0.0, std=1.0, a=0.5, b=1.0, generator=g),
    "kaiming_uniform_": lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g),
    "kaiming_normal_": lambda t, g: nn.init.kaiming_normal_(t, generator=g),
    "xavier_uniform_": lambda t, g: nn.init.xavier_uniform_(t, generator=g),
    "xavier_normal_": lambda t, g: nn.init.xavier_normal_(t, generator=g),
    "bernoulli_": lambda t, g: t.bernoulli_(0.3, generator=g),
    "random_": lambda t, g: t.random_(0, 50, generator=g),
    "exponential_": lambda t, g: t.exponential_(2.0, generator=g),
    "cauchy_": lambda t, g: t.cauchy_(generator=g),
    "log_normal_": lambda t, g: t.log_normal_(generator=g),
    "geometric_": lambda t, g: t.geometric_(0.4, generator=g),
    "rand_like": lambda t, g: t.copy_(torch.rand_like(t)),
    "randn_like": lambda t, g: t.copy_(torch.randn_like(t)),
    "randint_like": lambda t, g: t.copy_(torch.randint_like(t, 3, 9)),
}


@pytest.mark.parametrize("generator", [False, True], ids=["global", "generator"])
@pytest.mark.parametrize("budget", [None, 64], ids=["whole", "chunked"])
@pytest.mark.parametrize("init", list(INITS))
def test_dtensor_fills_draw_what_one_eager_process_draws(mesh, init, budget, generator, monkeypatch):
    if budget is not None:
        monkeypatch.setattr(seeded_init, "RANDOM_FILL_CHUNK_BYTES", budget)
    shape = (37, 19)

    def run(t):
        torch.manual_seed(5)
        g = torch.Generator().manual_seed(11) if generator else None
        with torch.no_grad():
            INITS[init](t, g)
        return torch.rand(4), (g.get_state() if g is not None else None)

    eager = torch.empty(shape)
    eager_after, eager_g = run(eager)
    sharded = _sharded_empty(shape, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DTensor "random operators may not have complete support" any more
        with intercept_dispatch(_whole_tensor_draws):
            sharded_after, sharded_g = run(sharded)
    assert torch.equal(sharded.full_tensor(), eager), init
    assert torch.equal(sharded_after, eager_after)
    if generator:
        assert torch.equal(sharded_g, eager_g)


def test_plain_tensors_pass_through(mesh):
    torch.manual_seed(1)
    expected = torch.empty(10, 3).normal_()
    torch.manual_seed(1)
    with intercept_dispatch(_whole_tensor_draws):
        got = torch.empty(10, 3).normal_()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("sharded_probs", [False, True], ids=["plain_p", "dtensor_p"])
def test_a_fill_that_cannot_be_chunked_is_drawn_whole_with_a_warning(mesh, monkeypatch, sharded_probs):
    """``bernoulli_`` with a tensor of probabilities: drawn whole, named with its size, still eager's numbers."""
    monkeypatch.setattr(seeded_init, "RANDOM_FILL_CHUNK_BYTES", 64)
    monkeypatch.setattr(seeded_init, "RANDOM_FILL_WARN_BYTES", 64)
    probs = torch.linspace(0, 1, 37 * 19).reshape(37, 19)
    torch.manual_seed(2)
    eager = torch.empty(37, 19).bernoulli_(probs)
    sharded = _sharded_empty((37, 19), mesh)
    p = distribute_tensor(probs, mesh, [Shard(0)]) if sharded_probs else probs
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match=r"\(37, 19\) torch.float32 tensor"):
        with torch.no_grad(), intercept_dispatch(_whole_tensor_draws):
            sharded.bernoulli_(p)
    assert torch.equal(sharded.full_tensor(), eager)


def test_a_meta_model_sharded_on_one_rank_equals_eager(mesh, monkeypatch):
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.sharding import materialize_meta_module, parameters_on_meta

    monkeypatch.setattr(seeded_init, "RANDOM_FILL_CHUNK_BYTES", 256)  # chunk every weight

    def build():
        return nn.Sequential(
            nn.Linear(8, 33), nn.Embedding(17, 8, padding_idx=3), nn.MultiheadAttention(16, 2),
            nn.Conv1d(3, 5, 3), nn.LayerNorm(8),
        )

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with parameters_on_meta():
        meta = build()
    for layer in meta:
        fully_shard(layer, mesh=mesh)
    fully_shard(meta, mesh=mesh)
    before = torch.random.get_rng_state()
    materialize_meta_module(meta, torch.device("cpu"), mesh)
    assert torch.equal(torch.random.get_rng_state(), before)  # forked: the stream continues as before
    expected = eager.state_dict()
    for name, value in meta.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


@pytest.mark.parametrize("case", ["hsdp", "shard_dim1", "scalar", "column_view"])
def test_other_layouts_draw_what_one_eager_process_draws(mesh, case, monkeypatch):
    """A 2-D (replicate, shard) mesh, a dim-1 split and a scalar (cut with ``distribute_tensor``), and a
    non-contiguous view (drawn whole with its strides: CPU ``normal_`` takes another path there)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    monkeypatch.setattr(seeded_init, "RANDOM_FILL_CHUNK_BYTES", 64)
    shape = () if case == "scalar" else (37, 19)
    torch.manual_seed(4)
    eager = torch.empty(shape)
    (eager[:, :5] if case == "column_view" else eager).normal_(0.0, 2.0)
    placements = {"hsdp": [Replicate(), Shard(0)], "shard_dim1": [Shard(1)], "scalar": [Replicate()]}.get(case, [Shard(0)])
    on = init_device_mesh("cpu", (1, 1)) if case == "hsdp" else mesh
    sharded = distribute_tensor(torch.zeros(shape), on, placements)
    torch.manual_seed(4)
    with torch.no_grad(), intercept_dispatch(_whole_tensor_draws):
        (sharded[:, :5] if case == "column_view" else sharded).normal_(0.0, 2.0)
    expected = eager[:, :5] if case == "column_view" else eager
    got = sharded.full_tensor()
    assert torch.equal(got[:, :5] if case == "column_view" else got, expected)
