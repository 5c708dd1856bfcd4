"""Loaders and scoring of the package's own lm-eval tasks (read by lm-eval through ``!function`` in their YAML).

The rows (``python_docs.jsonl``) are held-out standard-library functions of the main job's data, none of which it
trains on (:func:`lightning_fsdp.data.sft.stdlib_docs.held_out_eval_rows`), stored here so the tasks need no network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROWS = Path(__file__).with_name("python_docs.jsonl")


def python_docs(**_: Any) -> Any:
    """The rows as a ``datasets.DatasetDict`` with one ``test`` split."""
    import datasets

    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def rouge_l(references: list[str], predictions: list[str]) -> float:
    """ROUGE-L F-measure of one answer against its reference (stemmed, as torchmetrics and rouge-score do)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(scorer.score(references[0], predictions[0])["rougeL"].fmeasure)


def answer_scores(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The generated answer against the docstring: exact match (stripped) and ROUGE-L."""
    answer, reference = results[0].strip(), doc["answer"].strip()
    return {"exact_match": float(answer == reference), "rougeL": rouge_l([reference], [answer])}
