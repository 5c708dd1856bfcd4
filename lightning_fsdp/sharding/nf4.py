"""torchao's NF4 (QLoRA's 4-bit NormalFloat): the one module that knows the format's fields.

A weight is split into blocks of 64 elements; each element is stored as the index (4 bits) of the nearest of 16
NormalFloat levels scaled by its block's absmax. The block absmaxes are quantized again ("double quantization"):
one mean over *all* of the tensor's absmaxes is subtracted, then they are stored as int8 per scaler block of 256
absmaxes, with one bf16 factor per scaler block. FSDP2 shards an ``NF4Tensor`` on dim 0 and all-gathers it in 4
bits; ``F.linear`` dequantizes it inside the op.

Because of that one mean, quantizing a rank's rows alone differs from quantizing the whole tensor. This module
splits the work so a rank needs only its rows plus that mean: :func:`block_absmax` of its rows, the mean of every
rank's absmaxes (agreed by the caller), then :func:`quantize_rows` gives exactly this rank's part of
``to_nf4(whole)``. A shard is self-contained when it holds whole scaler blocks (:data:`SHARD_ALIGNMENT` elements).

The numbers are defined as ``to_nf4(weight.to(torch.bfloat16))`` with torchao's block sizes.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Any

import torch

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
#: elements per scaler block: a shard must hold a whole number of them to quantize on its own
SHARD_ALIGNMENT = BLOCK_SIZE * SCALER_BLOCK_SIZE
#: the dtype the weights are quantized from (and dequantized to)
DTYPE = torch.bfloat16
_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
INSTALL_HINT = "pip install 'lightning-fsdp[qlora]' (torchao >= 0.18)"


@functools.lru_cache(maxsize=1)
def _torchao() -> Any:
    """torchao's NF4 module, imported once and quietly (torchao logs each GPU-only library it cannot load)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import importlib

            module = importlib.import_module(_MODULE)
        _install_linear(module)
        return module
    except ImportError as err:
        raise ImportError(f"quantize_base='nf4' needs torchao's NF4 tensor ({_MODULE}): {err}. {INSTALL_HINT}.") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def require() -> None:
    """Raise the install hint now if torchao's NF4 is not importable."""
    _torchao()


def import_quietly() -> None:
    """Import torchao now, if it is installed, without its log lines: PEFT imports it on import when it is present,
    and torchao logs every GPU-only library it cannot load on a CPU-only machine."""
    try:
        _torchao()
    except ImportError:
        pass


def is_nf4(tensor: Any) -> bool:
    """``tensor`` is an ``NF4Tensor`` (without importing torchao when nothing could be one)."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(tensor, module.NF4Tensor)


@functools.lru_cache(maxsize=None)
def _levels(device: torch.device) -> torch.Tensor:
    """The 16 NormalFloat levels, as torchao's ``to_nf4`` builds them."""
    return _torchao().to_nf4(torch.zeros(SHARD_ALIGNMENT, dtype=DTYPE)).nf4.to(device)


def quantize_whole(weight: torch.Tensor) -> Any:
    """``to_nf4(weight.to(bf16))``: the definition every sharded quantization reproduces."""
    return _torchao().to_nf4(weight.detach().to(DTYPE).contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)


