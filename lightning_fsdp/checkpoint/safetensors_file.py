"""The one safetensors writer and dtype table of the package.

:func:`write_safetensors` streams a file tensor by tensor: the header is built from shapes and dtypes before any data
is read, so writing a model's weights holds one tensor at a time (``consolidate --format safetensors`` and the HF
export both write through it). The layout is safetensors' own (an 8-byte little-endian header length, the JSON
header padded to 8 bytes, the data in header order), which ``safetensors.safe_open`` and transformers read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional

import torch

from lightning_fsdp.checkpoint.errors import CheckpointError

#: torch dtype → safetensors' name for it
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
#: safetensors' dtype name → torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

#: one tensor to write: its dtype and shape (for the header), and how to read it (called once, when it is written)
Entry = tuple[torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]


def entry_bytes(entry: Entry) -> int:
    dtype, shape, _ = entry
    return int(torch.Size(shape).numel()) * dtype.itemsize


def write_safetensors(
    path: Path,
    entries: Mapping[str, Entry],
    metadata: Optional[Mapping[str, str]] = None,
    on_written: Optional[Callable[[int], None]] = None,
) -> None:
    """Write ``entries`` to ``path`` and ``fsync`` it; ``on_written(nbytes)`` after each tensor. Wider dtypes come
    first (then by name), as safetensors orders them, so every tensor's data is aligned to its element size."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    order = sorted(entries, key=lambda name: (-entries[name][0].itemsize, name))
    for name in order:
        dtype, shape, _ = entries[name]
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors; use --format ckpt.")
        nbytes = entry_bytes(entries[name])
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            dtype, shape, read = entries[name]
            tensor = read().contiguous()
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise CheckpointError(
                    f"{name}: read {tensor.dtype} {tuple(tensor.shape)}, but the header says {dtype} {tuple(shape)}."
                )
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            if on_written is not None:
                on_written(tensor.numel() * tensor.element_size())
            del tensor
        f.flush()
        os.fsync(f.fileno())


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Tensors already in memory, through the same writer."""
    entries = {name: (t.dtype, tuple(t.shape), lambda t=t: t.detach().cpu()) for name, t in tensors.items()}
    write_safetensors(path, entries, metadata)
