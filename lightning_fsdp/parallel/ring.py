"""Ring attention: causal self-attention over a sequence whose chunks live on the ranks of a context-parallel group.

Each rank keeps its queries; the keys and values (and packed rows' document ids) travel once around the ring.
At every step a rank attends its two query chunks to the two key chunks it holds, as whole blocks (the key chunk
precedes the query chunk), causal blocks (the same chunk) or not at all (it follows), and merges the partial
results exactly through their log-sum-exp. The backward pass sends the keys and values around again, each with its
gradient accumulators, which arrive home after the last step. Nothing but the current and the arriving chunk is
held, so a rank's attention memory is that of ``S / cp`` tokens.

torch's own ``context_parallel`` shards only the CUDA attention kernels (on CPU it fails: the CPU flash-attention
operator has no sharding rule), so the ring is written here on ``torch.distributed`` point-to-point operations,
which gloo and NCCL both provide. Blocks run torch's CPU flash-attention kernels with their log-sum-exp where torch
has them (:func:`~lightning_fsdp._torch_compat.flash_attention_blocks`), else an exact math kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp._torch_compat import flash_attention_blocks
from lightning_fsdp.parallel.sequence import SequenceSplit, attended_across_ranks

__all__ = ["ring_attention"]


def ring_attention(query: Tensor, key: Tensor, value: Tensor, split: SequenceSplit, scale: Optional[float] = None,
                   kernel: str = "auto") -> Tensor:
    """Causal attention of this rank's ``query`` (B, H, L, d) to every rank's keys and values (B, H_kv, L, d), the
    tokens laid out by ``split.layout``; returns (B, H, L, d). ``H`` a multiple of ``H_kv`` (grouped queries).
    ``kernel``: ``"auto"`` (torch's CPU flash kernel on CPU, else math), ``"flash"`` or ``"math"``."""
    if query.shape[-2] % 2 or key.shape[-2] != query.shape[-2]:
        raise ValueError(f"Ring attention takes two equal chunks of queries and keys per rank; got {query.shape[-2]}"
                         f" queries and {key.shape[-2]} keys.")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads do not group over {key.shape[1]} key/value heads.")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    use_flash = kernel == "flash" or (kernel == "auto" and query.device.type == "cpu")
    blocks = flash_attention_blocks() if use_flash else None
    attended_across_ranks()
    return _RingAttention.apply(query, key, value, split, scale, blocks)


def _relation(query_chunk: int, key_chunk: int) -> Optional[bool]:
    """``False``: the key chunk precedes (every key visible); ``True``: the same chunk (causal); ``None``: it
    follows (nothing visible)."""
    return None if key_chunk > query_chunk else key_chunk == query_chunk


def _document_mask(q_docs: Optional[Tensor], k_docs: Optional[Tensor], causal: bool, length: int,
                   dtype: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The additive mask (B, 1, c, c) of a block of packed rows and its rows that see no key; ``(None, None)`` when
    the rows are single documents (the kernel's own causal flag then suffices)."""
    if q_docs is None or k_docs is None:
        return None, None
    visible = q_docs[:, None, :, None] == k_docs[:, None, None, :]
    if causal:
        visible = visible & torch.ones(length, length, dtype=torch.bool, device=visible.device).tril()
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return mask, ~visible.any(dim=-1)


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor]:
    scores = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return (probs @ v.float()).to(q.dtype), lse


def _math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   mask: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor, Tensor]:
    probs = torch.exp(_scores(q, k, causal, mask, scale) - lse[..., None]).nan_to_num(0.0)
    dout32 = dout.float()
    dv = probs.transpose(-1, -2) @ dout32
    delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)
    ds = probs * (dout32 @ v.float().transpose(-1, -2) - delta)
    return ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale, dv


def _scores(q: Tensor, k: Tensor, causal: bool, mask: Optional[Tensor], scale: float) -> Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores if mask is None else scores + mask.float()


