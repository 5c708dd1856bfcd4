"""``HeldOutAnswers``: what a fine-tune learnt, in the terms a user judges it by, at step 0 and at the end.

On the held-out (validation) set of the datamodule it measures:

- the per-token loss on the trained tokens (the answers), over every held-out row on every rank;
- greedy answers to the held-out questions through the model's chat template, scored against the references by
  ROUGE-L (torchmetrics) and exact match;
- a few questions answered before and after training, printed side by side.

The figures go into ``trainer.callback_metrics`` (``held_out_loss``, ``held_out_rougeL``, ``held_out_exact_match``
and their ``*_at_start``), hence into the job's ``summary.json``; the step-0 loss is also logged as ``val_loss`` at
step 0, so the validation curve starts where training does.

The answers come from the package's generation engine (:mod:`lightning_fsdp.generation`): each rank decodes its
share of the questions on the sharded model, batched and left-padded with a key/value cache when the module holds
a Hugging Face model (``pl_module.model``), and every rank gets every answer; rank 0 prints.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from typing_extensions import override

from lightning_fsdp.callbacks.held_out import BeforeAndAfter, Row, held_out_sums

__all__ = ["HeldOutAnswers", "greedy_answers", "held_out_loss"]


def _hf_model(pl_module: Any) -> Optional[Any]:
    model = getattr(pl_module, "model", None)
    return model if callable(getattr(model, "generate", None)) and hasattr(model, "config") else None


@torch.no_grad()
def greedy_answers(
    pl_module: Any, prompts: list[torch.Tensor], max_new_tokens: int, stop_ids: set[int], pad_id: int,
    batch_size: int = 32, rollout_mode: str = "auto", device: Optional[torch.device] = None,
) -> list[list[int]]:
    """Each prompt's greedy answer (token ids, stop token excluded), the same on every rank: each rank decodes its
    share of the prompts (:func:`~lightning_fsdp.generation.generate_on_ranks`)."""
    from lightning_fsdp.generation import Sampling, generate_on_ranks

    model = _hf_model(pl_module) or pl_module
    done = generate_on_ranks(pl_module, model, [p.tolist() for p in prompts],
                             Sampling(max_new_tokens, temperature=0.0, stop_ids=tuple(stop_ids)), pad_id=pad_id,
                             mode=rollout_mode, batch_size=batch_size, device=device)
    return [done.text_ids(i) for i in range(len(prompts))]


def held_out_loss(trainer: L.Trainer, pl_module: Any) -> Optional[float]:
    """The per-token loss over every held-out row of every rank (``pl_module.token_sums`` of each batch)."""
    if getattr(trainer, "datamodule", None) is None or not callable(getattr(pl_module, "token_sums", None)):
        return None

    def sums(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss_sum, tokens, _ = pl_module.token_sums(batch)
        return torch.stack([loss_sum.detach().double().cpu(), tokens.double().cpu()])

    total, count = held_out_sums(trainer, pl_module, sums, 2)
    return float(total / count.clamp(min=1))


class HeldOutAnswers(BeforeAndAfter):
    """Measure the held-out loss and answers at the start and end of fit, and show a few side by side.

    Args:
        count: held-out questions answered and scored (the first ``count`` of the validation set).
        max_new_tokens: the longest answer generated.
        show: questions printed with their reference and the answers before and after training.
        batch_size: questions generated at once.
        rollout_mode: how a sharded model is gathered while answering (:data:`~lightning_fsdp.generation.ROLLOUT_MODES`).
    """

    subject = "Held-out set"

    def __init__(self, count: int = 32, max_new_tokens: int = 48, show: int = 4, batch_size: int = 32,
                 rollout_mode: str = "auto") -> None:
        super().__init__(show)
        self.count, self.max_new_tokens, self.batch_size = count, max_new_tokens, batch_size
        self.rollout_mode = rollout_mode
        self.seconds: dict[str, float] = {}
        self._validated: Optional[tuple[int, float]] = None  # (step, val_loss) of Lightning's last validation

    @override
    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> Optional[tuple[dict[str, float], list[Row]]]:
        datamodule: Any = getattr(trainer, "datamodule", None)
        examples = datamodule.held_out_examples(self.count) if hasattr(datamodule, "held_out_examples") else []
        metrics: dict[str, float] = {}
        started = time.perf_counter()
        loss = self._validated_loss(trainer)
        if loss is None:
            loss = held_out_loss(trainer, pl_module)
        if loss is not None:
            metrics["loss"] = loss
        self.seconds = {"loss": time.perf_counter() - started}
        if not examples:
            return (metrics, []) if metrics else None
        tokenizer = datamodule.tokenizer
        stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
        pad_id = int(getattr(datamodule, "pad_id", tokenizer.pad_token_id or 0))
        ids = greedy_answers(pl_module, [p for p, _, _ in examples], self.max_new_tokens, stop_ids, pad_id,
                             self.batch_size, self.rollout_mode, trainer.strategy.root_device)
        texts = [datamodule.decode(a).strip() for a in ids]
        references = [reference.strip() for _, _, reference in examples]
        from torchmetrics.text import ROUGEScore

        rouge = ROUGEScore(rouge_keys=("rougeL",))(texts, references)
        metrics["rougeL"] = float(rouge["rougeL_fmeasure"])
        metrics["exact_match"] = sum(t == r for t, r in zip(texts, references)) / len(examples)
        rows = [(question, reference, text) for (_, question, reference), text in zip(examples, texts)]
        self.seconds["answers"] = time.perf_counter() - started - self.seconds["loss"]
        return metrics, rows

    @override
    def describe(self, metrics: dict[str, float], rows: list[Row]) -> str:
        figures = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        took = " + ".join(f"{what} {seconds:.1f} s" for what, seconds in self.seconds.items())
        return f"{figures} ({took})"

    @override
    def measured(self, trainer: L.Trainer, when: str, metrics: dict[str, float]) -> None:
        if when == "start" and "loss" in metrics:
            for logger in trainer.loggers:  # the validation curve's first point
                logger.log_metrics({"val_loss": metrics["loss"]}, step=0)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val_loss")
        self._validated = (trainer.global_step, float(value)) if value is not None else None

    def _validated_loss(self, trainer: L.Trainer) -> Optional[float]:
        """Lightning's ``val_loss`` when it was just computed over the whole held-out set at this very step (the
        same per-token mean ``held_out_loss`` computes), so the last validation is not run twice."""
        if self._validated is None or self._validated[0] != trainer.global_step or trainer.sanity_checking:
            return None
        whole = trainer.limit_val_batches == 1.0 and not isinstance(trainer.limit_val_batches, int)
        return self._validated[1] if whole else None
