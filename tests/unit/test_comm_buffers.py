"""The host communication buffer pool: a buffer is handed out again only when nothing holds it, at most a few of a
size are kept, device buffers are not its business, and only units of a repeated shape take part. (That training
with it equals an unsharded run, and that it is reused there, is asserted by the 2- and 4-rank parity runs.)"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from lightning_fsdp.sharding import HostBufferPool, reuse_host_comm_buffers
from tests.helpers.launch import one_rank_gloo_mesh

CPU = torch.device("cpu")


def test_an_idle_buffer_is_handed_out_again_in_any_shape_of_its_size():
    pool = HostBufferPool()
    first = pool.allocate((4, 8), torch.float32, CPU)
    address = first.data_ptr()
    del first
    again = pool.allocate((32,), torch.float32, CPU)
    assert again.data_ptr() == address and again.shape == (32,)
    assert (pool.allocated, pool.reused, pool.held_bytes) == (1, 1, 32 * 4)


def test_a_buffer_still_viewed_or_pending_is_not_handed_out():
    pool = HostBufferPool()
    first = pool.allocate((32,), torch.float32, CPU)
    view = first[8:]  # what a pending collective or a narrowed input holds
    address = first.data_ptr()
    del first
    second = pool.allocate((32,), torch.float32, CPU)
    assert second.data_ptr() != address
    second.fill_(1.0)
    view.fill_(2.0)
    assert bool((second == 1.0).all())  # writing one never touches the other
    held = {address, second.data_ptr()}
    del view, second
    assert pool.allocate((32,), torch.float32, CPU).data_ptr() in held and pool.allocated == 2


def test_sizes_and_dtypes_are_kept_apart_and_at_most_per_size_of_each():
    pool = HostBufferPool(per_size=2)
    busy = [pool.allocate((16,), torch.float32, CPU) for _ in range(3)]
    assert pool.allocated == 2 and pool.held_bytes == 2 * 16 * 4  # the third is allocated and freed as usual
    other = pool.allocate((16,), torch.bfloat16, CPU)
    assert pool.allocated == 3 and other.dtype == torch.bfloat16
    assert len({t.data_ptr() for t in busy}) == 3


def test_device_buffers_are_left_to_their_allocator():
    pool = HostBufferPool()
    meta = pool.allocate((8,), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and pool.held_bytes == 0 and pool.allocated == 0


@pytest.fixture(scope="module")
def mesh():
    with one_rank_gloo_mesh() as one_rank:
        yield one_rank


def test_only_units_of_a_repeated_shape_take_their_buffers_from_the_pool(mesh):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Embedding(50, 8), *(nn.Linear(8, 8) for _ in range(3)), nn.Linear(8, 5))
    units = [model[1], model[2], model[3], model[4]]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pool = reuse_host_comm_buffers([*units, model])
    assert pool is not None

    def comm(unit: nn.Module) -> str:
        [group] = unit._get_fsdp_state()._fsdp_param_groups
        return type(group._all_gather_comm).__name__ + "/" + type(group._reduce_scatter_comm).__name__

    assert [comm(u) for u in units[:3]] == ["PooledAllGather/PooledReduceScatter"] * 3
    assert comm(units[3]) == comm(model) == "DefaultAllGather/DefaultReduceScatter"  # one of a kind: FSDP's own
    model(torch.arange(4)).sum().backward()  # one rank: nothing gathered, and nothing of the gather's size pooled
    assert pool.held_bytes == 0
