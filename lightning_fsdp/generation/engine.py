"""One decoding loop for every caller: held-out answers, ``chat``, GRPO rollouts and lm-eval's ``generate_until``.

:func:`generate` takes token ids, not text, and returns token ids. Prompts of a batch are left-padded, so every
row's next token is the batch's last column; positions count each row's own tokens, so padding changes nothing.
With a Hugging Face model the prompts are encoded once (the prefill) into a key/value cache, each prompt once
however many samples it has (the cache is repeated for its samples), and every later step feeds one token per row.
Rows that have stopped leave the batch (their cache rows are dropped). A model without a cache (a plain
``model(ids) -> logits`` module such as the package's GPT) is run on the whole sequence at each step, one prompt's
samples at a time.

Nothing here knows about sharding, except that a sharded model in ``stream`` mode needs every rank to make the same
forward calls: ``synchronized=True`` makes the ranks agree after each step whether any row anywhere still runs
(a rank whose rows are done keeps stepping one idle row until then). See :mod:`.fsdp`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_fsdp.parallel.collectives import all_equal, any_rank
from lightning_fsdp.generation.sampling import Sampling, row_generators, sample_rows

__all__ = ["Completions", "generate"]

#: called after each decoding step with the rows (their indices in the output) and the token each one got
OnTokens = Callable[[list[int], list[int]], None]


@dataclass
class Completions:
    """What :func:`generate` made: row ``i * repeats + s`` is sample ``s`` of prompt ``i``.

    ``ids[r]`` holds the new tokens, ending with the stop token when ``stopped[r]``; a row that is not stopped was
    cut at ``max_new_tokens`` (truncated). ``logprobs[r]``: each new token's log-probability under the distribution
    it was drawn from (the logits at the sampling temperature, before top-k/top-p), as a sampler reports it.
    """

    ids: list[list[int]]
    stopped: list[bool]
    steps: int
    seconds: float
    logprobs: list[list[float]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """New tokens over every row (stop tokens included)."""
        return sum(len(row) for row in self.ids)

    def text_ids(self, row: int) -> list[int]:
        """Row ``row``'s tokens without its stop token: what a reader of the text sees."""
        return self.ids[row][:-1] if self.stopped[row] else self.ids[row]


def _decoder_of(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: its base says what it accepts
    return get_base() if callable(get_base) else model


def _cache_keyword(model: nn.Module) -> Optional[str]:
    """The keyword a Hugging Face causal LM takes its key/value cache by (``cache`` in transformers 5, before it
    ``past_key_values``); ``None`` for a model without one."""
    base = _decoder_of(model)
    if not hasattr(base, "config"):
        return None
    try:
        parameters = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in ("cache", "past_key_values") if k in parameters), None)


