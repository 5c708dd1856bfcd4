"""A Hugging Face causal LM (any ``AutoModelForCausalLM`` directory) as a LightningModule, optionally with LoRA.

The model is built in ``configure_model`` from the directory's ``config.json``: under ``fsdp_custom`` that happens
with parameters on the meta device, and the strategy's ``pretrained_weights=<the same directory>`` reads each rank's
shards straight from the safetensors files. ``lora={...}`` wraps it with PEFT (``LoraConfig`` arguments); only the
adapters train. ``from_pretrained=True`` loads the weights with transformers instead (one process, or a reference).

Batches are ``(input_ids, targets)`` pairs of the same length (the package's text DataModules give them): the loss
is the mean next-token cross entropy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["HFCausalLM"]


class HFCausalLM(L.LightningModule):
    """Fine-tune the causal LM in ``model_dir``.

    Args:
        model_dir: a Hugging Face model directory (``config.json`` + safetensors weights).
        lora: ``peft.LoraConfig`` arguments (e.g. ``{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj",
            "v_proj"]}``), or ``None`` for a full fine-tune.
        from_pretrained: load the weights in ``configure_model`` with ``AutoModelForCausalLM.from_pretrained``
            (without a sharded strategy's ``pretrained_weights``).
        lr, weight_decay, betas: AdamW over the trainable parameters.
    """

    def __init__(
        self,
        model_dir: Union[str, Path],
        lora: Optional[dict[str, Any]] = None,
        from_pretrained: bool = False,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    def configure_model(self) -> None:
        """Build the network (parameters on the meta device under a sharded strategy); idempotent."""
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        h = self.hparams
        if h.from_pretrained:
            model = AutoModelForCausalLM.from_pretrained(str(h.model_dir), dtype=torch.get_default_dtype())
        else:
            config = AutoConfig.from_pretrained(str(h.model_dir))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
        if h.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**dict(h.lora)))
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return self.model(input_ids=input_ids, use_cache=False).logits

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=h.lr, weight_decay=h.weight_decay, betas=tuple(h.betas))
