"""DPO's reference model, three ways that give the same log-probabilities (:class:`HFPreferenceLM`'s ``reference``).

================  ====================================================================================================
``adapters_off``  LoRA/QLoRA: the sharded base with PEFT's adapters switched off, in the same step: no second copy,
                  one more forward per step
``copy``          a frozen second model built on the meta device and sharded like the trained one (each rank reads
                  only its shards of the base directory): 1/N of the model's bytes per rank, one more forward per step
``precomputed``   one pass before training scores every pair (with the adapters off, or the full fine-tune's model
                  before its first step) and stores the log-probabilities beside the prepared pairs: no reference
                  model in memory and no extra forward while training
================  ====================================================================================================

The precomputed values are cached like the tokenized pairs (keyed by the prepared set, the base's identity and the
dtype) and checked when read: a file made for other pairs is refused, and a checkpoint trained against the
reference of other pairs (the data changed since) is refused on resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_fsdp.loss.chunked import sequence_log_probs, token_log_probs
from lightning_fsdp.loss.preference import REFERENCE_MODES
from lightning_fsdp.models.hf_causal_lm import hidden_states_and_head

__all__ = ["REFERENCE_MODES", "ReferenceModel", "frozen_copy", "precompute_reference", "reference_model_key"]

#: the checkpoint entry recording which precomputed reference a run trains against
CHECKPOINT_KEY = "preference_reference"


class ReferenceModel(nn.Module):
    """A frozen causal LM scoring completions: each row's summed completion log-probability. Sharded as its own
    FSDP root, so its root unit's parameters are gathered only while it scores (:meth:`score` reshards them)."""

    def __init__(self, model: nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
                temperature: Optional[float] = None) -> Tensor:
        """Each row's summed completion log-probability; with ``temperature``, every token's instead (``(rows, T)``,
        aligned with ``labels``, the logits divided by it first: GRPO's reference)."""
        extra = {"position_ids": position_ids} if position_ids is not None else {}
        hidden, head = hidden_states_and_head(self.model, input_ids, attention_mask=attention_mask, **extra)
        if temperature is not None:
            return token_log_probs(hidden, head, labels, chunk_tokens=self.chunk_tokens, temperature=temperature)[0]
        return sequence_log_probs(hidden, head, labels, chunk_tokens=self.chunk_tokens)[0]

    @torch.no_grad()
    def score(self, batch: dict[str, Tensor], temperature: Optional[float] = None) -> Tensor:
        """:meth:`forward` of ``batch`` (``input_ids``, ``attention_mask``, ``labels``, optionally ``position_ids``)
        through the module's own ``__call__`` (its FSDP root hooks), resharded after."""
        from lightning_fsdp.generation import reshard_gathered

        try:
            return self(batch["input_ids"], batch["attention_mask"], batch["labels"], batch.get("position_ids"),
                        temperature)
        finally:
            reshard_gathered(self)  # a forward without backward leaves the root gathered


@runtime_checkable
class ShardsFrozenModels(Protocol):
    """A strategy that shards a frozen model beside the trained one: both of this package's front ends (the
    Trainer's and Fabric's strategies, through their shared runtime)."""

    root_device: torch.device

    def prepare_frozen_model(self, build: Callable[[], nn.Module], pretrained_weights: Union[str, Path]) -> nn.Module:
        ...


def frozen_copy(model_dir: Union[str, Path], chunk_tokens: int, strategy: Any) -> ReferenceModel:
    """The reference as a frozen copy of ``model_dir``: built on the meta device and sharded by a strategy that
    can (each rank allocates and reads only its shards), else, in one process or under another strategy, loaded
    whole on its device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(strategy, ShardsFrozenModels):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.get_default_dtype())
        return ReferenceModel(model, chunk_tokens).to(strategy.root_device).requires_grad_(False).eval()
    config = AutoConfig.from_pretrained(str(model_dir))
    reference = strategy.prepare_frozen_model(
        lambda: ReferenceModel(AutoModelForCausalLM.from_config(config), chunk_tokens), model_dir
    )
    assert isinstance(reference, ReferenceModel)
    return reference.eval()


def reference_model_key(model_dir: Union[str, Path], trainer: Any) -> str:
    """What the reference log-probabilities depend on besides the pairs: the base's bytes (the identity the strategy
    recorded while loading it, else the files' own digest), the dtype and the precision."""
    import hashlib

    from lightning_fsdp.data.sft.source import content_digest

    settings = {"dtype": str(torch.get_default_dtype()), "precision": str(getattr(trainer, "precision", ""))}
    base = getattr(trainer.strategy, "pretrained_base", None)
    if base is not None and Path(base.path).resolve() == Path(model_dir).resolve():
        identity = {k: v for k, v in base.identity.items() if k != "path"}
        text = json.dumps({"identity": identity, **settings}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) + [root / "config.json"]
    return content_digest(files, settings)


