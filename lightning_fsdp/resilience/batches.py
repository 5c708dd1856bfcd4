"""Uneven data: ranks compare their batch counts before an epoch (or, for loaders without a length, before every
batch) and all raise :class:`UnevenBatchesError` together, instead of one rank waiting forever in a collective.

Both checks use one primitive, :func:`~lightning_fsdp.parallel.collectives.all_equal` (a min/max all-reduce); only
when the ranks differ are the per-rank counts gathered for the message. :class:`AgreedLoader` also makes a
mid-epoch checkpoint (e.g. a preemption save) resume on the batch where training stopped.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any, Callable, Optional

import torch

from lightning_fsdp.parallel.collectives import all_equal, all_gather_object
from lightning_fsdp.resilience.errors import UnevenBatchesError

UNEVEN_FIX = (
    "A rank that runs out early would leave the others waiting in a collective until the timeout. Let Lightning"
    " shard the data (the default `use_distributed_sampler=True` pads every rank to the same length), use"
    " `drop_last=True`, or give every rank the same number of batches."
)
_NO_LENGTH = -1


def uneven_batches_message(stage: str, counts: Sequence[Any]) -> Optional[str]:
    """``None`` if every rank reported the same batch counts for ``stage``, else an error message listing them."""
    if all(c == counts[0] for c in counts):
        return None
    listing = ", ".join(f"rank {r}: {_format_count(c)}" for r, c in enumerate(counts))
    return f"Ranks have different numbers of {stage} batches ({listing}). {UNEVEN_FIX}"


def _format_count(count: Any) -> str:
    if isinstance(count, (list, tuple)):
        return "[" + ", ".join(_format_count(c) for c in count) + "]"
    return "no length (iterable)" if count is None or count == float("inf") or count == _NO_LENGTH else str(int(count))


def _normalize_count(count: Any) -> Any:
    if isinstance(count, (list, tuple)):
        return [_normalize_count(c) for c in count]
    return _NO_LENGTH if count is None or count == float("inf") else int(count)


def _flatten(count: Any) -> list[float]:
    return [float(v) for c in count for v in _flatten(c)] if isinstance(count, list) else [float(count)]


def check_equal_batches(stage: str, count: Any, device: torch.device) -> None:
    """All ranks: raise :class:`UnevenBatchesError` on every rank if their batch counts for ``stage`` differ."""
    normalized = _normalize_count(count)
    flat = _flatten(normalized)
    if all_equal([float(len(flat))], device) and all_equal(flat, device):
        return
    message = uneven_batches_message(stage, all_gather_object(normalized))
    raise UnevenBatchesError(message or f"Ranks have different numbers of {stage} batches. {UNEVEN_FIX}")


class AgreedLoader:
    """Wraps a rank's dataloader: resumable mid-epoch, and, without a length, agreed batch by batch.

    - ``state_dict``/``load_state_dict`` record how many batches of the epoch were trained on, so a run resumed
      from a mid-epoch checkpoint fast-forwards past them and continues with the same batches it would have seen;
      Lightning otherwise restarts the epoch from its first batch. Fast-forwarding reads and discards those
      batches. A loader that is already resumable keeps its own state.
    - A loader without ``__len__`` (an iterable dataset) cannot be compared up front: before each batch every rank
      checks that all ranks have one, so a rank that runs out is seen by all at once.
    """

    _OWN = ("_loader", "_progress", "_skip", "_device", "_stage")
    _loader: Any
    _progress: Callable[[], tuple[int, Any]]
    _skip: int
    _device: torch.device
    _stage: str

    def __init__(
        self, loader: Any, progress: Callable[[], tuple[int, Any]], device: torch.device, stage: str = "training"
    ) -> None:
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_progress", progress)
        object.__setattr__(self, "_skip", 0)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_stage", stage)

    @property
    def wrapped(self) -> Any:
        return self._loader

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)  # e.g. Lightning's worker_init_fn

    def _sized(self) -> bool:
        try:
            len(self._loader)
        except (TypeError, NotImplementedError):
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Generator[Any, None, None]:
        # a generator: the wrapped iterator (and its sampler) is created at the first `next`, after Lightning has
        # called `set_epoch` on the sampler, exactly as with a plain DataLoader
        skip, self._skip = self._skip, 0
        iterator = iter(self._loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                return
        agree = not self._sized()
        count = skip
        for batch in iterator:
            if agree:
                self._agree(True, count)
            count += 1
            yield batch
        if agree:
            self._agree(False, count)

    def _agree(self, has_batch: bool, count: int) -> None:
        if not all_equal([float(has_batch)], self._device):
            raise UnevenBatchesError(
                f"Ranks ran out of {self._stage} batches at different times: after {count} batches of this epoch some"
                f" ranks have another and some do not (this rank {'does' if has_batch else 'does not'}). {UNEVEN_FIX}"
            )

    def state_dict(self) -> dict[str, Any]:
        if _is_stateful(self._loader):
            return {"wrapped": self._loader.state_dict()}
        done, total = self._progress()
        exhausted = total is not None and total != float("inf") and done >= total
        return {"batches_done": 0 if exhausted else int(done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "wrapped" in state and _is_stateful(self._loader):
            self._loader.load_state_dict(state["wrapped"])
        else:
            self._skip = int(state.get("batches_done", 0))


_END = object()


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
