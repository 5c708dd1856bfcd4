"""A Hugging Face causal LM → one GGUF file, what llama.cpp, Ollama and LM Studio run.

Which model types are written, and how, is data: :data:`FAMILIES` (the GGUF architecture, and whether llama.cpp's
rope wants q/k rows paired), :data:`HPARAMS` (config attribute → GGUF key), :data:`ROPE_SCALING` and
:data:`~lightning_fsdp.hf.gguf_vocab.PRE_TOKENIZERS`. Tensor names come from ``gguf``'s own tensor map. Anything these tables cannot say (another
model type, a rope scaling llama.cpp lacks, a tokenizer it would split differently) is refused with a
:class:`~lightning_fsdp.hf.gguf.GGUFError` before a byte is written, since a file llama.cpp loads but runs
differently is worse than none. Norms and other 1-D tensors stay f32, as llama.cpp's own converter keeps them; q8_0
falls back to f16 for a row length that is not a multiple of its 32-value block.

Tensors are converted and written one at a time after the header, so memory stays near the model plus one tensor;
the file is written to a hidden sibling and renamed into place, so a crash never leaves a partial ``.gguf``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np
import torch
from gguf import (GGML_QUANT_VERSION, MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType,
                  GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType, RopeScalingType,
                  get_tensor_name_map, quant_shape_to_byte_shape, quants)

from lightning_fsdp.hf.gguf import GGUFError
from lightning_fsdp.hf.gguf_vocab import write_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
PathLike = Union[str, Path]

__all__ = ["GGUF_TYPES", "describe_gguf", "export_gguf", "export_gguf_from_checkpoint", "export_gguf_from_hf_dir"]


@dataclass(frozen=True)
class Family:
    arch: MODEL_ARCH
    #: llama.cpp's "normal" rope rotates adjacent pairs; HF's rotates halves, so q/k rows are reordered per head
    paired_rope: bool


#: HF ``model_type`` → how llama.cpp runs it (Mistral is a Llama to llama.cpp, as its own converter writes it)
FAMILIES = {
    "llama": Family(MODEL_ARCH.LLAMA, paired_rope=True),
    "mistral": Family(MODEL_ARCH.LLAMA, paired_rope=True),
    "qwen2": Family(MODEL_ARCH.QWEN2, paired_rope=False),
}
#: GGUF key → (config attribute, value type) for every family above
HPARAMS = {
    Keys.LLM.CONTEXT_LENGTH: ("max_position_embeddings", GGUFValueType.UINT32),
    Keys.LLM.EMBEDDING_LENGTH: ("hidden_size", GGUFValueType.UINT32),
    Keys.LLM.BLOCK_COUNT: ("num_hidden_layers", GGUFValueType.UINT32),
    Keys.LLM.FEED_FORWARD_LENGTH: ("intermediate_size", GGUFValueType.UINT32),
    Keys.LLM.VOCAB_SIZE: ("vocab_size", GGUFValueType.UINT32),
    Keys.Attention.HEAD_COUNT: ("num_attention_heads", GGUFValueType.UINT32),
    Keys.Attention.HEAD_COUNT_KV: ("num_key_value_heads", GGUFValueType.UINT32),
    Keys.Attention.LAYERNORM_RMS_EPS: ("rms_norm_eps", GGUFValueType.FLOAT32),
}
#: HF ``rope_type`` → its GGUF scaling type and (rope parameter → GGUF key, value type); ``llama3`` is written as
#: per-frequency factors instead (the ``rope_freqs`` tensor), which is how llama.cpp reads it
ROPE_SCALING: dict[str, tuple[RopeScalingType, dict[str, tuple[str, GGUFValueType]]]] = {
    "linear": (RopeScalingType.LINEAR, {"factor": (Keys.Rope.SCALING_FACTOR, GGUFValueType.FLOAT32)}),
    "yarn": (RopeScalingType.YARN, {
        "factor": (Keys.Rope.SCALING_FACTOR, GGUFValueType.FLOAT32),
        "original_max_position_embeddings": (Keys.Rope.SCALING_ORIG_CTX_LEN, GGUFValueType.UINT32),
        "beta_fast": (Keys.Rope.SCALING_YARN_BETA_FAST, GGUFValueType.FLOAT32),
        "beta_slow": (Keys.Rope.SCALING_YARN_BETA_SLOW, GGUFValueType.FLOAT32),
    }),
}
LLAMA3_ROPE_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
#: ``--gguf-type`` → the type of 2-D weights and the file type llama.cpp reports
TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
GGUF_TYPES = tuple(TYPES)


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    read: Callable[[], np.ndarray]  # float32, in llama.cpp's layout

    @property
    def nbytes(self) -> int:
        return int(np.prod(quant_shape_to_byte_shape(self.shape, self.qtype)))


def export_gguf(model: PreTrainedModel, tokenizer: Any, dst: PathLike, gguf_type: str = "f16",
                force: bool = False, name: Optional[str] = None) -> Path:
    """Write ``model`` (a plain HF model: LoRA already merged) and its ``tokenizer`` as the GGUF file ``dst``."""
    dst = Path(dst)
    if gguf_type not in TYPES:
        raise GGUFError(f"GGUF type {gguf_type!r} is not one this export writes (choose from {', '.join(TYPES)}).")
    _check_destination(dst, force)
    if getattr(model, "peft_config", None):
        raise GGUFError("The model still holds PEFT adapters; merge them first (merge_and_unload()).")
    config = model.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise GGUFError(f"model_type {config.model_type!r} has no GGUF export (supported: {', '.join(FAMILIES)}).")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise GGUFError(f"hidden_act {config.hidden_act!r}: llama.cpp's {config.model_type} runs SiLU only.")
    arch = MODEL_ARCH_NAMES[family.arch]
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope_keys, rope_freqs = _rope(config, arch, head_dim)
    tensors = _plan(model, family, gguf_type)
    if rope_freqs is not None:
        tensors.append(_Tensor(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs.shape,
                               GGMLQuantizationType.F32, lambda: rope_freqs))
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(staging, arch)
    try:
        writer.add_type("model")
        writer.add_name(name or Path(str(getattr(config, "name_or_path", "") or dst.stem)).name or dst.stem)
        writer.add_file_type(int(TYPES[gguf_type][1]))
        writer.add_quantization_version(GGML_QUANT_VERSION)
        for key, (value, vtype) in _hparams(config, head_dim).items():
            writer.add_key_value(key.format(arch=arch), value, vtype)
        for key, (value, vtype) in rope_keys.items():
            writer.add_key_value(key, value, vtype)
        write_vocab(writer, tokenizer, int(config.vocab_size))
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_encode(t))
        assert writer.fout is not None
        writer.fout[0].flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(staging, dst)
    finally:
        writer.close()
        staging.unlink(missing_ok=True)
    return dst


def export_gguf_from_checkpoint(src: PathLike, dst: PathLike, *, base: Optional[PathLike] = None,
                                tokenizer_dir: Optional[PathLike] = None, gguf_type: str = "f16", force: bool = False,
                                weights: str = "model") -> Path:
    """A sharded checkpoint's merged HF model (what ``--format hf`` writes, built in memory) as a GGUF file; the
    tokenizer comes from ``tokenizer_dir`` or the pretrained directory the checkpoint names."""
    from transformers import AutoTokenizer

    from lightning_fsdp.hf.checkpoint_model import load_hf_model

    _check_destination(Path(dst), force)
    model, side_dir = load_hf_model(src, base=base, weights=weights)
    source = Path(tokenizer_dir) if tokenizer_dir is not None else side_dir
    if source is None:
        raise GGUFError(f"{src} names no pretrained directory to take the tokenizer from; pass --hf-config DIR.")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    return export_gguf(model, tokenizer, dst, gguf_type, force, name=Path(src).name)


def export_gguf_from_hf_dir(src: PathLike, dst: PathLike, *, gguf_type: str = "f16",
                            force: bool = False) -> Path:
    """A Hugging Face model directory (``--format hf``'s export or a download) as a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_destination(Path(dst), force)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    return export_gguf(model, tokenizer, dst, gguf_type, force, name=Path(src).name)


def describe_gguf(path: PathLike) -> str:
    """``12.3 MiB, q8_0, 272 tensors``: the summary line the command prints."""
    reader = GGUFReader(str(path))
    field = reader.fields.get(Keys.General.FILE_TYPE)
    file_type = LlamaFileType(int(field.contents())) if field is not None else None
    label = {v[1]: k for k, v in TYPES.items()}.get(file_type, str(file_type)) if file_type is not None else "?"
    return f"{Path(path).stat().st_size / 2**20:.1f} MiB, {label}, {len(reader.tensors)} tensors"


def _check_destination(dst: Path, force: bool) -> None:
    """Called before the (slow) model load too, so a refusal comes at once."""
    if dst.is_dir() or (dst.exists() and not force):
        raise GGUFError(f"{dst} exists" + (" and is a directory." if dst.is_dir() else "; pass --force to replace it."))


def _hparams(config: Any, head_dim: int) -> dict[str, tuple[Any, GGUFValueType]]:
    values = {key: (getattr(config, attr), vtype) for key, (attr, vtype) in HPARAMS.items()}
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        # llama.cpp's llama/qwen2 attend over the whole context: exact up to the window, so claim no more
        log.warning("sliding_window=%d: the GGUF's context length is capped at it (llama.cpp has no sliding "
                    "window for %s).", window, config.model_type)
        values[Keys.LLM.CONTEXT_LENGTH] = (window, GGUFValueType.UINT32)
    values[Keys.Rope.DIMENSION_COUNT] = (head_dim, GGUFValueType.UINT32)
    if head_dim * config.num_attention_heads != config.hidden_size:
        values[Keys.Attention.KEY_LENGTH] = (head_dim, GGUFValueType.UINT32)
        values[Keys.Attention.VALUE_LENGTH] = (head_dim, GGUFValueType.UINT32)
    return values


def _rope(config: Any, arch: str, head_dim: int) -> tuple[dict[str, tuple[Any, GGUFValueType]], Optional[np.ndarray]]:
    """The rope base and scaling keys, and llama3's per-frequency factors; refuses what llama.cpp cannot express."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers before 5: rope_theta beside an optional rope_scaling
        params = {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": getattr(config, "rope_theta", 10000.0)}
    theta = float(params.pop("rope_theta"))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    keys: dict[str, tuple[Any, GGUFValueType]] = {Keys.Rope.FREQ_BASE.format(arch=arch): (theta, GGUFValueType.FLOAT32)}
    if rope_type == "default":
        return keys, None
    allowed = LLAMA3_ROPE_KEYS if rope_type == "llama3" else set(ROPE_SCALING.get(rope_type, (None, {}))[1])
    unknown = sorted(set(params) - allowed)
    if not allowed or unknown:
        raise GGUFError(f"rope scaling {rope_type!r}{f' with {unknown}' if allowed else ''} cannot be expressed in "
                        f"GGUF for llama.cpp (supported: {', '.join([*ROPE_SCALING, 'llama3'])}).")
    if rope_type == "llama3":
        return keys, _llama3_freq_factors(params, head_dim, theta)
    scaling_type, fields = ROPE_SCALING[rope_type]
    keys[Keys.Rope.SCALING_TYPE.format(arch=arch)] = (scaling_type.value, GGUFValueType.STRING)
    for param, value in params.items():
        key, vtype = fields[param]
        keys[key.format(arch=arch)] = (float(value) if vtype == GGUFValueType.FLOAT32 else int(value), vtype)
    return keys, None


def _llama3_freq_factors(params: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp divides each rope frequency by its factor: long wavelengths by ``factor``, short ones by 1, and a
    smooth blend between, which is Llama 3.1's scaling of ``inv_freq``."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((float(params["original_max_position_embeddings"]) / wavelen - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def _plan(model: PreTrainedModel, family: Family, gguf_type: str) -> list[_Tensor]:
    """Every tensor of ``model`` under its GGUF name and type (a tied head is not written: llama.cpp reuses the
    embedding when ``output.weight`` is absent)."""
    config = model.config
    names = get_tensor_name_map(family.arch, int(config.num_hidden_layers))
    heads = {MODEL_TENSOR.ATTN_Q: int(config.num_attention_heads), MODEL_TENSOR.ATTN_K: int(config.num_key_value_heads)}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = []
    for key, value in model.state_dict().items():
        found = names.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise GGUFError(f"{config.model_type}: tensor {key!r} has no GGUF name for llama.cpp's "
                            f"{MODEL_ARCH_NAMES[family.arch]}; this model differs from the family's layout.")
        kind, gguf_name = found  # with the key's own .weight/.bias
        if tied and kind == MODEL_TENSOR.OUTPUT:
            continue
        n_heads = heads.get(kind) if family.paired_rope else None
        shape = tuple(value.shape)
        plan.append(_Tensor(gguf_name, shape, _qtype(shape, gguf_type),
                            partial(_array, value, n_heads)))
    return plan


def _qtype(shape: tuple[int, ...], gguf_type: str) -> GGMLQuantizationType:
    if len(shape) < 2:
        return GGMLQuantizationType.F32
    qtype = TYPES[gguf_type][0]
    block, _ = quants.GGML_QUANT_SIZES[qtype]
    return qtype if shape[-1] % block == 0 else GGMLQuantizationType.F16


def _array(tensor: torch.Tensor, n_heads: Optional[int]) -> np.ndarray:
    """float32 numpy; q/k rows (or bias entries) of each head reordered from HF's halves [x0..x(d/2-1) | y0..]
    into llama.cpp's pairs [x0 y0 x1 y1 ...]."""
    array = tensor.detach().to("cpu", torch.float32).numpy()
    if n_heads is None:
        return array
    rest = array.shape[1:]
    return array.reshape(n_heads, 2, array.shape[0] // n_heads // 2, *rest).swapaxes(1, 2).reshape(array.shape)


def _encode(t: _Tensor) -> np.ndarray:
    encoded = quants.quantize(np.ascontiguousarray(t.read(), dtype=np.float32), t.qtype)
    if t.qtype == GGMLQuantizationType.F16 and not np.isfinite(encoded).all():
        raise GGUFError(f"{t.name} has values beyond float16's range; export it as bf16 or f32.")
    return encoded
