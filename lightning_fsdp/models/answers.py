"""``HeldOutAnswers``: held-out prompts answered by the model through its chat template, before and after training.

A callback, so any fine-tuning job shows what it learnt in the terms a user judges it by: the prompts of the
validation set, each answered greedily and printed next to its reference, with the exact-match rate at step 0 and
at the end (logged as ``held_out_exact_match``). Every rank generates (FSDP gathers the parameters in each
forward); rank 0 prints.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["HeldOutAnswers", "answer"]


def answer(model: Any, prompt_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The greedy continuation of ``prompt_ids`` up to a stop token (excluded) or ``max_new_tokens``."""
    out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stop_ids)
    new = out[0, prompt_ids.numel():].tolist()
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[:i]
    return new


class HeldOutAnswers(Callback):
    """Answer ``count`` held-out prompts of the datamodule (its ``held_out_examples``) at the start and end of fit.

    Args:
        count: prompts to answer.
        max_new_tokens: the longest answer generated.
    """

    def __init__(self, count: int = 8, max_new_tokens: int = 32) -> None:
        self.count, self.max_new_tokens = count, max_new_tokens
        self.results: dict[str, float] = {}

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> Optional[float]:
        datamodule: Any = getattr(trainer, "datamodule", None)
        examples = datamodule.held_out_examples(self.count) if hasattr(datamodule, "held_out_examples") else []
        if not examples or not callable(getattr(pl_module, "generate", None)):
            return None
        tokenizer = datamodule.tokenizer
        stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
        rows, exact = [], 0
        for prompt_ids, question, reference in examples:
            text = datamodule.decode(answer(pl_module, prompt_ids, self.max_new_tokens, stop_ids)).strip()
            exact += text == reference.strip()
            rows.append((question[:60], reference.strip(), text))
        rate = exact / len(examples)
        self.results[when] = rate
        if trainer.is_global_zero:
            lines = [f"Held-out answers {when} (exact match {exact}/{len(examples)} = {rate:.0%}):"]
            lines += [f"  {'ok ' if ref == got else '   '}{prompt!r:64} reference {ref!r:30} model {got!r}"
                      for prompt, ref, got in rows]
            print("\n".join(lines), flush=True)
        return rate

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluate(trainer, pl_module, "at step 0")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rate = self._evaluate(trainer, pl_module, f"after {trainer.global_step} steps")
        if rate is not None:
            trainer.callback_metrics["held_out_exact_match"] = torch.tensor(rate)
