"""Fine-tuning data, measured side by side: tokenization, the loader against the step it feeds, and memory per rank.

    python benchmarks/sft_data.py                # ~3 min on 2 CPU cores; writes benchmarks/results/sft_data.{json,md}
    python benchmarks/sft_data.py --quick        # small sizes: checks the harness

1. **Tokenization** of generated chat data (the demo's tasks, multi-turn) with a BPE tokenizer trained on it:
   ``SFTDataModule.prepare_data`` (chat template rendered once per assistant turn to find the trained spans, then
   one tokenization; Arrow written to disk) against the plain ``apply_chat_template(tokenize=True)`` loop a script
   would write (no labels at all): samples/s and the ratio.
2. **The loader against the step**: batches/s of the packed train loader (one process, no workers) against the
   training step (forward + backward + AdamW) of a small Llama on those batches; the loader must take a small
   fraction of a step.
3. **Memory per rank**: a prepared set of ≥ 200 MB on disk is opened and read whole by 2 processes at once. Each
   reports the private memory it added (``RssAnon``: what a rank holds itself) and its proportional share of the
   mapped pages (``Pss``), against reading the same rows into Python lists (what a per-rank copy costs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "results"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _pss_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup")
    for line in rollup.read_text().splitlines() if rollup.exists() else []:
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _read_all(root: str, copy: bool, queue: mp.Queue) -> None:
    """Open a prepared set and touch every row (``copy``: into Python lists, as a per-rank copy would)."""
    import datasets  # noqa: F401  (imported before the baseline: its code is not the data)

    from lightning_fsdp.data.sft.prepared import PreparedSet

    anon0, pss0 = _status_kib("RssAnon"), _pss_kib()
    prepared = PreparedSet.open(Path(root))
    table = prepared.train.with_format("numpy")
    held, tokens = [], 0
    for start in range(0, len(table), 4096):
        part = table[start:start + 4096]["input_ids"]
        tokens += sum(len(x) for x in part)
        if copy:
            held.extend(x.tolist() for x in part)
    queue.put({"tokens": tokens, "rss_anon_mib": (_status_kib("RssAnon") - anon0) / 1024,
               "pss_mib": (_pss_kib() - pss0) / 1024})


def _two_ranks(root: Path, copy: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(str(root), copy, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datasets
    import torch

    datasets.disable_progress_bars()
    from lightning_fsdp.data.sft import SFTDataModule
    from lightning_fsdp.data.sft.demo import chat_demo_rows, train_tokenizer
    from lightning_fsdp.data.sft.prepared import PreparedSet

    n_tok, n_mem = (2_000, 2_000) if args.quick else (20_000, 60_000)
    work = Path(tempfile.mkdtemp(prefix="sft_bench_"))
    rows = chat_demo_rows(n_tok, seed=3)
    tokenizer = train_tokenizer([m["content"] for r in rows[:5000] for m in r["messages"]] + ["user\nassistant\nsystem\n"] * 100)
    tok_dir = work / "tokenizer"
    tokenizer.save_pretrained(str(tok_dir))
    with open(work / "small.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    # the large set: plain text documents of ~500 tokens (format "text"), to reach 200 MB of tokens quickly
    sentences = [m["content"] for r in rows for m in r["messages"]]
    with open(work / "large.jsonl", "w") as f:
        for i in range(n_mem):
            f.write(json.dumps({"text": " ".join(sentences[(i * 97 + j) % len(sentences)] for j in range(60))}) + "\n")
    results: dict = {"samples": n_tok}

    # 1. tokenization
    start = time.perf_counter()
    dm = SFTDataModule(work / "small.jsonl", tok_dir, val_fraction=0.0, seq_len=512, batch_size=8,
                       cache_dir=work / "cache")
    dm.prepare_data()
    ours = time.perf_counter() - start
    start = time.perf_counter()
    plain_tokens = sum(len(tokenizer.apply_chat_template(r["messages"], tokenize=True)["input_ids"]) for r in rows[:n_tok])
    plain = time.perf_counter() - start
    results["tokenize"] = {"ours_s": ours, "plain_apply_chat_template_s": plain, "ratio": ours / plain,
                           "ours_samples_per_s": n_tok / ours, "tokens": plain_tokens}

    # 2. loader against the step
    dm.setup()
    loader = dm.train_dataloader()
    batches = list(loader)
    start = time.perf_counter()
    for _ in loader:
        pass
    load_s = (time.perf_counter() - start) / len(batches)
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_fsdp.loss import causal_lm_token_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_times = []
    for batch in batches[:6]:
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        total, count = causal_lm_token_loss(logits, batch["labels"])
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_times.append(time.perf_counter() - start)
    step_s = sorted(step_times[1:])[len(step_times[1:]) // 2]
    results["loader"] = {"batch": list(batches[0]["input_ids"].shape), "loader_s_per_batch": load_s,
                         "step_s": step_s, "loader_over_step": load_s / step_s,
                         "model_params": sum(p.numel() for p in model.parameters())}

    # 3. memory per rank
    big = SFTDataModule(work / "large.jsonl", tok_dir, val_fraction=0.0, seq_len=1024, cache_dir=work / "cache",
                        num_proc=2)
    big.prepare_data()
    root = Path(PreparedSet.open(next(p for p in (work / "cache").glob("sft-*") if p != dm.prepared.root)).root)
    size_mib = sum(f.stat().st_size for f in (root / "train").rglob("*.arrow")) / 2**20
    mapped, copied = _two_ranks(root, copy=False), _two_ranks(root, copy=True)
    results["memory"] = {"set_mib": size_mib, "samples": n_mem, "tokens": mapped[0]["tokens"],
                         "mapped": mapped, "copied": copied,
                         "mapped_over_copied_rss_anon": max(r["rss_anon_mib"] for r in mapped)
                         / max(r["rss_anon_mib"] for r in copied)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sft_data.json").write_text(json.dumps(results, indent=2))
    t, ld, m = results["tokenize"], results["loader"], results["memory"]
    table = f"""# Fine-tuning data (`python benchmarks/sft_data.py`, 2 CPU cores)

| figure | ours | peer | ratio |
|---|---:|---:|---:|
| tokenize {n_tok} chat samples (labels found from the template) | {t['ours_s']:.2f} s ({t['ours_samples_per_s']:.0f} samples/s, Arrow written) | {t['plain_apply_chat_template_s']:.2f} s (`apply_chat_template` loop, no labels) | {t['ratio']:.2f}× |
| loader time per packed batch {ld['batch']} vs the training step of a {ld['model_params'] / 1e6:.1f}M Llama | {ld['loader_s_per_batch'] * 1e3:.2f} ms | {ld['step_s'] * 1e3:.1f} ms | {ld['loader_over_step']:.3f}× |
| private memory per rank (RssAnon) reading a {m['set_mib']:.0f} MiB set ({m['tokens'] / 1e6:.1f}M tokens), 2 ranks | {max(r['rss_anon_mib'] for r in m['mapped']):.0f} MiB (memory-mapped) | {max(r['rss_anon_mib'] for r in m['copied']):.0f} MiB (rows copied into lists) | {m['mapped_over_copied_rss_anon']:.3f}× |
| proportional share of mapped pages per rank (Pss) | {max(r['pss_mib'] for r in m['mapped']):.0f} MiB | {max(r['pss_mib'] for r in m['copied']):.0f} MiB | |
"""
    (args.out / "sft_data.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
