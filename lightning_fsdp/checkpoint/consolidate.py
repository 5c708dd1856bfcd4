"""A sharded checkpoint directory → one standard Lightning ``.ckpt`` (or its weights in one ``.safetensors``).

The result loads in a plain single process (``MyModule.load_from_checkpoint(DST)``, ``torch.load(DST,
weights_only=True)``) without this package's strategy. ``--format safetensors`` writes the model weights only.

Runs in one process, no process group. The source is opened through
:class:`~lightning_fsdp.checkpoint.reader.CheckpointReader`: manifest, sizes and state files first, each shard entry
checked as it is read (every byte is read once). Tensors are assembled one at a time from their shards, so memory peaks near one copy of
the output (for safetensors, which is written as it is read: near one tensor).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Literal, Optional, TextIO, Union

import torch

from lightning_fsdp.checkpoint import commit as commit_ops
from lightning_fsdp.checkpoint.base_weights import BaseReference, pop_reference, require_resolver
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.reader import CheckpointReader
from lightning_fsdp.checkpoint.safetensors_file import Entry, entry_bytes, write_safetensors
from lightning_fsdp.checkpoint.schema import SCHEMA, TensorPath
from lightning_fsdp.checkpoint.state import assemble_full_checkpoint, stamp_lightning_version, weight_paths

Format = Literal["ckpt", "safetensors"]

#: progress lines are printed (at most once a second) for checkpoints at least this large
PROGRESS_MIN_BYTES = 64 << 20


class _Progress:
    """A tensor counter on stderr: periodic for large checkpoints, one summary line at the end."""

    def __init__(self, total: int, total_bytes: int, enabled: bool, stream: Optional[TextIO] = None) -> None:
        self.total, self.total_bytes, self.enabled = total, total_bytes, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.done_bytes = 0
        self.start = self.last = time.monotonic()
        self.periodic = enabled and total_bytes >= PROGRESS_MIN_BYTES

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        if self.periodic and (now - self.last >= 1.0 or self.done == self.total):
            self.last = now
            print(
                f"consolidate: {self.done}/{self.total} tensors, {self.done_bytes / 2**20:.1f}/"
                f"{self.total_bytes / 2**20:.1f} MiB",
                file=self.stream,
                flush=True,
            )

    def finish(self, dst: Path) -> None:
        if self.enabled:
            seconds = time.monotonic() - self.start
            print(
                f"consolidate: wrote {dst} ({self.done} tensors, {self.done_bytes / 2**20:.1f} MiB) in {seconds:.1f}s",
                file=self.stream,
                flush=True,
            )


#: a tensor to write: dtype, shape, and how to read it (one at a time)
#: the base weights a checkpoint refers to, as entries by model key (see ``lightning_fsdp.hf.export``)
BaseTensors = Callable[[BaseReference], dict[str, Entry]]


def consolidate_checkpoint(
    src: Union[str, Path],
    dst: Union[str, Path],
    format: Format = "ckpt",
    progress: bool = True,
    verify: bool = True,
    base_tensors: Optional[BaseTensors] = None,
    weights: str = "model",
) -> Path:
    """Write the sharded checkpoint ``src`` as one file ``dst`` (see the module docstring). Returns ``dst``.

    A checkpoint that refers to frozen base weights instead of storing them needs ``base_tensors`` to read them
    (the ``lightning-fsdp consolidate`` command passes it). ``weights="ema"``: the model's weights are
    ``ShardedEMA``'s average (a ``.ckpt`` then holds the average as its ``state_dict``, for evaluation).
    """
    src, dst = Path(src), Path(dst)
    if format not in ("ckpt", "safetensors"):
        raise ValueError(f"`format` must be 'ckpt' or 'safetensors', got {format!r}.")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise CheckpointError(f"The destination {dst} must be outside the source checkpoint {src}.")
    reader = CheckpointReader(src, verify)  # every byte read once: each entry checked as it is read
    manifest, meta, paths = reader.manifest, reader.meta, reader.paths
    try:
        reference = pop_reference(meta, src)
        base: dict[str, Entry] = {}
        if reference is not None:
            base = require_resolver(reference, base_tensors, src)(reference)
        unknown = sorted(set(paths) - set(reader.tensor_keys()))
        if unknown:
            raise CheckpointError(f"{src}: meta.pt lists tensors that .metadata does not hold: {unknown[:5]}.")
        def entry(key: str) -> Entry:
            return (*reader.describe(key), lambda: reader.read(key))

        chosen = weight_paths(paths, weights, src)
        # with the average as the weights, the output holds no second copy of it
        skipped = (SCHEMA.model, *SCHEMA.model_like) if weights == "ema" else (SCHEMA.model,)
        for key in SCHEMA.model_like if weights == "ema" else ():
            meta.pop(key, None)
        entries: dict[TensorPath, Entry] = {path: entry(key) for key, path in paths.items() if path[0] not in skipped}
        entries.update({SCHEMA.model_path(name): entry(key) for name, key in chosen.items()})
        entries.update({SCHEMA.model_path(key): entry for key, entry in base.items()})
        with commit_ops.staged(dst) as staging:
            if format == "safetensors":
                model_weights = {SCHEMA.model_key(p): e for p, e in entries.items() if SCHEMA.is_model_tensor(p)}
                bar = _Progress(len(model_weights), sum(entry_bytes(e) for e in model_weights.values()), progress)
                write_safetensors(staging, model_weights, {"source": manifest.target, "format": "pt"}, bar.update)
            else:
                bar = _Progress(len(entries), sum(entry_bytes(e) for e in entries.values()), progress)
                tensors: dict[TensorPath, torch.Tensor] = {}
                for path, (_, _, read) in entries.items():
                    tensors[path] = read()
                    bar.update(tensors[path].numel() * tensors[path].element_size())
                meta = assemble_full_checkpoint(meta, tensors)
                tensors.clear()
                stamp_lightning_version(meta)
                with open(staging, "wb") as f:
                    torch.save(meta, f)
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        reader.close()
    bar.finish(dst)
    return dst
