"""A Hugging Face causal LM (any ``AutoModelForCausalLM`` directory) as a LightningModule, optionally with LoRA.

The model is built in ``configure_model`` from the directory's ``config.json``: under ``fsdp_custom`` that happens
with parameters on the meta device, and the strategy's ``pretrained_weights=<the same directory>`` reads each rank's
shards straight from the safetensors files. ``lora={...}`` wraps it with PEFT (``LoraConfig`` arguments); only the
adapters train. ``from_pretrained=True`` loads the weights with transformers instead (one process, or a reference).

Batches are ``(input_ids, targets)`` pairs of the same length (the package's text DataModules give them): the loss
is the mean next-token cross entropy.
"""

from __future__ import annotations

import warnings
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
        model: torch.nn.Module
        if h["from_pretrained"]:
            model = AutoModelForCausalLM.from_pretrained(str(h["model_dir"]), dtype=torch.get_default_dtype())
        else:
            config = AutoConfig.from_pretrained(str(h["model_dir"]))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
        if h["lora"]:
            from lightning_fsdp.sharding import nf4

            nf4.import_quietly()  # PEFT imports torchao when it is installed; without its CPU-only log lines
            from peft import LoraConfig, get_peft_model

            with warnings.catch_warnings():  # PEFT reads a property transformers has deprecated
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
                model = get_peft_model(model, LoraConfig(**dict(h["lora"])))
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return self.model(input_ids=input_ids).logits

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0
    ) -> Tensor:
        """Sample a continuation of ``prompt_ids`` ((T,) or (B, T)), as ``GPTLightningModule.generate`` does: every
        rank calls it (FSDP gathers parameters in each forward) and, with the same ``seed``, samples the same text."""
        from lightning_fsdp.models.gpt import reshard_gathered, sample_next

        device = self.trainer.strategy.root_device if self._trainer is not None else next(self.parameters()).device
        idx = prompt_ids.to(device).long()
        idx = idx[None] if idx.ndim == 1 else idx
        generator = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx)[:, -1, :].float()
                idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)
        finally:
            self.train(was_training)
            reshard_gathered(self)
        return idx

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=h["lr"], weight_decay=h["weight_decay"], betas=tuple(h["betas"]))


def _byte_characters() -> dict[int, str]:
    """The printable character a byte-level tokenizer uses for each byte (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Any:
    """A Hugging Face tokenizer whose ids are the UTF-8 bytes of the text (id ``b`` is byte ``b``): what the
    package's byte-level text DataModules feed, so an exported model tokenizes like it was trained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_characters().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def write_random_model(
    path: Union[str, Path], config: dict[str, Any], seed: int = 0, max_shard_size: str = "2MB"
) -> Path:
    """A freshly initialised causal LM (``config``: a HF config dict with ``model_type``) saved like a downloaded
    one: safetensors shards with an index, ``config.json``, and a byte-level tokenizer when the vocabulary is 256.
    Written to a hidden sibling and renamed into place, so a half-written directory never looks like a model."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    settings = dict(config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    if hf_config.vocab_size == 256:
        byte_tokenizer().save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path
