"""Preference tuning (DPO, SimPO) of a Hugging Face causal LM, fully sharded: :class:`HFPreferenceLM`.

The reference model of DPO costs nothing under LoRA (and QLoRA): it is the same sharded base with the adapters
switched off (PEFT's ``disable_adapter``), run without gradients in the same step. No second copy exists, so the
planner's parameter bytes do not change; each step pays one more forward. A full fine-tune's reference is a frozen
copy sharded like the model (1/N of its bytes per rank), and either can be precomputed once before training instead
(:mod:`lightning_fsdp.models.reference`). SimPO needs no reference at all.

Batches come from :class:`~lightning_fsdp.data.PreferenceDataModule`: ``2B`` rows, chosen first, ``labels`` on
the completions, ``pair_mask`` 0 on padding pairs. The step's gradient is that of Σ pair losses / the global count
of pairs (:class:`~lightning_fsdp.loss.TokenWeightedLoss` with pairs as the unit), so it is the same at any world
size and ``accumulate_grad_batches``.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_fsdp.loss.chunked import DEFAULT_CHUNK_TOKENS, sequence_log_probs
from lightning_fsdp.loss.preference import PREFERENCE_LOSSES, PairScores, preference_loss
from lightning_fsdp.models.hf_causal_lm import HFCausalLM
from lightning_fsdp.models.metrics import ValidationMetrics
from lightning_fsdp.models.reference import (
    CHECKPOINT_KEY,
    REFERENCE_MODES,
    ReferenceModel,
    check_resumed_reference,
    frozen_copy,
    precompute_reference,
    reference_model_key,
)

__all__ = ["HFPreferenceLM"]

#: what is logged per pair, train_* (this rank's micro-batch) and val_* (every held-out pair, all ranks)
PAIR_METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logps", "rejected_logps")


def _pair_values(scores: PairScores) -> dict[str, Tensor]:
    return {"reward_accuracy": scores.accuracies, "reward_margin": scores.margins,
            "chosen_reward": scores.chosen_rewards, "rejected_reward": scores.rejected_rewards,
            "chosen_logps": scores.chosen_logps, "rejected_logps": scores.rejected_logps}


class HFPreferenceLM(HFCausalLM):
    """Align the causal LM in ``model_dir`` on preference pairs.

    Args:
        model_dir, lora, from_pretrained, lr, weight_decay, betas, tokenizer, loss_chunk: as
            :class:`~lightning_fsdp.models.HFCausalLM`. ``model_dir`` is usually the SFT model to align.
        loss: ``"dpo"`` (sigmoid, against a reference model) or ``"simpo"`` (reference-free).
        reference: DPO's reference (:data:`~lightning_fsdp.models.reference.REFERENCE_MODES`): ``"adapters_off"``
            (LoRA: the base with the adapters switched off), ``"copy"`` (a frozen sharded copy of ``model_dir``) or
            ``"precomputed"`` (scored once before training, cached beside the prepared pairs); ``None``:
            ``"adapters_off"`` with ``lora``, else ``"copy"``.
        beta: β of the loss (DPO's KL strength; SimPO's reward scale).
        simpo_gamma: SimPO's target reward margin γ.
    """

    def __init__(
        self,
        model_dir: Union[str, Path],
        lora: Optional[dict[str, Any]] = None,
        loss: str = "dpo",
        reference: Optional[str] = None,
        beta: float = 0.1,
        simpo_gamma: float = 0.5,
        from_pretrained: bool = False,
        lr: float = 5e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        tokenizer: Optional[Union[str, Path]] = None,
        loss_chunk: Optional[int] = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        if loss not in PREFERENCE_LOSSES:
            raise ValueError(f"loss={loss!r} is not one of {sorted(PREFERENCE_LOSSES)}.")
        if reference is not None and reference not in REFERENCE_MODES:
            raise ValueError(f"reference={reference!r} is not one of {REFERENCE_MODES} (or None to choose).")
        if reference is not None and not PREFERENCE_LOSSES[loss]:
            raise ValueError(f"loss={loss!r} needs no reference model: drop reference={reference!r}.")
        if reference == "adapters_off" and not lora:
            raise ValueError(
                "reference='adapters_off' is the base model with the LoRA adapters switched off: pass lora={...}"
                " (model.lora), or reference='copy' (a frozen sharded copy) or 'precomputed' for a full fine-tune."
            )
        if beta <= 0:
            raise ValueError(f"beta={beta} must be positive.")
        from lightning_fsdp.hf.gguf import resolve_model_source

        model_dir = resolve_model_source(model_dir)  # here too: the hyperparameters are read from this frame as well
        super().__init__(model_dir, lora=lora, from_pretrained=from_pretrained, lr=lr, weight_decay=weight_decay,
                         betas=betas, tokenizer=tokenizer, loss_chunk=loss_chunk)
        self._pair_metrics = ValidationMetrics.named(loss=MeanMetric(), **{k: MeanMetric() for k in PAIR_METRICS})
        self._precomputed: Optional[dict[str, str]] = None  # which precomputed reference this run trains against
        self._resumed_from: Optional[dict[str, str]] = None  # ... and which one a checkpoint being resumed had

    @property
    def reference_mode(self) -> Optional[str]:
        """How the reference log-probabilities are made (``None``: the loss needs none)."""
        h = self.hparams
        if not PREFERENCE_LOSSES[h["loss"]]:
            return None
        return h.get("reference") or ("adapters_off" if h["lora"] else "copy")

    def _frozen_reference(self) -> ReferenceModel:
        """The frozen copy (``reference="copy"``), built on first use. Kept outside the module tree: no optimizer,
        checkpoint, export or weight average sees it."""
        reference = self.__dict__.get("_reference_copy")
        if reference is None:
            chunk = self.hparams.get("loss_chunk") or DEFAULT_CHUNK_TOKENS
            reference = frozen_copy(self.hparams["model_dir"], chunk, self.trainer.strategy)
            self.__dict__["_reference_copy"] = reference
        return reference

    def _prepare_reference(self) -> None:
        """Build the frozen copy, or attach the precomputed log-probabilities (computing them on the first run):
        every rank, before the first step, outside any step's forward."""
        mode = self.reference_mode
        if mode == "copy":
            self._frozen_reference()
        elif mode == "precomputed" and self._precomputed is None:
            self._precompute()

    def _precompute(self) -> None:
        from lightning_fsdp.generation import in_root_forward

        trainer = self.trainer
        datamodule: Any = getattr(trainer, "datamodule", None)
        if datamodule is None or not callable(getattr(datamodule, "reference_cache", None)):
            raise ValueError("reference='precomputed' stores the reference log-probabilities with the prepared pairs:"
                             " train with a PreferenceDataModule (data=preference).")
        if trainer.ckpt_path and not trainer.strategy.restore_checkpoint_after_setup and not self.hparams["lora"]:
            raise ValueError("reference='precomputed' scores with the full fine-tune's model before it is restored"
                             " from a checkpoint; this strategy restores it first. Use fsdp_custom, or reference='copy'.")
        datamodule.setup("fit")
        key = reference_model_key(self.hparams["model_dir"], trainer)

        def score(batch: dict[str, Tensor]) -> Tensor:
            # LoRA: the base with the adapters off; a full fine-tune: the model itself, before its first step.
            # No gradients, the root's FSDP hooks around it.
            adapters = bool(self.hparams["lora"])
            return in_root_forward(self, lambda: self.sequence_log_probs(batch, reference=adapters)[0])

        path = precompute_reference(trainer, datamodule, key, score)
        self._precomputed = {"pairs": datamodule.prepared_dir.name, "model": key, "file": path.name}
        check_resumed_reference(self._resumed_from, self._precomputed)

    @override
    def on_fit_start(self) -> None:
        self._prepare_reference()

    on_validation_start = on_fit_start  # a validate-only run needs the reference too

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._precomputed is not None:
            checkpoint[CHECKPOINT_KEY] = dict(self._precomputed)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # restored before or after on_fit_start, as the strategy restores: checked where both are known
        self._resumed_from = checkpoint.get(CHECKPOINT_KEY)
        check_resumed_reference(self._resumed_from, self._precomputed)

    # -- log-probabilities -----------------------------------------------------------------------------------------
    def sequence_log_probs(self, batch: dict[str, Tensor], *, reference: bool = False) -> tuple[Tensor, Tensor]:
        """Each row's summed completion log-probability and completion length; ``reference=True``: of the base
        model (adapters off, no gradients)."""
        chunk = self.hparams.get("loss_chunk") or DEFAULT_CHUNK_TOKENS
        with self._adapters_off() if reference else nullcontext():
            hidden, head = self._hidden_states(batch["input_ids"], attention_mask=batch["attention_mask"])
            return sequence_log_probs(hidden, head, batch["labels"], chunk_tokens=chunk)

    def _adapters_off(self) -> Any:
        from contextlib import ExitStack

        peft_model: Any = self.model
        assert peft_model is not None
        stack = ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(peft_model.disable_adapter())  # PEFT: the base model, the adapters bypassed
        return stack

    def reference_log_probs(self, batch: dict[str, Tensor]) -> Tensor:
        """Each row's completion log-probability under the reference model, however it is made."""
        mode = self.reference_mode
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if mode == "precomputed":
            raise RuntimeError("reference='precomputed': this batch carries no reference log-probabilities; they are"
                               " attached to the PreferenceDataModule's sets when fit or validation starts.")
        if mode == "copy":
            return self._frozen_reference().score(batch)
        return self.sequence_log_probs(batch, reference=True)[0]

    def pair_scores(self, batch: dict[str, Tensor]) -> PairScores:
        h = self.hparams
        reference = self.reference_log_probs(batch) if self.reference_mode else None
        logps, counts = self.sequence_log_probs(batch)
        if reference is not None:
            reference = reference.to(logps)
        return preference_loss(h["loss"], logps, counts, reference, beta=h["beta"], simpo_gamma=h["simpo_gamma"])

    # -- steps -----------------------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        scores = self.pair_scores(batch)
        mask = batch["pair_mask"].to(scores.losses)
        pairs = mask.sum()
        for name, values in _pair_values(scores).items():
            self.log(f"train_{name}", (values * mask).sum() / pairs.clamp(min=1), batch_size=int(pairs))
        # Σ pair losses; the step divides by the global count of pairs (on_before_optimizer_step)
        return self.token_loss.add((scores.losses * mask).sum(), pairs)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        scores = self.pair_scores(batch)
        mask = batch["pair_mask"].to(scores.losses)
        weight = mask.sum()
        if weight == 0:
            return
        metrics = self._pair_metrics.on(scores.losses.device)
        metrics["loss"].update((scores.losses * mask).sum() / weight, weight)
        for name, values in _pair_values(scores).items():
            metrics[name].update((values * mask).sum() / weight, weight)

    @override
    def on_validation_epoch_end(self) -> None:
        values = self._pair_metrics.compute_and_reset()  # pair-weighted means over every rank (a collective)
        self.log_dict({f"val_{k}": v for k, v in values.items()}, prog_bar=False, sync_dist=True)
