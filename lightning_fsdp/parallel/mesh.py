"""The data-parallel mesh: sizes validated at the edge, with errors that show the arithmetic.

Plain functions of their arguments, so they are tested without a process group; only :func:`build_device_mesh`
needs one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

SizeArg = Union[int, Literal["auto"]]

REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"


def check_size(name: str, value: SizeArg) -> None:
    """A mesh size argument is a positive int, or ``-1``/``"auto"`` (inferred); anything else is a ``ValueError``."""
    if value == "auto" or value == -1:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, -1 or 'auto', got {value!r}.")


@dataclass(frozen=True)
class MeshShape:
    """The mesh ``replicate × shard × context``: ``replicate`` copies of the model, each sharded over
    ``shard × context`` ranks; each group of ``context`` consecutive ranks splits one batch along the sequence.

    ``replicate == 1`` is plain FSDP (a 1-D mesh); ``replicate > 1`` is HSDP (a 2-D mesh: gradients are
    reduce-scattered within a shard group and all-reduced across replicas). Context parallelism costs no parameter
    memory: its ranks hold different shards, as torchtitan shards over ``dp_shard × cp``.
    """

    replicate: int
    shard: int
    context: int = 1

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshShape.{name} must be a positive int, got {value!r}.")

    def __repr__(self) -> str:
        context = f", context={self.context}" if self.context > 1 else ""
        return f"MeshShape(replicate={self.replicate}, shard={self.shard}{context})"

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.context

    @property
    def shard_group(self) -> int:
        """Ranks one copy of the parameters is sharded over: ``shard × context``."""
        return self.shard * self.context

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches: ``replicate × shard``."""
        return self.replicate * self.shard

    @property
    def is_hybrid(self) -> bool:
        return self.replicate > 1

    @property
    def dim_names(self) -> tuple[str, ...]:
        return (REPLICATE_DIM, SHARD_DIM) if self.is_hybrid else (SHARD_DIM,)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The FSDP mesh's sizes (context ranks are part of the shard dimension)."""
        return (self.replicate, self.shard_group) if self.is_hybrid else (self.shard_group,)


def resolve_mesh_shape(
    replicate_size: SizeArg, shard_size: SizeArg, world_size: int, num_nodes: int = 1, context_parallel: int = 1
) -> MeshShape:
    """Turn the user's mesh sizes into concrete ones, or raise showing ``replicate × shard × context`` against the
    world size.

    ``"auto"`` (or ``-1``) for ``replicate_size`` means one replica per node (HSDP across nodes); for
    ``shard_size`` it means "whatever is left": ``world_size // (replicate × context_parallel)``.
    """
    check_size("replicate_size", replicate_size)
    check_size("shard_size", shard_size)
    check_context_parallel(context_parallel)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if world_size % context_parallel:
        raise ValueError(
            f"context_parallel={context_parallel} does not divide the world size {world_size}: each group of"
            f" {context_parallel} ranks splits one sequence. Choose a context_parallel from the divisors of {world_size}."
        )
    if context_parallel > 1:
        shape = resolve_mesh_shape(replicate_size, shard_size, world_size // context_parallel, num_nodes)
        return MeshShape(shape.replicate, shape.shard, context_parallel)
    replicate_auto = replicate_size in ("auto", -1)
    shard_auto = shard_size in ("auto", -1)
    replicate = max(num_nodes, 1) if replicate_auto else int(replicate_size)
    if shard_auto:
        if world_size % replicate != 0:
            raise ValueError(
                f"replicate_size={replicate} does not divide the world size {world_size}"
                f" ({num_nodes} node(s)); choose a replicate_size that divides {world_size},"
                " or set shard_size explicitly."
            )
        shard = world_size // replicate
    else:
        shard = int(shard_size)
        if replicate_auto and replicate * shard != world_size:
            if world_size % shard != 0:
                raise ValueError(
                    f"shard_size={shard} does not divide the world size {world_size};"
                    f" choose shard_size from the divisors of {world_size}."
                )
            replicate = world_size // shard
    if replicate * shard != world_size:
        raise ValueError(
            f"The data-parallel mesh does not fit the world: replicate_size × shard_size = {replicate} × {shard}"
            f" = {replicate * shard}, but WORLD_SIZE = {world_size} (num_nodes × devices)."
            " Make the product equal the number of processes, e.g. set shard_size='auto'."
        )
    return MeshShape(replicate=replicate, shard=shard)


def check_context_parallel(value: int) -> None:
    """``context_parallel`` is a positive int (1: every rank holds whole sequences)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`context_parallel` must be a positive int (1 turns it off), got {value!r}.")


def build_device_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """Create the mesh over the already-initialised default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.dim_names)


def data_parallel_rank(mesh: DeviceMesh, context: int = 1) -> int:
    """This rank's position among all data-parallel ranks (replica-major), for the DistributedSampler; the
    ``context`` consecutive ranks of a context-parallel group share one."""
    if mesh.ndim == 1:
        return mesh.get_local_rank() // context
    return (mesh.get_local_rank(REPLICATE_DIM) * mesh.size(1) + mesh.get_local_rank(SHARD_DIM)) // context


def context_group(shape: MeshShape, device_type: str) -> Optional[DeviceMesh]:
    """The 1-D mesh of this rank's context-parallel group (consecutive ranks), or ``None`` without context
    parallelism. Every rank calls it (each group is created on every rank)."""
    if shape.context == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.world_size // shape.context, shape.context), mesh_dim_names=("dp", "cp"))
    return mesh["cp"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, or the tensor itself (replicated, or no mesh)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 this rank's :func:`local_shard` of ``tensor`` holds.

    FSDP2 shards dim 0 as ``torch.chunk`` does (the first ranks get ``ceil(rows / shards)`` rows, the last fewer or
    none); replicated mesh dims (HSDP) hold the same rows. Checked against the local shard's actual length."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    start, size = 0, tensor.shape[0]
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"Only dim-0 sharding has row ranges; this tensor is sharded as {tensor.placements}.")
            count, coordinate = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-size // count)
            begin = min(coordinate * chunk, size)
            start, size = start + begin, min(chunk, size - begin)
    if size != tensor.to_local().shape[0]:
        raise ValueError(f"Rows {start}..{start + size} do not match the local shard's {tensor.to_local().shape[0]} rows.")
    return start, start + size


def gather_over_shards(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Every shard's ``local`` (equal sizes on every rank of the shard group), concatenated in shard order: for
    per-row statistics, what the whole tensor's rows would give. ``like`` is the DTensor whose sharding says which
    ranks form the group; replicas (HSDP) compute the same result independently."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(like, DTensor):
        return local
    shard_dims = [d for d, p in enumerate(like.placements) if isinstance(p, Shard)]
    if len(shard_dims) > 1:
        raise ValueError(f"Only one sharded mesh dimension is supported here; the tensor is sharded as {like.placements}.")
    if not shard_dims or like.device_mesh.size(shard_dims[0]) == 1:
        return local
    group = like.device_mesh.get_group(shard_dims[0])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)
