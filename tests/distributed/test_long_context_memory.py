"""The chunked loss's memory, measured rather than planned: a tiny-but-wide Hugging Face Llama (vocabulary 65,536)
at 4096 tokens per rank on 2 ranks, one real ``Trainer(strategy="fsdp_custom")`` fit per loss in fresh processes
(``benchmarks/long_context.py``'s harness: peak RSS above the RSS after the imports, glibc's mmap threshold fixed so
freed tensors leave the RSS). The whole fp32 logits are 1 GiB per rank.
"""

from __future__ import annotations

import pytest

from benchmarks.long_context import WIDE_LLAMA, Runner, planned_peak
from lightning_fsdp.loss import DEFAULT_CHUNK_TOKENS

pytest.importorskip("transformers")

CONTEXT = 4096


@pytest.mark.slow
def test_the_chunked_loss_frees_the_logits_and_the_planner_follows_both(tmp_path):
    from lightning_fsdp.models.hf_causal_lm import write_random_model

    model_dir = write_random_model(tmp_path / "wide-llama", WIDE_LLAMA, max_shard_size="200MB")
    run = Runner(model_dir, tmp_path, steps=2)
    whole, chunked = run.peak(None, CONTEXT), run.peak(DEFAULT_CHUNK_TOKENS, CONTEXT)
    logits = CONTEXT * WIDE_LLAMA["vocab_size"] * 4
    print(f"peak per rank: whole logits {whole / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB,"
          f" logits {logits / 2**20:.0f} MiB")
    assert chunked <= whole - 0.8 * logits
    for chunk, measured in ((None, whole), (DEFAULT_CHUNK_TOKENS, chunked)):
        assert planned_peak(WIDE_LLAMA, chunk, CONTEXT) == pytest.approx(measured, rel=0.15), chunk