def precompute_reference(
    trainer: Any, datamodule: Any, model_key: str, score: Callable[[dict[str, Tensor]], Tensor]
) -> Path:
    """Every pair's reference log-probabilities, attached to ``datamodule``'s train and val sets: read from the cache
    beside the prepared pairs, or computed once by ``score`` (every rank its share of the pairs, in the same number
    of batches) and written there by rank 0."""
    path: Path = datamodule.reference_cache(model_key)
    pairs_key = datamodule.prepared_dir.name
    splits = {"train": datamodule.train_set, "val": datamodule.val_set}
    if not path.exists():
        values = {name: _score_split(trainer, rows, datamodule, score) for name, rows in splits.items()}
        if trainer.is_global_zero:
            _write(path, values, {"pairs": pairs_key, "model": model_key})
        trainer.strategy.barrier("reference log-probabilities written")
    loaded = read_reference(path, pairs_key, {name: len(rows) for name, rows in splits.items()})
    for name, rows in splits.items():
        rows.reference = loaded[name]
    return path


def _score_split(trainer: Any, rows: Any, datamodule: Any, score: Callable[[dict[str, Tensor]], Tensor]) -> Tensor:
    """``(pairs, 2)`` reference log-probabilities: rank ``r`` scores pairs ``r, r + N, ...`` (padded with empty pairs
    so every rank runs as many batches), gathered back into the set's order."""
    world, rank = trainer.world_size, trainer.global_rank
    device = trainer.strategy.root_device
    total = len(rows)
    per_rank = -(-total // world)
    mine = [i * world + rank for i in range(per_rank)]
    local = torch.zeros(per_rank, 2, dtype=torch.float32)
    collate = datamodule.collate_fn()
    batch_size = datamodule.batch_size
    for start in range(0, per_rank, batch_size):
        chosen = mine[start : start + batch_size]
        batch = collate([rows[i] if i < total else rows[-1] for i in chosen])
        batch = trainer.strategy.batch_to_device(batch, device)
        logps = score(batch).float().cpu()
        local[start : start + len(chosen)] = torch.stack(logps.chunk(2), dim=1)
    gathered = trainer.strategy.all_gather(local.to(device)).cpu().reshape(world, per_rank, 2)
    return gathered.transpose(0, 1).reshape(-1, 2)[:total].contiguous()


def _write(path: Path, values: dict[str, Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(values, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_reference(path: Path, pairs_key: str, counts: dict[str, int]) -> dict[str, Tensor]:
    """The cached log-probabilities at ``path``, refused unless made for exactly these prepared pairs."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            values = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise ValueError(f"The precomputed reference log-probabilities {path} cannot be read ({err}). Delete the"
                         " file: the next run computes them again.") from err
    if metadata.get("pairs") != pairs_key:
        raise ValueError(
            f"The precomputed reference log-probabilities {path} were made for the prepared pairs"
            f" {metadata.get('pairs')!r}, not these ({pairs_key!r}): the data changed since they were computed."
            " Delete the file to compute them again (only valid from the base model, before training)."
        )
    wrong = {name: tuple(values[name].shape) if name in values else None for name, n in counts.items()
             if name not in values or tuple(values[name].shape) != (n, 2)}
    if wrong:
        raise ValueError(f"The precomputed reference log-probabilities {path} do not cover the pairs: {wrong} instead"
                         f" of {{split: (pairs, 2)}} for {counts}. Delete the file to compute them again.")
    return values


def check_resumed_reference(recorded: Optional[dict[str, Any]], current: Optional[dict[str, Any]]) -> None:
    """Refuse to resume a run that trained against another precomputed reference than the one this run has."""
    if recorded is None or current is None:
        return
    changed = [k for k in ("pairs", "model") if recorded.get(k) != current.get(k)]
    if changed:
        what = {"pairs": "the data (its prepared pairs)", "model": "the base model"}
        raise ValueError(
            "This checkpoint was trained against the precomputed reference log-probabilities of"
            f" {', '.join(f'{k} {recorded.get(k)!r}' for k in changed)}; this run has"
            f" {', '.join(f'{k} {current.get(k)!r}' for k in changed)}: {' and '.join(what[k] for k in changed)}"
            " changed since the reference was computed. Resume with the data and model it was trained on, or start"
            " a new run (without ckpt_path) to train on the new ones."
        )