def empty(shape: torch.Size, device: torch.device, compute_device: torch.device) -> Any:
    """An ``NF4Tensor`` of ``shape`` whose data is allocated on ``device`` (``meta``: nothing is) and filled later.

    The scaler mean and the level table live on ``compute_device``: they are not sharded, and the gathered tensor
    dequantizes where it computes."""
    ao = _torchao()
    numel = int(torch.Size(shape).numel())
    n_blocks = numel // BLOCK_SIZE
    meta = ao.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, DTYPE, torch.device(device), False)
    return ao.NF4Tensor(
        meta,
        BLOCK_SIZE,
        n_blocks,
        SCALER_BLOCK_SIZE,
        torch.empty(n_blocks, dtype=torch.int8, device=device),
        torch.empty(n_blocks // SCALER_BLOCK_SIZE, dtype=DTYPE, device=device),
        torch.zeros((), dtype=DTYPE, device=compute_device),
        torch.empty(numel // 2, dtype=torch.uint8, device=device),
        _levels(torch.device(compute_device)).clone(),
    )


def compute_device(tensor: Any) -> torch.device:
    """Where ``tensor`` (an ``NF4Tensor``) dequantizes: the device of its level table."""
    return tensor.nf4.device


def data_device(tensor: Any) -> torch.device:
    """Where ``tensor`` (an ``NF4Tensor``) stores its 4-bit data."""
    return tensor.quantized_data.device


def block_absmax(rows: torch.Tensor) -> torch.Tensor:
    """The absmax of every 64-element block of ``rows`` (bf16), in storage order."""
    return _torchao().get_block_absmax(rows.flatten(), BLOCK_SIZE)


def quantize_rows(rows: torch.Tensor, mean: torch.Tensor) -> dict[str, torch.Tensor]:
    """This part of a tensor, quantized as the whole tensor would be, given ``mean``: the mean of the whole tensor's
    block absmaxes (:func:`block_absmax` of every part, concatenated in order, then ``.mean()``).

    ``rows`` (bf16) must hold whole scaler blocks. Returns the fields of the part, as torchao's ``to_nf4`` of the
    whole tensor followed by ``torch.chunk`` would hold them."""
    ao = _torchao()
    absmax = block_absmax(rows) - mean
    n_scaler_blocks = absmax.numel() // SCALER_BLOCK_SIZE
    factors = 256 / (2 * ao.get_block_absmax(absmax, SCALER_BLOCK_SIZE).unsqueeze(-1).expand(n_scaler_blocks, SCALER_BLOCK_SIZE))
    scalers = (absmax.view(n_scaler_blocks, SCALER_BLOCK_SIZE) * factors).round().clamp(-128, 127)
    data = _level_codes(rows)
    return {
        "quantized_scalers": scalers.flatten().to(torch.int8),
        "quantization_factor": factors[:, 0].contiguous(),
        "quantized_data": data,
        "scaler_mean": mean,
    }


#: elements per step of the nearest-level search, at most (torchao's own chunk)
MAX_CODE_STEP = 1024**2
#: the search compares every element with all 16 levels: steps of 1/32 of the rows keep that workspace below the
#: rows' own bf16 bytes, so quantizing adds about one copy of the rows at any size
CODE_STEPS = 32


def _level_codes(rows: torch.Tensor) -> torch.Tensor:
    """The packed 4-bit level indices of ``rows`` (two per byte), equal to torchao's ``convert_to_norm_float_weight``
    but searched in steps bounded by the rows' size (torchao's fixed 1M-element chunk costs 16× that in workspace,
    which dominates a small weight's load)."""
    ao = _torchao()
    flat = rows.flatten()
    scales = ao.get_block_absmax(flat, BLOCK_SIZE)
    levels = _levels(rows.device)
    packed = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=flat.device)
    step = min(MAX_CODE_STEP, max(BLOCK_SIZE, flat.numel() // CODE_STEPS // BLOCK_SIZE * BLOCK_SIZE))
    for start in range(0, flat.numel(), step):
        stop = min(start + step, flat.numel())
        blocks = flat[start:stop].view(-1, BLOCK_SIZE) / scales[start // BLOCK_SIZE : stop // BLOCK_SIZE].unsqueeze(-1)
        codes = ao.NF4Tensor.quantize_tensor_nearest(blocks.flatten(), levels).to(torch.uint8)
        packed[start // 2 : stop // 2] = codes[::2] << 4 | codes[1::2]
    return packed


def write(target: Any, fields: dict[str, torch.Tensor]) -> None:
    """Copy ``fields`` (from :func:`quantize_rows`) into the ``NF4Tensor`` ``target`` in place: every view of its
    storage (FSDP's shard, the parameter) sees the new values."""
    with torch.no_grad():
        for name, value in fields.items():
            getattr(target, name).copy_(value)


def fields(tensor: Any) -> dict[str, torch.Tensor]:
    """The stored fields of an ``NF4Tensor`` (what equality of two quantizations means)."""
    return {name: getattr(tensor, name) for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")}


def nbytes(tensor: Any) -> int:
    """Bytes an ``NF4Tensor`` stores: its 4-bit data, int8 block scalers, bf16 factors, mean and level table."""
    names, _ = tensor.__tensor_flatten__()
    return sum(getattr(tensor, n).numel() * getattr(tensor, n).element_size() for n in names)


def bytes_per_element() -> float:
    """Storage of one weight element in NF4: 4 bits, one int8 per block, one bf16 factor per scaler block."""
    return 0.5 + 1 / BLOCK_SIZE + 2 / SHARD_ALIGNMENT


def dequantize(tensor: Any, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The weight an ``NF4Tensor`` stands for, in ``dtype`` (what the matmul uses): torchao's
    ``get_original_weight().to(dtype)`` value for value, built a step of blocks at a time into the result.

    torchao widens every 4-bit code to int64 and keeps the bf16 levels, the scaled halves and their interleaving at
    once: about 17 bytes per element, 3.7 GiB for one of Llama-2-70B's MLP weights. Here the transient is one step's
    (:data:`DEQUANTIZE_STEP` bytes of codes), beside the result itself."""
    levels = tensor.nf4
    data = tensor.quantized_data.reshape(-1)
    scalers = tensor.dequantize_scalers(tensor.quantized_scalers, tensor.quantization_factor, tensor.scaler_block_size)
    out = torch.empty(tensor.shape, dtype=dtype, device=data.device)
    pairs = out.view(-1, 2)  # element 2i is the byte's high code, 2i + 1 its low code
    per_block = tensor.block_size // 2  # bytes of codes per scaler
    step = max(per_block, DEQUANTIZE_STEP // per_block * per_block)
    for start in range(0, data.numel(), step):
        codes = data[start:start + step]
        scale = scalers[start // per_block:(start + codes.numel()) // per_block].repeat_interleave(per_block)
        pairs[start:start + codes.numel(), 0] = (levels[(codes >> 4).long()] * scale).to(dtype)
        pairs[start:start + codes.numel(), 1] = (levels[(codes & 0b1111).long()] * scale).to(dtype)
    return out


#: bytes of 4-bit codes dequantized per step (4 MiB: 8M elements; a transient of about 60 MiB beside the result)
DEQUANTIZE_STEP = 1 << 22


class _LinearNF4(torch.autograd.Function):
    """``F.linear`` with an NF4 weight, as torchao's ``LinearNF4`` computes it (the weight never has a gradient),
    through :func:`dequantize`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Any) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(input, dequantize(weight, input.dtype))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize(weight, grad_output.dtype), None


def _linear(*args: Any, **kwargs: Any) -> torch.Tensor:
    input, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    out = _LinearNF4.apply(input, weight)
    return out if bias is None else out + bias


def _install_linear(ao: Any) -> None:
    """Route ``F.linear`` on an ``NF4Tensor`` through :class:`_LinearNF4` (torchao's table of the functions it
    overrides); where torchao keeps no such table, its own path stays, loudly."""
    table = getattr(ao, "NF4_TORCH_FUNCTIONS", None)
    if not isinstance(table, dict) or torch.nn.functional.linear not in table:
        from lightning_fsdp._torch_compat import warn_lost

        warn_lost("nf4_linear", "each NF4 weight is dequantized through torchao's int64 path for its matmul (about"
                  " 17 bytes per element at once)", "torchao has no NF4_TORCH_FUNCTIONS table with F.linear.")
        return
    table[torch.nn.functional.linear] = _linear


def roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a QLoRA run trains against it: quantized to NF4 and back (bf16)."""
    return dequantize(quantize_whole(weight))


def shard_fits(shape: tuple[int, ...], shards: int) -> bool:
    """Whether a 2-D weight splits over ``shards`` ranks (``torch.chunk`` on dim 0) into equal parts that each hold
    whole scaler blocks."""
    if len(shape) != 2 or shape[0] % shards:
        return False
    return (shape[0] // shards) * shape[1] % SHARD_ALIGNMENT == 0
