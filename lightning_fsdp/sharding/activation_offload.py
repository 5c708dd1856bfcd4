"""Activations offloaded to host memory between forward and backward, on a side stream overlapped with compute.

What autograd saves for backward (each layer's inputs, attention outputs, MLP hiddens) grows with the sequence and
is held on the device from a layer's forward to its backward. Under :class:`ActivationOffload` every saved tensor
of at least ``min_bytes`` is copied to pinned host memory on a side stream while the next layers compute, its device
memory freed as soon as the copy is done, and copied back when backward needs it. Parameters (FSDP2's gathered
weights, which it frees and gathers again itself) stay where they are. Composed with activation checkpointing only
the checkpointed blocks' inputs are saved, so those are what travel.

It is torch's ``saved_tensors_hooks`` (``torch.autograd.graph.save_on_cpu`` does the same synchronously). On CPU
there is nowhere cheaper to put a tensor: the hooks leave CPU tensors alone, unless ``copy_on_cpu`` is set, which
runs the same pack and unpack path with plain copies so that it can be tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_fsdp._torch_compat import view_base

__all__ = ["ActivationOffload"]


@dataclass
class _Offloaded:
    """A saved tensor's host copy, the event that marks the copy done, and where it came from."""

    host: Tensor
    event: Any
    device: torch.device


class ActivationOffload:
    """``with ActivationOffload(): loss = model(x)``; then ``loss.backward()`` anywhere (the hooks travel with the
    saved tensors). ``offloaded`` counts the tensors moved, ``offloaded_bytes`` their bytes."""

    def __init__(self, min_bytes: int = 1 << 20, copy_on_cpu: bool = False) -> None:
        self.min_bytes, self.copy_on_cpu = int(min_bytes), copy_on_cpu
        self.offloaded = 0
        self.offloaded_bytes = 0
        self._stream: Optional[Any] = None
        self._hooks: Optional[Any] = None

    def __enter__(self) -> ActivationOffload:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _worth_moving(self, tensor: Tensor) -> bool:
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):  # a weight, or its .t()
            return False
        if type(tensor) is not Tensor:  # a DTensor or a quantized tensor: its own storage rules
            return False
        return tensor.device.type == "cuda" or (self.copy_on_cpu and tensor.device.type == "cpu")

    def _pack(self, tensor: Tensor) -> Any:
        if not self._worth_moving(tensor):
            return tensor
        self.offloaded += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return _Offloaded(tensor.detach().clone(), None, tensor.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is complete before it is copied
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(stream)  # its device memory is reused only once the copy is done
        return _Offloaded(host, event, tensor.device)

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.device.type != "cuda":
            return packed.host
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.event)  # the host copy is complete
        return packed.host.to(packed.device, non_blocking=True)
