"""Random initialisation of sharded tensors that does not depend on the world size.

**Random values do not depend on the world size.** Drawn shard by shard, a sharded tensor's values would depend on
how it is split (on CPU every shard would even draw the same numbers; DTensor's CUDA generator slices one stream
its own way), so a model, and a LoRA fine-tune's losses, would change with the number of ranks. While initialisers
run, every random fill of a DTensor (``uniform_``, ``normal_``, ``bernoulli_``, ``random_``, ``exponential_``,
``cauchy_``, ``log_normal_``, ``geometric_``, and ``rand_like``/``randn_like``/``randint_like``: all
``torch.nn.init`` draws) is instead drawn for the whole tensor, with the same arguments and generator, and each rank
keeps its own rows. Every rank so consumes the random stream as one eager process does: a meta-device model equals an
eager one built with the same seed at any world size, as far as eager construction draws what these initialisers
draw, in their order. It does for torch's layers (not the ``nn.Transformer*`` stacks, which deep-copy a layer);
transformers' ``from_config`` and PEFT's adapters also draw torch's default init of each layer in ``__init__`` before
overwriting it, numbers a meta-device construction never draws. A tensor over :data:`RANDOM_FILL_CHUNK_BYTES` is
drawn in row chunks where that gives the same numbers (CPU: chunks of a multiple of 16 elements, none below 16,
because ``normal_`` transforms blocks of 16), else whole (a warning above :data:`RANDOM_FILL_WARN_BYTES`). Each rank
thus spends the time one process spends drawing the whole model. Every rank draws from the first rank's random state,
in a forked generator: the random stream after initialisation is the one before it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_fsdp._torch_compat import intercept_dispatch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["RANDOM_FILL_CHUNK_BYTES", "RANDOM_FILL_WARN_BYTES", "seeded_draws"]

#: a random fill of a sharded tensor larger than this (bytes) is drawn in row chunks of about this size where chunks
#: give the whole tensor's numbers (CPU): a 49152 x 576 fp32 matrix then takes 18 MiB instead of 110 MiB, and less time
RANDOM_FILL_CHUNK_BYTES = 16 * 2**20
#: a random fill that has to be drawn whole (on CUDA, or a kind chunks would change) warns above this many bytes
RANDOM_FILL_WARN_BYTES = 256 * 2**20


@contextmanager
def seeded_draws(mesh: Optional[DeviceMesh], device: torch.device) -> Iterator[None]:
    """While initialisers run: every rank draws from the first rank's random stream, and every random fill of a
    DTensor is drawn whole, each rank keeping its rows."""
    with _one_stream(mesh, device), intercept_dispatch(_whole_tensor_draws):
        yield


@contextmanager
def _one_stream(mesh: Optional[DeviceMesh], device: torch.device) -> Iterator[None]:
    """Every rank draws from the first rank's random state (one broadcast per mesh dimension), so a rank seeded
    otherwise (``seed + rank``) draws the same whole tensors and HSDP replicas stay equal; in forked generators (CPU
    and ``device``'s): the random stream after initialisation is the one before it. Nothing without a mesh."""
    if mesh is None:
        yield
        return
    accelerator = None if device.type == "cpu" else getattr(torch, device.type)
    index = None if accelerator is None else (accelerator.current_device() if device.index is None else device.index)
    devices, device_type = ([], "cuda") if accelerator is None else ([index], device.type)
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.random.set_rng_state(_from_first_rank(mesh, torch.random.get_rng_state(), device))
        if accelerator is not None:
            accelerator.set_rng_state(_from_first_rank(mesh, accelerator.get_rng_state(index), device), index)
        yield


def _from_first_rank(mesh: DeviceMesh, state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``state`` of the rank at the mesh's origin, on every rank of the mesh (a CPU tensor)."""
    import torch.distributed as dist

    buffer = state.to(device)
    for dim in range(mesh.ndim):  # along each dimension from coordinate 0: the origin's state reaches every rank
        group = mesh.get_group(dim)
        dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
    return buffer.cpu()


_aten = torch.ops.aten
#: in-place random fills: ``torch.nn.init`` draws through these
_RANDOM_FILLS = frozenset({
    _aten.uniform_, _aten.normal_, _aten.bernoulli_, _aten.random_, _aten.exponential_, _aten.cauchy_,
    _aten.log_normal_, _aten.geometric_,
})
#: ``x_like(t, ...)`` is ``empty_like(t)`` filled by (ATen's own definition): ``randint_like``'s bounds are its arguments
_RANDOM_LIKES: dict[Any, tuple[Any, tuple[Any, ...]]] = {
    _aten.rand_like: (_aten.uniform_.default, (0.0, 1.0)),
    _aten.randn_like: (_aten.normal_.default, (0.0, 1.0)),
    _aten.randint_like: (getattr(_aten.random_, "from"), ()),
}


def _whole_tensor_draws(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The dispatch handler of initialisation: a random fill of a DTensor is drawn for the whole tensor and each rank
    keeps its part; every other op (and every plain tensor) runs as usual (``NotImplemented``)."""
    from torch.distributed.tensor import DTensor

    packet = op.overloadpacket
    if not args or not isinstance(args[0], DTensor) or "out" in kwargs:
        return NotImplemented
    if packet in _RANDOM_FILLS:
        _draw_whole(op, args[0], args[1:], kwargs)
        return args[0]
    if packet not in _RANDOM_LIKES:
        return NotImplemented
    fill, bounds = _RANDOM_LIKES[packet]
    if packet is _aten.randint_like:  # (high) or (low, high)
        bounds = tuple(int(b) for b in args[1:]) if len(args) == 3 else (0, int(args[1]))
    out = _aten.empty_like.default(args[0], **{k: v for k, v in kwargs.items() if k != "generator"})
    _draw_whole(fill, out, bounds, {k: v for k, v in kwargs.items() if k == "generator" and v is not None})
    return out


def _draw_whole(op: Any, target: DTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``op(whole, *args, **kwargs)`` on a plain tensor of ``target``'s global shape, strides and dtype on the local
    shard's device, then this rank's part of it copied into ``target``'s local shard; in row chunks where exact."""
    from lightning_fsdp.parallel.mesh import local_shard

    local = local_shard(target)
    args, kwargs = tuple(_whole(a) for a in args), {k: _whole(v) for k, v in kwargs.items()}
    if target.numel() == 0:
        return  # nothing is drawn for an empty tensor
    rows = _dim0_rows(target)
    nbytes = target.numel() * target.element_size()
    if nbytes > RANDOM_FILL_CHUNK_BYTES and rows is not None and _chunks_exactly(target, args, kwargs):
        _draw_in_chunks(op, target, local, rows, args, kwargs)
        return
    if nbytes > RANDOM_FILL_WARN_BYTES:
        warnings.warn(
            f"Initialising a sharded {tuple(target.shape)} {target.dtype} tensor ({nbytes / 2**20:.0f} MiB): every"
            f" rank draws it whole ({op} on {local.device}), as one process would, and keeps its own part; drawn in"
            " row chunks it would get other numbers.",
            stacklevel=2,
        )
    whole = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device=local.device)
    op(whole, *args, **kwargs)
    if rows is not None:
        local.copy_(whole[rows[0] : rows[1]])
    else:  # a scalar, or split otherwise: each rank cuts its part from its own copy, with no communication
        from torch.distributed.tensor import distribute_tensor

        local.copy_(distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local())


def _draw_in_chunks(
    op: Any, target: DTensor, local: torch.Tensor, rows: tuple[int, int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Draw ``target`` chunk after chunk of rows (:func:`_row_chunks`) as :func:`_draw_whole` draws it at once,
    keeping the rows ``[start, stop)`` of ``rows``: the memory of one chunk."""
    start, stop = rows
    bounds = _row_chunks(target.shape[0], math.prod(target.shape[1:]), target.element_size(), RANDOM_FILL_CHUNK_BYTES)
    buffer = torch.empty((max(b - a for a, b in bounds), *target.shape[1:]), dtype=target.dtype, device=local.device)
    for a, b in bounds:
        chunk = buffer[: b - a]
        op(chunk, *args, **kwargs)
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            local[lo - start : hi - start].copy_(chunk[lo - a : hi - a])


def _row_chunks(rows: int, row_elements: int, element_size: int, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges covering ``rows``: each of about ``budget`` bytes, a multiple of 16 elements,
    and none below 16 elements (a short tail joins the chunk before it)."""
    step = 16 // math.gcd(row_elements, 16)  # rows per 16-element multiple
    per_chunk = max(step, budget // max(row_elements * element_size, 1) // step * step)
    bounds: list[tuple[int, int]] = []
    while not bounds or bounds[-1][1] < rows:
        a = bounds[-1][1] if bounds else 0
        b = min(a + per_chunk, rows)
        bounds.append((a, rows if (rows - b) * row_elements < 16 else b))
    return bounds


def _chunks_exactly(target: DTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether row chunks draw the whole tensor's numbers: CPU kernels draw element after element (``normal_``
    transforms each block of 16 uniforms, recomputing the last 16 of a ragged tail, and draws tensors below 16
    elements one by one), so chunks of a multiple of 16 elements, none below 16, are exact on a contiguous tensor
    (checked in ``tests/unit/test_rng_init.py``). CUDA kernels spread one draw over a grid sized by the element
    count: there a tensor is drawn whole. So is a fill with tensor arguments (``bernoulli_(p)``)."""
    return (
        target.to_local().device.type == "cpu"
        and target.ndim >= 1
        and target.is_contiguous()
        and not any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values()))
    )


def _dim0_rows(target: DTensor) -> Optional[tuple[int, int]]:
    """The rows of dim 0 this rank holds when ``target`` is split along dim 0 only (FSDP, HSDP) or replicated;
    ``None`` for a scalar or any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    from lightning_fsdp.parallel.mesh import local_rows

    if target.ndim == 0 or not all(isinstance(p, Replicate) or p == Shard(0) for p in target.placements):
        return None
    return local_rows(target)


def _whole(value: Any) -> Any:
    """An argument of a fill as one process would pass it: a DTensor's global values (e.g. ``bernoulli_``'s ``p``)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