class _Ring:
    """The neighbours of this rank in the context-parallel group, and one exchange step with them."""

    def __init__(self, split: SequenceSplit) -> None:
        self.size, self.rank = split.layout.size, split.layout.rank
        group = split.group if split.group is not None else dist.group.WORLD
        assert group is not None, "ring attention runs in an initialised process group"
        self.group = group
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], list[Any]]:
        """Send ``tensors`` to the next rank and receive the previous rank's into new buffers (asynchronously)."""
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _expand(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(dim=2)


def _visible_blocks(layout: Any, step: int, half: int, docs: Optional[Tensor], current: list[Tensor],
                    dtype: torch.dtype) -> Iterator[tuple[int, slice, slice, bool, Optional[Tensor], Optional[Tensor]]]:
    """The blocks of this ring step that see anything: ``(query chunk, its slice, the key slice, the kernel's causal
    flag, the additive document mask, the rows that see no key)``. At ``step`` the keys held came from the rank
    ``step`` places before this one; ``current[2]`` are their document ids when the rows are packed."""
    key_chunks = layout.of_rank((layout.rank - step) % layout.size).chunks
    k_docs = current[2] if docs is not None else None
    for qi, q_chunk in enumerate(layout.chunks):
        for ki, k_chunk in enumerate(key_chunks):
            causal = _relation(q_chunk, k_chunk)
            if causal is None:
                continue
            qs, ks = slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half)
            mask, blind = _document_mask(docs[:, qs] if docs is not None else None,
                                         k_docs[:, ks] if k_docs is not None else None, causal, half, dtype)
            yield qi, qs, ks, causal and mask is None, mask, blind


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, split: SequenceSplit, scale: float, blocks: Any) -> Tensor:
        ring, layout, groups = _Ring(split), split.layout, q.shape[1] // k.shape[1]
        half = q.shape[-2] // 2
        forward_block = blocks[0] if blocks is not None else _math_forward
        docs = split.documents
        outs = [torch.zeros(*q.shape[:-2], half, q.shape[-1], dtype=torch.float32, device=q.device) for _ in range(2)]
        lses = [torch.full((*q.shape[:-2], half), float("-inf"), device=q.device) for _ in range(2)]
        current = [k, v] + ([docs] if docs is not None else [])
        for step in range(ring.size):
            pending = ring.start(current) if step < ring.size - 1 else None
            kc, vc = _expand(current[0], groups), _expand(current[1], groups)
            for qi, qs, ks, causal, mask, blind in _visible_blocks(layout, step, half, docs, current, q.dtype):
                out, lse = forward_block(q[:, :, qs], kc[:, :, ks], vc[:, :, ks], causal, mask, scale)
                lse = lse.float() if blind is None else lse.float().masked_fill(blind, float("-inf"))
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], out, lse)
            if pending is not None:
                _wait(pending[1])
                current = pending[0]
        out, lse = torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse, *([docs] if docs is not None else []))
        ctx.split, ctx.scale, ctx.blocks = split, scale, blocks
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors
        docs = rest[0] if rest else None
        split, scale = ctx.split, ctx.scale
        backward_block = ctx.blocks[1] if ctx.blocks is not None else _math_backward
        ring, layout, groups = _Ring(split), split.layout, q.shape[1] // k.shape[1]
        half, dout = q.shape[-2] // 2, dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        current = [k, v] + ([docs] if docs is not None else [])
        grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for step in range(ring.size):
            pending = ring.start(current) if step < ring.size - 1 else None
            kc, vc = _expand(current[0], groups), _expand(current[1], groups)
            for _, qs, ks, causal, mask, _ in _visible_blocks(layout, step, half, docs, current, q.dtype):
                dq_b, dk_b, dv_b = backward_block(dout[:, :, qs], q[:, :, qs], kc[:, :, ks], vc[:, :, ks],
                                                  out[:, :, qs], lse[:, :, qs], causal, mask, scale)
                dq[:, :, qs] += dq_b.float()
                grads[0][:, :, ks] += _fold(dk_b.float(), groups)
                grads[1][:, :, ks] += _fold(dv_b.float(), groups)
            if pending is not None:
                _wait(pending[1])
                current = pending[0]
            if ring.size > 1:  # the accumulators travel with their keys; after the last step they are home
                grads, works = ring.start(grads)
                _wait(works)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmax-normalised partial results over disjoint keys, merged exactly by their log-sum-exps (a row that
    has seen no key yet has ``lse = -inf`` and weight 0)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(merged)
    safe = torch.where(finite, merged, torch.zeros_like(merged))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(merged))[..., None]
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(merged))[..., None]
    return out * w_old + block_out.float().nan_to_num(0.0) * w_new, merged
