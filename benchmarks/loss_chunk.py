"""``loss_chunk`` at real vocabularies: the chunked loss's forward + backward time and its transient memory per chunk
size, for SmolLM2's 49,152-token and Llama 3's 128,256-token vocabularies, against the whole logits.

    python benchmarks/loss_chunk.py          # ~3 min on 2 CPU cores; writes results/loss_chunk.{json,md}

One process, one thread, fp32: ``tokens`` hidden states of SmolLM2's width (576) through a trainable head (the
fused path of :mod:`lightning_fsdp.loss.linear_cross_entropy`, as a full fine-tune or a tied head runs it), every
position trained. Each size is timed ``--repeats`` times in rotating order; the median is reported, as a ratio to
the whole logits (``F.linear`` + ``F.cross_entropy``). The transient is what one chunk allocates beyond the inputs
and gradients: its logits and their gradient (``2 × chunk × vocab × 4`` bytes), against the whole logits' two
``tokens × vocab`` buffers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_fsdp.loss import chunked_causal_lm_loss  # noqa: E402
from lightning_fsdp.loss.chunked import DEFAULT_CHUNK_TOKENS  # noqa: E402

VOCABULARIES = {"SmolLM2 (49,152)": 49152, "Llama 3 (128,256)": 128256}


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunks", default="64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, vocab in VOCABULARIES.items():
        head = torch.nn.Linear(args.hidden, vocab, bias=False)
        hidden = torch.randn(1, args.tokens, args.hidden, requires_grad=True)
        labels = torch.randint(0, vocab, (1, args.tokens))

        def whole() -> None:
            logits = F.linear(hidden, head.weight)
            F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum").backward()

        def chunked(chunk: int):
            def run() -> None:
                total, _ = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=chunk)
                total.backward()
            return run

        whole()  # warm-up
        base = _time(whole, args.repeats)
        rows.append({"vocab": name, "chunk": "whole logits", "seconds": base, "ratio": 1.0,
                     "transient_mib": 2 * args.tokens * vocab * 4 / 2**20})
        for chunk in [int(c) for c in args.chunks.split(",")]:
            chunked(chunk)()
            seconds = _time(chunked(chunk), args.repeats)
            rows.append({"vocab": name, "chunk": chunk, "seconds": seconds, "ratio": seconds / base,
                         "transient_mib": 2 * min(chunk, args.tokens) * vocab * 4 / 2**20})
            print(f"{name} chunk {chunk}: {seconds:.3f} s ({seconds / base:.2f}× whole)", flush=True)
    lines = [f"# loss_chunk at real vocabularies ({args.tokens} tokens, width {args.hidden}, fp32, 1 thread;"
             f" default {DEFAULT_CHUNK_TOKENS})", "",
             "| vocabulary | chunk | fwd+bwd s | × whole logits | transient MiB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['vocab']} | {r['chunk']} | {r['seconds']:.3f} | {r['ratio']:.2f}× | {r['transient_mib']:.0f} |"
              for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_chunk.json").write_text(json.dumps(rows, indent=1))
    (args.out / "loss_chunk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
