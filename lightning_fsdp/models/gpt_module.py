"""``GPTLightningModule``: the GPT decoder of :mod:`.gpt` trained with next-token cross-entropy, AdamW and warmup +
cosine decay, validated with torchmetrics, and sampled from after training."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_fsdp.generation import reshard_gathered
from lightning_fsdp.loss import check_chunk_tokens, chunked_causal_lm_eval, chunked_causal_lm_loss
from lightning_fsdp.models.gpt import GPT
from lightning_fsdp.models.gpt_config import GPTConfig, count_params, get_preset
from lightning_fsdp.models.metrics import ValidationMetrics

__all__ = ["GPTLightningModule", "lr_multiplier", "sample_next"]


class GPTLightningModule(L.LightningModule):
    """GPT decoder LM trained with next-token cross-entropy, AdamW and warmup + cosine decay.

    Args:
        vocab_size, n_layer, n_head, d_model, seq_len, mlp_ratio, dropout, tie_weights: the :class:`GPTConfig`.
        lr: peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW decay, applied to matrices (the tied embedding included), not to norm weights.
        betas: AdamW betas.
        warmup_steps: linear warmup length in optimizer steps.
        max_steps: length of the cosine decay; ``None`` uses ``trainer.estimated_stepping_batches``.
        min_lr_ratio: the learning rate decays to ``lr * min_lr_ratio``.
        loss_chunk: tokens per chunk of the loss (:func:`~lightning_fsdp.loss.chunked_causal_lm_loss`), so the whole
            logits never exist (long contexts, wide vocabularies); ``None`` (the default: a byte vocabulary's logits
            are small) computes them whole.

    Logs ``train_loss``/``train_ppl``/``train_acc`` every step (averaged over ranks; ``train_acc`` needs the whole
    logits, so not with ``loss_chunk``) and ``val_loss``/``val_ppl``/``val_acc`` per validation run (torchmetrics,
    synchronised across ranks on ``compute``).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 6,
        n_head: int = 8,
        d_model: int = 256,
        seq_len: int = 256,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = True,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        loss_chunk: Optional[int] = None,
    ) -> None:
        super().__init__()
        if loss_chunk is not None:
            check_chunk_tokens(loss_chunk)
        self.save_hyperparameters()
        self.config = GPTConfig(vocab_size, n_layer, n_head, d_model, seq_len, mlp_ratio, dropout, tie_weights)
        self.net: Optional[GPT] = None
        self.loss_chunk = loss_chunk
        # outside the module tree: see metrics.py. Chunked, the perplexity is exp(the token-mean loss), which equals
        # torchmetrics' Perplexity over the whole logits
        self._val_metrics = (
            ValidationMetrics(vocab_size, perplexity=True) if loss_chunk is None
            else ValidationMetrics.named(loss=MeanMetric(), acc=MeanMetric())
        )

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> GPTLightningModule:
        """``GPTLightningModule.from_preset("gpt-5m", lr=3e-4)``; shape fields in ``kwargs`` override the preset."""
        shape = {k: kwargs.pop(k) for k in list(kwargs) if k in GPTConfig.__dataclass_fields__}
        return cls(**asdict(get_preset(name, **shape)), **kwargs)

    @property
    def num_params(self) -> int:
        return count_params(self.config)

    def configure_model(self) -> None:
        """Build the network (on the meta device under a sharded strategy); idempotent."""
        if self.net is None:
            self.net = GPT(self.config)

    def forward(self, idx: Tensor) -> Tensor:
        if self.net is None:
            self.configure_model()
        assert self.net is not None
        return self.net(idx)

    def _shared_step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        return loss, logits, y

    def _network(self) -> GPT:
        if self.net is None:
            self.configure_model()
        assert self.net is not None
        return self.net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        from torchmetrics.functional.classification import multiclass_accuracy

        if self.loss_chunk is not None:
            net = self._network()
            total, count = chunked_causal_lm_loss(
                net.hidden_states(batch[0]), net.project, batch[1], chunk_tokens=self.loss_chunk, shift=False
            )
            loss = total / count  # every rank has the same number of target tokens, so rank means average exactly
            mean = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            self.log("train_loss", mean, prog_bar=True)
            self.log("train_ppl", mean.exp())
            return loss
        loss, logits, y = self._shared_step(batch)
        acc = multiclass_accuracy(logits.detach().argmax(-1), y, self.config.vocab_size, average="micro")
        # one all-reduce for both values; every rank sees the same tokens-per-batch, so a mean is exact
        stats = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc.to(loss.dtype)]), reduce_op="mean")
        self.log("train_loss", stats[0], prog_bar=True)
        self.log("train_ppl", stats[0].exp())
        self.log("train_acc", stats[1])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if self.loss_chunk is not None:
            net = self._network()
            total, count, correct = chunked_causal_lm_eval(
                net.hidden_states(batch[0]), net.project, batch[1], chunk_tokens=self.loss_chunk, shift=False
            )
            metrics = self._val_metrics.on(total.device)
            metrics["loss"].update(total / count, weight=count)
            metrics["acc"].update(correct / count, weight=count)
            return
        loss, logits, y = self._shared_step(batch)
        metrics = self._val_metrics.on(logits.device)
        metrics["loss"].update(loss.detach(), weight=y.numel())
        metrics["ppl"].update(logits.detach().float(), y)
        metrics["acc"].update(logits.detach().argmax(-1), y)

    def on_validation_epoch_end(self) -> None:
        values = self._val_metrics.compute_and_reset()  # collective: syncs ranks
        if "ppl" not in values:
            values["ppl"] = values["loss"].exp()
        self.log("val_loss", values["loss"], prog_bar=True, sync_dist=True)
        self.log("val_ppl", values["ppl"], sync_dist=True)
        self.log("val_acc", values["acc"], sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        h = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": h["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=h["lr"],
            betas=tuple(h["betas"]),
        )
        total = h["max_steps"] if h["max_steps"] else self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 10**9
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, h["warmup_steps"], total, h["min_lr_ratio"])
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        seed: int = 0,
    ) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``prompt_ids`` ((T,) or (B, T)); returns prompt + new ids.

        Each step runs through the module's ``__call__``, so under FSDP2 the root and block hooks all-gather the
        parameters as in training: call it on every rank (the same number of steps everywhere). With the same
        ``seed`` every rank samples the same text. ``temperature=0`` is greedy decoding.
        """
        device = self._compute_device()
        idx = prompt_ids.to(device).long()
        if idx.ndim == 1:
            idx = idx[None]
        if idx.shape[1] == 0:
            raise ValueError("generate() needs a prompt of at least one token.")
        generator = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.config.seq_len :])[:, -1, :].float()
                idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)
        finally:
            self.train(was_training)
            reshard_gathered(self)
        return idx

    def _compute_device(self) -> torch.device:
        """Where the forward runs: the strategy's device for a sharded module (its parameters may be offloaded to
        the CPU), else wherever the parameters are (e.g. moved back to the CPU by another strategy's teardown)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self, FSDPModule) and self._trainer is not None:
            return self.trainer.strategy.root_device
        if self.net is None:
            self.configure_model()
        return next(self.parameters()).device


def sample_next(logits: Tensor, temperature: float, top_k: Optional[int], generator: torch.Generator) -> Tensor:
    """One token id per row of ``logits`` (B, V): greedy at ``temperature <= 0``, else top-k sampling."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps`` (and flat after it)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
