"""``SFTDataModule``: supervised fine-tuning data for any Hugging Face causal LM, from the user's own files."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fsdp.cache import cache_root
from lightning_fsdp.data._loaders import SplitDataModule
from lightning_fsdp.data.order import GlobalOrderSampler, data_parallel_rank
from lightning_fsdp.data.sft.encoding import RowEncoder
from lightning_fsdp.data.sft.formats import TRAIN_ON, detect_format, needs_chat_template, row_messages
from lightning_fsdp.data.sft.packing import PackedRows, SampleRows, collate_rows
from lightning_fsdp.data.sft.prepared import PreparedSet, Recipe, describe, prepare
from lightning_fsdp.data.sft.source import column_names

log = logging.getLogger(__name__)

__all__ = ["LONG_SAMPLES", "SFTDataModule", "check_model_fits", "check_vocabulary", "load_tokenizer"]

LONG_SAMPLES = ("truncate", "drop", "error")


def load_tokenizer(name_or_dir: Union[str, Path]) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name_or_dir))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"Cannot load a tokenizer from {str(name_or_dir)!r} ({err}). Pass tokenizer= a model directory or a"
            " tokenizer directory (tokenizer.json / tokenizer_config.json), e.g. the model's own."
        ) from err


class SFTDataModule(SplitDataModule):
    """Fine-tuning data from a file, folder or saved data set, tokenized by the model's own tokenizer.

    Batches are dicts: ``input_ids`` and ``labels`` (aligned; ``-100`` where nothing is trained) and either
    ``position_ids`` (packed rows, no attention mask) or ``attention_mask`` (padded rows).

    Args:
        path: a ``.jsonl``/``.json``/``.parquet``/``.csv``/``.txt`` file, a folder of one kind, or a
            ``datasets.save_to_disk`` directory.
        tokenizer: a model or tokenizer directory for ``AutoTokenizer``, or a ``.gguf`` model file. When it is a
            model, the model's vocabulary and positions are checked against the tokenizer and ``seq_len`` here.
        val_path: a separate validation set; else ``val_fraction`` of ``path`` (seeded, deterministic).
        format: ``"auto"`` (from the columns), ``"chat"``, ``"instruction"``, ``"prompt_completion"`` or ``"text"``.
        train_on: ``"assistant"`` (every assistant turn), ``"last"`` (the last one) or ``"all"`` tokens.
        chat_template: a Jinja chat template for tokenizers without one (or to override theirs).
        seq_len: the longest row in tokens; ``long_samples`` says what happens to a longer sample.
        packing: pack samples into rows of ``seq_len`` (attention stays within each sample); else pad per batch.
        batch_size: rows per batch *per rank*.
        seed: shuffling seed (epoch ``e`` uses ``seed + e``) and the validation split's.
        cache_dir: where prepared sets are kept (default ``$LIGHTNING_FSDP_CACHE/sft``).
        num_proc: processes for tokenizing (``datasets.map``), on the preparing rank only.
    """

    def __init__(
        self,
        path: Union[str, Path],
        tokenizer: Union[str, Path],
        val_path: Optional[Union[str, Path]] = None,
        val_fraction: float = 0.05,
        format: str = "auto",
        train_on: str = "assistant",
        chat_template: Optional[str] = None,
        seq_len: int = 2048,
        long_samples: str = "truncate",
        packing: bool = True,
        batch_size: int = 1,
        seed: int = 0,
        cache_dir: Optional[Union[str, Path]] = None,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
    ) -> None:
        super().__init__()
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on={train_on!r} is not one of {TRAIN_ON}.")
        if long_samples not in LONG_SAMPLES:
            raise ValueError(f"long_samples={long_samples!r} is not one of {LONG_SAMPLES}.")
        if seq_len < 2 or batch_size < 1 or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"seq_len ≥ 2, batch_size ≥ 1 and 0 ≤ val_fraction < 1 are needed; got {seq_len},"
                             f" {batch_size}, {val_fraction}.")
        from lightning_fsdp.hf.gguf import resolve_model_source

        tokenizer = resolve_model_source(tokenizer)  # a .gguf file: its converted directory
        self.tokenizer = load_tokenizer(tokenizer)
        self.pad_id = self._pad_id()
        fmt = detect_format(column_names(path), format)
        if val_path is not None:
            detect_format(column_names(val_path), fmt)
        self.recipe = Recipe(str(Path(path).expanduser().resolve()),
                             str(Path(val_path).expanduser().resolve()) if val_path else None, float(val_fraction),
                             int(seed), fmt, train_on, chat_template, int(seq_len), long_samples, bool(packing))
        self.encoder = RowEncoder(self.tokenizer, fmt, train_on, chat_template, int(seq_len), long_samples)
        check_model_fits(Path(tokenizer), self.tokenizer, int(seq_len))
        self.batch_size, self.seed, self.num_workers, self.num_proc = batch_size, int(seed), num_workers, num_proc
        self.seq_len, self.packing = int(seq_len), bool(packing)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root("sft")
        self.prepared: Optional[PreparedSet] = None
        self._prepared_root: Optional[Path] = None  # known once prepare_data ran here: the files are hashed once

    def _pad_id(self) -> int:
        tok = self.tokenizer
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
        fallback = tok.eos_token_id if tok.eos_token_id is not None else 0
        log.warning("The tokenizer has no pad token: padding uses id %d (%r); padding is never trained or attended.",
                    fallback, tok.convert_ids_to_tokens(int(fallback)))
        return int(fallback)

    # -- Lightning's hooks --------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Tokenize once (Lightning calls this on one process per node; the others wait)."""
        self._prepared_root = prepare(self.recipe, self.encoder, self.cache_dir, self.num_proc)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.prepared is not None:
            return
        root = self._prepared_root or prepare(self.recipe, self.encoder, self.cache_dir, self.num_proc)
        prepared = PreparedSet.open(root)
        self.prepared = prepared
        if self.trainer is None or self.trainer.is_global_zero:
            print(f"Fine-tuning data {describe(prepared.stats)}", flush=True)
        self.train_set = self._rows(prepared.train, prepared.train_bins)
        self.val_set = self._rows(prepared.val, prepared.val_bins)

    def _rows(self, tokenized: Any, bins: Optional[list[list[int]]]) -> Dataset:
        return PackedRows(tokenized, bins) if self.packing and bins is not None else SampleRows(tokenized)

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return partial(collate_rows, pad_id=self.pad_id, packed=self.packing)

    def val_dataloader(self) -> DataLoader:
        """Every validation row once, in order; an uneven last round is padded with empty rows, so per-token
        metrics are exact at any world size."""
        assert self.val_set is not None, "call setup() first"
        replicas, rank = data_parallel_rank(self.trainer)
        sampler = GlobalOrderSampler(len(self.val_set), self.batch_size, replicas, rank, shuffle=False, drop_last=False)  # type: ignore[arg-type]
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate_fn(),
                          num_workers=self.num_workers)

    # -- generation -----------------------------------------------------------------------------------------------
    def held_out_examples(self, limit: int) -> list[tuple[Tensor, str, str]]:
        """Up to ``limit`` validation prompts: ``(token ids, the question as text, the reference answer)`` (chat,
        instruction and prompt/completion data; plain text has none)."""
        import torch

        if self.prepared is None:
            self.setup()
        assert self.prepared is not None
        out = []
        source = self.prepared.val_source
        for i in range(min(limit, len(source))):
            row = source[i]
            if needs_chat_template(self.recipe.fmt):
                messages = row_messages(row, self.recipe.fmt)
                last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
                if last is None:
                    continue
                prompt, reference = self.encoder.prompt_ids(messages[:last]), messages[last]["content"]
                question = messages[last - 1]["content"] if last else ""
            elif self.recipe.fmt == "prompt_completion":
                prompt, reference = list(self.tokenizer(str(row["prompt"]))["input_ids"]), str(row["completion"])
                question = str(row["prompt"])
            else:
                return []
            out.append((torch.tensor(prompt, dtype=torch.long), question, reference))
        return out

    def encode(self, text: str) -> Tensor:
        import torch

        return torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)

    def decode(self, ids: Any) -> str:
        values = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
        return str(self.tokenizer.decode(values, skip_special_tokens=True))


def check_model_fits(directory: Path, tokenizer: Any, seq_len: int, name: str = "seq_len") -> None:
    """When ``tokenizer`` names a model directory: its vocabulary fits the embedding, ``seq_len`` (the setting
    ``name``) its positions."""
    config_file = directory.expanduser() / "config.json"
    if not config_file.exists():
        return
    import json

    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    check_vocabulary(tokenizer, int(config.get("vocab_size", 0)), str(directory))
    positions = config.get("max_position_embeddings")
    if positions is not None and seq_len > int(positions):
        raise ValueError(f"{name}={seq_len} is above the model's max_position_embeddings={positions} ({directory})."
                         f" Pass {name} ≤ {positions}.")


def check_vocabulary(tokenizer: Any, vocab_size: int, where: str) -> None:
    """A clear error when the tokenizer can produce ids the model's embedding has no row for."""
    if vocab_size and len(tokenizer) > vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model ({where}) embeds only {vocab_size}: ids above"
            f" {vocab_size - 1} would index past the embedding. Use the model's own tokenizer, or resize the model's"
            " embeddings (model.resize_token_embeddings) and save it first."
        )
