"""A GGUF file as a model source: converted once into a plain Hugging Face directory, then read like any other.

GGUF is how llama.cpp, Ollama and LM Studio hold models, and how many users already have theirs. transformers reads
it (``from_pretrained(dir, gguf_file=...)``, dequantizing to fp32) but will not save what it read, and reading is
slow (seconds per hundred million parameters), so every rank reading the file itself would be wasteful. Instead
:func:`resolve_model_source` converts the file once into ``config.json`` + safetensors + the tokenizer with its
chat template, in a cache keyed by the file's content (:func:`gguf_cache_dir`), written to a hidden sibling and
renamed into place; every rank then reads its own shards of that directory as usual.

Everything that can be checked from the header is checked before a byte of weights is read
(:func:`check_gguf`): the magic, the architecture (those transformers' GGUF reader supports), and that the file
holds every byte its tensor table points to, so a truncated download fails with its size, not deep in a reader.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Union

from lightning_fsdp import cache

log = logging.getLogger(__name__)

__all__ = ["GGUFError", "check_gguf", "gguf_cache_dir", "import_gguf", "is_gguf", "resolve_model_source",
           "supported_architectures"]

GGUF_MAGIC = b"GGUF"
#: bump when the conversion's output changes, so caches made by an older version are not reused
CONVERSION_VERSION = 1
#: what an installed transformers' GGUF reader lists that is not a model architecture
_NOT_ARCHITECTURES = {"general", "tokenizer"}


class GGUFError(ValueError):
    """A GGUF file that cannot be a model source; the message names the file, the problem and the fix."""


def is_gguf(path: Union[str, Path]) -> bool:
    return str(path).lower().endswith(".gguf")


def supported_architectures() -> list[str]:
    """The GGUF ``general.architecture`` values transformers' reader converts (``llama``, ``mistral``, ``qwen2``…)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES)


def check_gguf(path: Union[str, Path]) -> str:
    """The file's architecture, after checking it is a complete GGUF file of a supported one; else :class:`GGUFError`."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file." + (" It is a directory." if path.is_dir() else ""))
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}).")
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise GGUFError(f"Reading {path} needs the `gguf` package: pip install gguf") from err
    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # a header that points past the end, or values that do not parse
        raise GGUFError(f"{path} is corrupt or truncated ({size:,} bytes): its header cannot be read ({err}). "
                        "Download or copy the file again.") from err
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size or not reader.tensors:
        raise GGUFError(f"{path} is truncated: its tensor table needs {end:,} bytes, the file has {size:,}. "
                        "Download or copy the file again.")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFError(f"{path} names no general.architecture; it is not a model file llama.cpp or transformers reads.")
    architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    supported = supported_architectures()
    if architecture not in supported:
        raise GGUFError(f"{path}: architecture {architecture!r} is not one transformers' GGUF reader converts "
                        f"(supported: {', '.join(supported)}). Convert it to a Hugging Face directory another way "
                        "and pass that directory.")
    return architecture


def content_hash(path: Union[str, Path], chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_cache_dir(path: Union[str, Path], cache_root: Union[str, Path, None] = None) -> Path:
    """Where ``path``'s conversion lives: ``<cache>/gguf/<stem>-<sha256 prefix>``, shared by every run and rank."""
    root = Path(cache_root) / "gguf" if cache_root is not None else cache.cache_root("gguf")
    key = content_hash(path)[:20]
    return root / f"{Path(path).stem}-{key}-v{CONVERSION_VERSION}"


def import_gguf(path: Union[str, Path], dst: Union[str, Path, None] = None, *, force: bool = False) -> Path:
    """Convert the GGUF file at ``path`` into a Hugging Face directory (``dst``, or the content-keyed cache); the
    directory appears whole or not at all. Returns it; an existing conversion is reused unless ``force``."""
    path = Path(path)
    check_gguf(path)
    target = Path(dst) if dst is not None else gguf_cache_dir(path)
    if target.exists() and not force:
        if (target / "config.json").is_file():
            return target
        raise GGUFError(f"{target} exists and is not a converted model directory; choose another destination.")
    cache.build_once(target, lambda out: _convert(path, out), complete="config.json", force=force)
    log.warning("Converted %s into the Hugging Face directory %s", path, target)
    return target


def _convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    from lightning_fsdp.console import is_verbose

    verbosity, bars, reader_bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), gguf_reader.tqdm
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not is_verbose():  # its reader draws a bar of its own, past transformers' switch; this step reports itself
        gguf_reader.tqdm = functools.partial(reader_bar, disable=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:
        raise GGUFError(f"transformers could not read {path}: {err}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        gguf_reader.tqdm = reader_bar
        if bars:  # as it was: the console may have turned bars off for the whole job
            hf_logging.enable_progress_bar()
    # what transformers read is plain fp32 now; without these it refuses to save ("quantized with gguf")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@functools.lru_cache(maxsize=32)
def _resolved(path: str, size: int, mtime_ns: int, cache_root: Path) -> Path:
    return import_gguf(path, gguf_cache_dir(path, cache_root))


def resolve_model_source(path: Union[str, Path]) -> Union[str, Path]:
    """``path`` itself (as given), or for a ``.gguf`` file its converted directory (converting it on first use)."""
    if not is_gguf(path):
        return path
    if not Path(path).is_file():
        check_gguf(path)  # raises with the reason
    stat = Path(path).stat()
    return str(_resolved(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, cache.cache_root()))
