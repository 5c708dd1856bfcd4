"""A Hugging Face causal LM (any ``AutoModelForCausalLM`` directory) as a LightningModule, optionally with LoRA.

The model is built in ``configure_model`` from the directory's ``config.json``: under ``fsdp_custom`` that happens
with parameters on the meta device, and the strategy's ``pretrained_weights=<the same directory>`` reads each rank's
shards straight from the safetensors files. ``lora={...}`` wraps it with PEFT (``LoraConfig`` arguments); only the
adapters train. ``from_pretrained=True`` loads the weights with transformers instead (one process, or a reference).

Batches are either dicts from :class:`~lightning_fsdp.data.SFTDataModule` (``input_ids``, ``labels`` aligned with
them and ``-100`` where nothing is trained, and ``position_ids`` for packed rows or ``attention_mask`` for padded
ones), or ``(input_ids, targets)`` pairs of next-token targets (the byte-level text DataModules). Either way the
step's gradient is that of Σ token losses / Σ target tokens over every micro-batch on every rank
(:class:`~lightning_fsdp.loss.TokenWeightedLoss`), and ``train_loss`` is that per-token mean. Validation logs the
per-token ``val_loss``, its perplexity ``val_ppl`` and ``val_token_accuracy`` (argmax = label on trained tokens).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_fsdp.hf.ring_attention import RING_ATTENTION
from lightning_fsdp.loss import (
    DEFAULT_CHUNK_TOKENS,
    TokenWeightedLoss,
    causal_lm_token_loss,
    check_chunk_tokens,
    chunked_causal_lm_eval,
    chunked_causal_lm_loss,
    gradient_divisor,
)
from lightning_fsdp.models.metrics import ValidationMetrics
from lightning_fsdp.parallel.sequence import SHIFTED_LABELS, active_split

#: attention implementations that keep packed samples apart from restarting ``position_ids`` alone
PACKING_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", RING_ATTENTION)

__all__ = ["HFCausalLM", "hidden_states_and_head"]


class HFCausalLM(L.LightningModule):
    """Fine-tune the causal LM in ``model_dir``.

    Args:
        model_dir: a Hugging Face model directory (``config.json`` + safetensors weights), or a ``.gguf`` file
            (converted once into a cached directory: :mod:`lightning_fsdp.hf.gguf`).
        lora: ``peft.LoraConfig`` arguments (e.g. ``{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj",
            "v_proj"]}``), or ``None`` for a full fine-tune.
        from_pretrained: load the weights in ``configure_model`` with ``AutoModelForCausalLM.from_pretrained``
            (without a sharded strategy's ``pretrained_weights``).
        lr, weight_decay, betas: AdamW over the trainable parameters.
        tokenizer: the tokenizer the data is encoded with (a directory); checked to fit the model's embedding
            when the module is made, before any process starts.
        loss_chunk: tokens per chunk of the loss (:func:`~lightning_fsdp.loss.chunked_causal_lm_loss`): the
            output projection and cross entropy run a chunk at a time, so the whole logits never exist; ``None``
            computes the whole logits (``self.model(input_ids=x).logits``).
    """

    def __init__(
        self,
        model_dir: Union[str, Path],
        lora: Optional[dict[str, Any]] = None,
        from_pretrained: bool = False,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        tokenizer: Optional[Union[str, Path]] = None,
        loss_chunk: Optional[int] = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        super().__init__()
        if loss_chunk is not None:
            check_chunk_tokens(loss_chunk)
        from lightning_fsdp.hf.gguf import resolve_model_source

        model_dir = resolve_model_source(model_dir)  # a .gguf file: converted once into a cached HF directory
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None
        if tokenizer is not None:
            _check_tokenizer_fits(Path(resolve_model_source(tokenizer)), Path(model_dir))
        self.token_loss = TokenWeightedLoss()
        # token-weighted means, kept outside the module tree (see models/metrics.py)
        self._val_metrics = ValidationMetrics.named(loss=MeanMetric(), accuracy=MeanMetric())

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

    def forward(self, input_ids: Tensor, **inputs: Any) -> Tensor:
        """The logits for ``input_ids`` (``position_ids`` / ``attention_mask`` passed through)."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        if "position_ids" in inputs and "attention_mask" not in inputs:
            self._check_packing_attention()
        return self.model(input_ids=input_ids, use_cache=False, **inputs).logits

    def token_sums(self, batch: Union[dict[str, Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """``(Σ token losses, target tokens, correctly predicted target tokens)`` of a batch; the last is computed
        only outside training (``-1`` while gradients are recorded)."""
        if isinstance(batch, dict) and SHIFTED_LABELS in batch:  # a context-parallel rank's part: targets shifted already
            inputs = {"position_ids": batch["position_ids"]}
            input_ids, labels, shift = batch["input_ids"], batch[SHIFTED_LABELS], False
        elif isinstance(batch, dict):
            inputs = {k: batch[k] for k in ("position_ids", "attention_mask") if k in batch}
            input_ids, labels, shift = batch["input_ids"], batch["labels"], True
        else:
            inputs, (input_ids, labels), shift = {}, batch, False
            split = active_split()
            if split is not None:  # a context-parallel rank's chunks: rotary tables at the tokens' global positions
                inputs["position_ids"] = split.layout.local_positions(input_ids.shape[1], input_ids.device).expand_as(input_ids)
        chunk = self.hparams.get("loss_chunk")
        if chunk:
            hidden, head = self._hidden_states(input_ids, **inputs)
            if torch.is_grad_enabled():
                total, count = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=chunk, shift=shift)
                return total, count, count.new_full((), -1)
            return chunked_causal_lm_eval(hidden, head, labels, chunk_tokens=chunk, shift=shift)
        logits = self(input_ids, **inputs)
        total, count = causal_lm_token_loss(logits, labels, shift=shift)
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        correct = ((logits.argmax(-1) == labels) & (labels != -100)).sum()
        return total, count, correct

    def _hidden_states(self, input_ids: Tensor, **inputs: Any) -> tuple[Tensor, torch.nn.Module]:
        """The decoder's final hidden states and the output projection, for the chunked loss."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        if "position_ids" in inputs and "attention_mask" not in inputs:
            self._check_packing_attention()
        return hidden_states_and_head(self.model, input_ids, **inputs)

    def loss(self, batch: Union[dict[str, Tensor], tuple[Tensor, Tensor]]) -> Tensor:
        """The batch's mean loss per target token."""
        total, count, _ = self.token_sums(batch)
        return total / count.clamp(min=1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        total, count, _ = self.token_sums(batch)
        return self.token_loss.add(total, count)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.token_loss.pending:
            mean = self.token_loss.finish_step(self.parameters(), gradient_divisor(self.trainer))
            self.log("train_loss", mean, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        total, count, correct = self.token_sums(batch)
        weight = count.float()
        metrics = self._val_metrics.on(total.device)
        metrics["loss"].update(total / weight.clamp(min=1), weight)
        metrics["accuracy"].update(correct.float() / weight.clamp(min=1), weight)

    @override
    def on_validation_epoch_end(self) -> None:
        values = self._val_metrics.compute_and_reset()  # per-token means over every rank's tokens (a collective)
        metrics = {"val_loss": values["loss"], "val_ppl": values["loss"].exp(), "val_token_accuracy": values["accuracy"]}
        self.log_dict(metrics, prog_bar=True, sync_dist=True)  # equal on every rank already: the mean is the value

    def _check_packing_attention(self) -> None:
        config = getattr(self.model, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is not None and implementation not in PACKING_ATTENTION:
            raise ValueError(
                f"Packed batches need an attention implementation that keeps samples apart ({PACKING_ATTENTION});"
                f" this model uses {implementation!r}. Set attn_implementation, or packing=False in the data."
            )

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
        seed: int = 0, stop_ids: Optional[set[int]] = None,
    ) -> Tensor:
        """Sample a continuation of ``prompt_ids`` ((T,) or (B, T)) with the package's generation engine and a
        key/value cache: every rank calls it (a sharded model streams its units, the ranks in step) and, with the
        same ``seed``, samples the same text. Returns prompt + new tokens; a row that stopped early (at one of
        ``stop_ids``) is padded with its stop token."""
        from lightning_fsdp.generation import Sampling, generate, in_root_forward, rollout_gathering

        device = self.trainer.strategy.root_device if self._trainer is not None else next(self.parameters()).device
        idx = prompt_ids.long()
        idx = idx[None] if idx.ndim == 1 else idx
        sampling = Sampling(max_new_tokens, temperature=temperature, top_k=top_k or 0,
                            stop_ids=tuple(stop_ids or ()), seed=seed)
        if self.model is None:
            self.configure_model()
        model = self.model
        assert model is not None

        def work() -> Any:
            with rollout_gathering(self, "stream") as gathering:
                return generate(model, idx.tolist(), sampling, pad_id=0, device=device,
                                synchronized=gathering.synchronized)

        done = in_root_forward(self, work)
        longest = max(len(row) for row in done.ids)
        rows = [row + row[-1:] * (longest - len(row)) for row in done.ids]
        return torch.cat([idx.to(device), torch.tensor(rows, dtype=torch.long, device=device)], dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        # the fused kernel (one pass per tensor, CPU and CUDA), as transformers' Trainer picks by default: 0.16 s
        # against the per-tensor loop's 0.59 s for 134M parameters on one CPU thread
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return torch.optim.AdamW(params, lr=h["lr"], weight_decay=h["weight_decay"], betas=tuple(h["betas"]),
                                 fused=fused or None)


def hidden_states_and_head(model: torch.nn.Module, input_ids: Tensor, **inputs: Any) -> tuple[Tensor, torch.nn.Module]:
    """``model``'s final hidden states for ``input_ids`` and its output projection, called apart so a chunked loss
    never builds the whole logits (a PEFT model: its base, adapters injected)."""
    get_base = getattr(model, "get_base_model", None)
    base: Any = get_base() if callable(get_base) else model
    head, decoder = base.get_output_embeddings(), base.get_decoder()
    config = getattr(base, "config", None)
    scaled = [k for k in ("final_logit_softcapping", "logit_scale") if getattr(config, k, None) not in (None, 1.0)]
    if head is None or decoder is None or decoder is base or scaled:
        why = f"its logits are transformed after the projection ({scaled})" if scaled else "it has no output projection and decoder to call apart"
        raise ValueError(f"{type(base).__name__} cannot use the chunked loss: {why}. Pass loss_chunk=None"
                         " (model.loss_chunk=null) to compute the whole logits.")
    hidden = decoder(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state
    return hidden, head


def _check_tokenizer_fits(tokenizer_dir: Path, model_dir: Path) -> None:
    from transformers import AutoConfig

    from lightning_fsdp.data.sft import check_vocabulary, load_tokenizer

    config = AutoConfig.from_pretrained(str(model_dir))
    vocab = getattr(config.get_text_config(), "vocab_size", None) or 0
    check_vocabulary(load_tokenizer(tokenizer_dir), int(vocab), str(model_dir))


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
    one: safetensors shards with an index, ``config.json``, and a tokenizer: ``config["tokenizer"]`` (a tokenizer
    directory, whose size sets the vocabulary), or a byte-level one when the vocabulary is 256.
    Written to a hidden sibling and renamed into place, so a half-written directory never looks like a model."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    settings = dict(config)
    tokenizer = None
    if settings.get("tokenizer"):
        from lightning_fsdp.data.sft import load_tokenizer

        tokenizer = load_tokenizer(settings.pop("tokenizer"))
        settings["vocab_size"] = len(tokenizer)
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            settings.setdefault(name, getattr(tokenizer, name))
    settings.pop("tokenizer", None)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    elif hf_config.vocab_size == 256:
        byte_tokenizer().save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path
