"""Ring attention against the unsplit attention, on real gloo process groups (``test_context_parallel.py``).

``python ring_attention.py WORLD OUT``: WORLD processes form one context-parallel group; every rank builds the same
random inputs, attends its layout's part through the ring, and compares its outputs and its part of the input
gradients with ``F.scaled_dot_product_attention`` of the whole sequence (fp32, torch's default tolerances). Cases:
both kernels, grouped queries, packed rows whose documents cross chunk and rank boundaries. Rank 0 writes OUT.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402


B, H, S, D = 2, 4, 48, 8


def reference(q, k, v, docs):
    """The whole sequence's causal attention (documents kept apart), with its input gradients."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    return out.detach(), grad, q.grad, k.grad, v.grad


def case(rank: int, world: int, kernel: str, kv_heads: int, packed: bool) -> dict:
    # imported in the ranks only: the launching process never needs the package
    from lightning_fsdp.parallel.ring import ring_attention
    from lightning_fsdp.parallel.sequence import SequenceLayout, SequenceSplit, document_ids

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, S, D, generator=gen) for _ in range(2))
    docs = None
    if packed:  # documents of 5, 17, 9 and 17 tokens in row 0; one long and short ones in row 1
        positions = torch.cat([torch.arange(n) for n in (5, 17, 9, 17)])[None].expand(B, S).clone()
        positions[1] = torch.cat([torch.arange(n) for n in (31, 1, 16)])
        docs = document_ids(positions)
    out, grad, dq, dk, dv = reference(q, k, v, docs)
    layout = SequenceLayout(world, rank)
    split = SequenceSplit(None, layout, layout.split(docs) if docs is not None else None)
    lq, lk, lv = (layout.split(t, dim=2).requires_grad_() for t in (q, k, v))
    mine = ring_attention(lq, lk, lv, split, kernel=kernel)
    mine.backward(layout.split(grad, dim=2))
    torch.testing.assert_close(mine, layout.split(out, dim=2))
    for name, got, want in (("dq", lq.grad, dq), ("dk", lk.grad, dk), ("dv", lv.grad, dv)):
        torch.testing.assert_close(got, layout.split(want, dim=2), msg=lambda m, n=name: f"{n}: {m}")
    return {"kernel": kernel, "kv_heads": kv_heads, "packed": packed, "max_err": (mine - layout.split(out, dim=2)).abs().max().item()}


def main(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = []
    for kernel in ("flash", "math"):
        for kv_heads, packed in ((H, False), (H // 2, False), (H // 2, True)):
            results.append(case(rank, world, kernel, kv_heads, packed))
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(main, args=(world, f"file://{os.path.join(folder, 'rendezvous')}", out), nprocs=world,
                           start_method="spawn")