class _CachedRows:
    """A batch of rows decoding with a Hugging Face key/value cache."""

    def __init__(self, model: nn.Module, keyword: str) -> None:
        self.model, self.keyword = model, keyword
        self.cache: Any = None
        self.mask = torch.empty(0)
        self.positions = torch.empty(0)

    def _forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **({self.keyword: self.cache} if self.cache is not None else {}))
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :]

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        self.mask = mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, positions)
        self.positions = positions[:, -1]
        return logits

    def repeat(self, times: int) -> None:
        if times > 1:
            self.cache.batch_repeat_interleave(times)
            self.mask = self.mask.repeat_interleave(times, dim=0)
            self.positions = self.positions.repeat_interleave(times, dim=0)

    def select(self, keep: Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask, self.positions = self.mask[keep], self.positions[keep]

    def step(self, tokens: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.positions = self.positions + 1
        return self._forward(tokens[:, None], self.positions[:, None])


class _RecomputedRows:
    """Rows of equal length decoding without a cache: the whole sequence again at every step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ids = torch.empty(0, dtype=torch.long)

    def _logits(self) -> Tensor:
        out = self.model(self.ids)
        logits = out if isinstance(out, Tensor) else out.logits
        return logits[:, -1, :]

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        if not bool(mask.all()):
            raise ValueError("A model without a key/value cache decodes prompts of one length at a time.")
        self.ids = ids
        return self._logits()

    def repeat(self, times: int) -> None:
        self.ids = self.ids.repeat_interleave(times, dim=0)

    def select(self, keep: Tensor) -> None:
        self.ids = self.ids[keep]

    def step(self, tokens: Tensor) -> Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        return self._logits()


def _check_synchronized_batches(batches: int, device: torch.device) -> None:
    if not all_equal([batches], device):
        raise ValueError(
            f"A streamed rollout needs every rank to decode as many batches (this rank: {batches}): give every rank"
            " as many prompts, or use rollout_mode=gather_once."
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    pad_id: int,
    repeats: int = 1,
    keys: Optional[Sequence[int]] = None,
    batch_size: Optional[int] = None,
    device: Optional[torch.device] = None,
    synchronized: bool = False,
    on_tokens: Optional[OnTokens] = None,
) -> Completions:
    """Complete each prompt ``repeats`` times.

    Args:
        model: a Hugging Face causal LM (PEFT-wrapped or not), or a module mapping ``(B, T)`` ids to logits.
        prompts: token ids per prompt.
        sampling: the decoding settings (:class:`~.sampling.Sampling`).
        pad_id: the id left-padding is filled with (never attended to).
        repeats: samples per prompt (GRPO's ``num_generations``).
        keys: each prompt's global index, which seeds its rows (default: its position in ``prompts``).
        batch_size: prompts prefilled and decoded together (default: all).
        device: where the model computes (default: where its first parameter is).
        synchronized: agree with every other rank after each step (a streamed sharded model).
        on_tokens: called after each step with ``(rows, tokens)``, e.g. to stream text as it comes.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least one sample per prompt.")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt needs at least one token.")
    keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
    if len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts.")
    device = device if device is not None else next(model.parameters()).device
    keyword = _cache_keyword(model)
    if keyword is None:
        batch_size = 1  # no padding without a cache: one prompt (and its samples) at a time
    batch_size = max(1, min(batch_size or len(prompts), len(prompts) or 1))
    starts = list(range(0, len(prompts), batch_size))
    if synchronized:
        _check_synchronized_batches(len(starts), device)
    started = time.perf_counter()
    ids: list[list[int]] = [[] for _ in range(len(prompts) * repeats)]
    logprobs: list[list[float]] = [[] for _ in ids]
    stopped = [False] * len(ids)
    steps = 0
    for start in starts:
        chunk = list(range(start, min(start + batch_size, len(prompts))))
        rows = _CachedRows(model, keyword) if keyword is not None else _RecomputedRows(model)
        steps += _decode_batch(rows, [prompts[i] for i in chunk], chunk, sampling, pad_id, repeats, keys, device,
                               synchronized, ids, logprobs, stopped, on_tokens)
    return Completions(ids, stopped, steps, time.perf_counter() - started, logprobs)


def _decode_batch(
    rows: Any, prompts: list[Sequence[int]], chunk: list[int], sampling: Sampling, pad_id: int, repeats: int,
    keys: list[int], device: torch.device, synchronized: bool, ids: list[list[int]], logprobs: list[list[float]],
    stopped: list[bool], on_tokens: Optional[OnTokens],
) -> int:
    """Decode one batch of prompts into ``ids``/``stopped`` (rows ``prompt * repeats + sample``); returns the
    number of forward calls."""
    width = max(len(p) for p in prompts)
    batch = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        batch[r, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[r, width - len(prompt):] = 1
    logits = rows.prefill(batch.to(device), mask.to(device))
    rows.repeat(repeats)
    logits = logits.repeat_interleave(repeats, dim=0)
    out_rows = [i * repeats + s for i in chunk for s in range(repeats)]  # each batch row's place in the output
    generators = row_generators(sampling.seed, [(keys[i], s) for i in chunk for s in range(repeats)], device)
    stop = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device)
    active = list(range(len(out_rows)))  # batch rows still decoding (all at first)
    calls = 1
    for step in range(sampling.max_new_tokens):
        if active:
            current = logits[: len(active)]
            tokens = sample_rows(current, sampling, [generators[a] for a in active])
            finished = torch.isin(tokens, stop).tolist() if len(stop) else [False] * len(active)
            scale = sampling.temperature if sampling.temperature > 0 else 1.0
            chosen = (current.float() / scale).log_softmax(-1).gather(1, tokens[:, None])[:, 0].tolist()
            token_list = tokens.tolist()
            for a, token, done, logp in zip(active, token_list, finished, chosen):
                ids[out_rows[a]].append(token)
                logprobs[out_rows[a]].append(logp)
                stopped[out_rows[a]] = bool(done)
            if on_tokens is not None:
                on_tokens([out_rows[a] for a in active], token_list)
            keep = [k for k, done in enumerate(finished) if not done]
        else:
            tokens, keep = torch.full((1,), pad_id, dtype=torch.long, device=device), []
        last = step + 1 == sampling.max_new_tokens
        if last or not (any_rank(bool(keep)) if synchronized else keep):
            break
        if not keep and not active:  # already idle: step the one idle row again
            logits = rows.step(tokens)
        else:
            # rows that are done leave the batch; a rank with none left keeps one idle row while others run
            kept = keep if keep else [0]
            if len(kept) < len(active):
                rows.select(torch.tensor(kept, device=device))
            logits = rows.step(tokens[kept])
            active = [active[k] for k in keep]
        calls += 1
    return calls
