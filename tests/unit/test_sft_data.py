"""Fine-tuning data without a Trainer: formats, chat-template masking against the tokenizer's own rendering, packing
that keeps samples apart in a real transformers Llama, the global order, the prepared cache and bad input.

Tokenizers are real byte-level BPEs trained here, with a Llama-3-style and a ChatML-style template.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from lightning_fsdp.data.order import PAD_INDEX, GlobalOrderLoader, GlobalOrderSampler  # noqa: E402
from lightning_fsdp.data.sft import (  # noqa: E402
    RowEncoder,
    SFTDataModule,
    collate_rows,
    detect_format,
    first_fit_decreasing,
)
from lightning_fsdp.loss import IGNORE_INDEX, causal_lm_token_loss  # noqa: E402
from tests.helpers.sft import chat_rows, make_tokenizer, write_chat_llama, write_jsonl  # noqa: E402

END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>\n"}


@pytest.fixture(scope="module", params=["llama3", "chatml"])
def styled(request):
    return request.param, make_tokenizer(request.param)


def trained_runs(tokenizer, ids, labels) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token  # labels are aligned with the inputs
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


# -- chat templates -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_chat_tokens_are_the_templates_and_only_assistant_turns_train(styled, train_on):
    style, tokenizer = styled
    encoder = RowEncoder(tokenizer, "chat", train_on)
    for row in chat_rows(20, seed=1):
        messages = row["messages"]
        ids, labels = encoder.encode_messages(messages)
        assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])
        answers = [m["content"] + END_OF_TURN[style] for m in messages if m["role"] == "assistant"]
        if train_on == "all":
            assert labels == ids
        else:
            assert trained_runs(tokenizer, ids, labels) == (answers if train_on == "assistant" else answers[-1:])


def test_instruction_sharegpt_prompt_completion_and_text_rows(styled):
    style, tokenizer = styled
    instruction = {"instruction": "north south", "input": "quiet loud", "output": "bright dark", "system": "table"}
    encoded = RowEncoder(tokenizer, "instruction").encode(instruction)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "table"}, {"role": "user", "content": "north south\n\nquiet loud"},
         {"role": "assistant", "content": "bright dark"}], tokenize=True)["input_ids"]
    assert encoded.input_ids == list(rendered)
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == ["bright dark" + END_OF_TURN[style]]

    sharegpt = {"conversations": [{"from": "human", "value": "river"}, {"from": "gpt", "value": "stone"}]}
    assert trained_runs(tokenizer, *_pair(RowEncoder(tokenizer, "chat").encode(sharegpt))) == ["stone" + END_OF_TURN[style]]

    pc = RowEncoder(tokenizer, "prompt_completion").encode({"prompt": "alpha beta", "completion": " gamma"})
    assert trained_runs(tokenizer, pc.input_ids, pc.labels) == [" gamma" + tokenizer.eos_token]
    text = RowEncoder(tokenizer, "text").encode({"text": "alpha beta gamma"})
    assert text.input_ids[-1] == tokenizer.eos_token_id and text.labels[0] == IGNORE_INDEX
    assert text.labels[1:] == text.input_ids[1:]  # every token but the first (never a target of what precedes it)


def _pair(encoded):
    return encoded.input_ids, encoded.labels


def test_formats_are_detected_from_columns_and_bad_columns_are_named():
    assert detect_format(["messages", "id"]) == "chat"
    assert detect_format(["conversations"]) == "chat"
    assert detect_format(["instruction", "input", "output"]) == "instruction"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["text", "meta"]) == "text"
    with pytest.raises(ValueError, match=r"columns \['answer', 'question'\] match no format.*chat: messages"):
        detect_format(["question", "answer"])
    with pytest.raises(ValueError, match="format='chat' needs the columns"):
        detect_format(["text"], "chat")


def test_a_tokenizer_without_a_chat_template_is_told_how_to_pass_one():
    tokenizer = make_tokenizer("chatml")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has none. Pass chat_template="):
        RowEncoder(tokenizer, "chat")
    from lightning_fsdp.data.sft.demo import CHATML_TEMPLATE

    ids, _ = RowEncoder(tokenizer, "chat", chat_template=CHATML_TEMPLATE).encode_messages(chat_rows(1)[0]["messages"])
    assert ids


def test_long_samples_truncate_drop_or_error_and_nothing_to_train_is_counted():
    tokenizer = make_tokenizer("chatml")
    row = {"prompt": "alpha " * 30, "completion": "beta"}
    assert RowEncoder(tokenizer, "prompt_completion", seq_len=8).encode(row).status == 3  # truncated: no target left
    assert len(RowEncoder(tokenizer, "text", seq_len=8).encode({"text": "alpha " * 30}).input_ids) == 8
    assert RowEncoder(tokenizer, "text", seq_len=8, long_samples="drop").encode({"text": "alpha " * 30}).status == 2
    with pytest.raises(ValueError, match="more than seq_len=8"):
        RowEncoder(tokenizer, "text", seq_len=8, long_samples="error").encode({"text": "alpha " * 30})
    no_answer = {"messages": [{"role": "user", "content": "alpha"}]}
    assert RowEncoder(tokenizer, "chat").encode(no_answer).status == 3


# -- packing ---------------------------------------------------------------------------------------------------------
def test_first_fit_decreasing_is_deterministic_and_fills_rows():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(500)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert bins == first_fit_decreasing(lengths, 64)
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]  # 6+2, 5+3, 4
    assert len(bins) <= 1.23 * sum(lengths) / 64 + 1  # FFD's bound: 11/9 OPT + 1 (OPT ≥ Σ/capacity)
    with pytest.raises(ValueError, match="does not fit a row of 8"):
        first_fit_decreasing([9], 8)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_packed_batch_loses_what_its_samples_lose_one_by_one(attention):
    """No sample sees another: the summed token loss of packed rows equals the sum over the samples run alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import TINY_LLAMA

    tokenizer = make_tokenizer("llama3")
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 128})
    config._attn_implementation = attention
    model = LlamaForCausalLM(config).eval()
    encoder = RowEncoder(tokenizer, "chat")
    samples = [encoder.encode(r) for r in chat_rows(9, seed=3, turns=(1, 2), low=1, high=4)]
    bins = first_fit_decreasing([len(s.input_ids) for s in samples], 128)
    assert any(len(b) > 1 for b in bins)
    rows = [{"input_ids": torch.tensor([t for i in b for t in samples[i].input_ids]),
             "labels": torch.tensor([t for i in b for t in samples[i].labels]),
             "position_ids": torch.cat([torch.arange(len(samples[i].input_ids)) for i in b])} for b in bins]
    batch = collate_rows(rows, tokenizer.pad_token_id, packed=True)
    assert "attention_mask" not in batch
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    packed_sum, packed_count = causal_lm_token_loss(logits, batch["labels"])
    alone_sum = alone_count = 0
    for s in samples:
        total, count = causal_lm_token_loss(model(input_ids=torch.tensor([s.input_ids])).logits, torch.tensor([s.labels]))
        alone_sum, alone_count = alone_sum + total, alone_count + count
    assert int(packed_count) == int(alone_count)
    torch.testing.assert_close(packed_sum, alone_sum)
    # the trap the batch avoids: an all-ones mask lets the samples of a row attend to one another
    masked = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False).logits
    assert not torch.allclose(causal_lm_token_loss(masked, batch["labels"])[0], alone_sum)

    padded = collate_rows([{"input_ids": torch.tensor(s.input_ids), "labels": torch.tensor(s.labels),
                            "position_ids": torch.arange(len(s.input_ids))} for s in samples], tokenizer.pad_token_id,
                          packed=False)
    logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    torch.testing.assert_close(causal_lm_token_loss(logits, padded["labels"])[0], alone_sum)


# -- the global order ------------------------------------------------------------------------------------------------
def _steps(n: int, world: int, batch: int, accumulate: int, epoch: int = 0) -> list[set[int]]:
    """The samples of each optimizer step, over every rank and micro-batch."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalOrderSampler(n, batch, world, rank, seed=5)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    step = world * batch * accumulate
    flat = [per_rank[r][i * batch:(i + 1) * batch] for i in range(len(per_rank[0]) // batch) for r in range(world)]
    samples = [i for part in flat for i in part]
    return [set(samples[s:s + step]) for s in range(0, len(samples) - step + 1, step)]


def test_every_split_of_a_global_batch_sees_the_same_samples():
    reference = _steps(48, 1, 4, 1)
    for world, batch, accumulate in [(2, 1, 2), (2, 2, 1), (4, 1, 1), (1, 1, 4)]:
        assert _steps(48, world, batch, accumulate) == reference
    assert _steps(48, 1, 4, 1, epoch=1) != reference  # reshuffled every epoch


def test_the_loader_resumes_at_the_next_unseen_sample_at_another_world_size():
    data = list(range(40))
    full = [batch.tolist() for batch in GlobalOrderLoader(data, 4, seed=3)]
    first = GlobalOrderLoader(data, 2, num_replicas=2, rank=1, seed=3)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    assert state["samples_consumed"] == 12
    resumed = GlobalOrderLoader(data, 4, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert [b.tolist() for b in resumed] == full[3:]
    assert [b.tolist() for b in resumed] == full  # the next epoch pass starts from its beginning
    odd = GlobalOrderLoader(data, 5, seed=3)
    odd.load_state_dict(state)
    with pytest.raises(ValueError, match="not a whole number of this run's rounds"):
        list(odd)
    changed = GlobalOrderLoader(list(range(41)), 4, seed=3)
    with pytest.raises(ValueError, match="the data, seq_len or packing changed"):
        changed.load_state_dict(state)


def test_evaluation_rounds_pad_with_empty_rows():
    sampler = [list(GlobalOrderSampler(5, 2, 2, r, shuffle=False, drop_last=False)) for r in range(2)]
    assert sampler == [[0, 1, 4, PAD_INDEX], [2, 3, PAD_INDEX, PAD_INDEX]]


# -- the data module -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tokenizer = make_tokenizer("chatml")
    model = write_chat_llama(root / "model", tokenizer)
    data = write_jsonl(root / "chat.jsonl", chat_rows(60, seed=2))
    return root, model, data


def test_prepared_once_memory_mapped_and_batched(chat_files, caplog):
    root, model, data = chat_files
    cache = root / "cache"
    dm = SFTDataModule(data, model, seq_len=96, batch_size=3, val_fraction=0.1, cache_dir=cache)
    dm.prepare_data()
    dm.setup()
    prepared = list(cache.glob("sft-*"))
    assert len(prepared) == 1 and dm.prepared.stats["train"]["samples"] == 54
    assert all(f["filename"].startswith(str(prepared[0])) for f in dm.prepared.train.cache_files)  # Arrow on disk
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape[0] == 3
    assert batch["input_ids"].shape[1] <= 96
    again = SFTDataModule(data, model, seq_len=96, batch_size=3, val_fraction=0.1, cache_dir=cache)
    again.setup()
    assert list(cache.glob("sft-*")) == prepared  # same content, tokenizer and settings: the same prepared set
    SFTDataModule(data, model, seq_len=80, cache_dir=cache).prepare_data()
    assert len(list(cache.glob("sft-*"))) == 2  # another setting, another key
    padded = SFTDataModule(data, model, seq_len=96, batch_size=3, packing=False, cache_dir=cache)
    padded.setup()
    assert set(next(iter(padded.train_dataloader()))) == {"input_ids", "labels", "attention_mask"}
    examples = padded.held_out_examples(2)
    assert len(examples) == 2 and all(isinstance(e[2], str) for e in examples)


def test_bad_input_is_named_before_any_work(chat_files, tmp_path, caplog):
    root, model, data = chat_files
    with pytest.raises(FileNotFoundError, match="does not exist. Pass data.path="):
        SFTDataModule(tmp_path / "missing.jsonl", model)
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ValueError, match="match no format"):
        SFTDataModule(tmp_path / "qa.jsonl", model)
    small = write_chat_llama(tmp_path / "small_vocab", make_tokenizer("chatml"), vocab_size=100)
    with pytest.raises(ValueError, match="embeds only 100"):
        SFTDataModule(data, small)
    with pytest.raises(ValueError, match="above the model's max_position_embeddings=128"):
        SFTDataModule(data, model, seq_len=512)
    no_pad = tmp_path / "no_pad"
    make_tokenizer("chatml", pad=False).save_pretrained(no_pad)
    with caplog.at_level(logging.WARNING):
        dm = SFTDataModule(data, no_pad, seq_len=64)
    assert dm.pad_id == dm.tokenizer.eos_token_id and "no pad token: padding uses id" in caplog.text
    write_jsonl(tmp_path / "no_answers.jsonl", [{"messages": [{"role": "user", "content": "alpha"}]}] * 4)
    with pytest.raises(ValueError, match=r"No training sample is left after filtering: 4 dropped \(nothing to train\)"):
        SFTDataModule(tmp_path / "no_answers.jsonl", model, seq_len=64, val_fraction=0.0,
                      cache_dir=tmp_path / "c").prepare_data()


def test_every_file_kind_a_folder_and_a_saved_data_set_read_alike(chat_files, tmp_path):
    """The same prompt/completion rows as .jsonl, .json, .parquet, .csv, a folder, a save_to_disk directory (and
    text as .txt, one sample per paragraph) give the same tokens."""
    import datasets

    _, model, _ = chat_files
    rows = [{"prompt": f"alpha {i}", "completion": f" beta {i}"} for i in range(12)]
    table = datasets.Dataset.from_list(rows)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    write_jsonl(tmp_path / "folder" / "a.jsonl", rows[:5])
    write_jsonl(tmp_path / "folder" / "b.jsonl", rows[5:])
    table.save_to_disk(str(tmp_path / "saved"))
    tokens = {}
    for name in ("rows.jsonl", "rows.json", "rows.parquet", "rows.csv", "folder", "saved"):
        dm = SFTDataModule(tmp_path / name, model, seq_len=64, val_fraction=0.0, packing=False, cache_dir=tmp_path / "c")
        dm.setup()
        assert dm.recipe.fmt == "prompt_completion", name
        tokens[name] = [dm.train_set[i]["input_ids"].tolist() for i in range(len(dm.train_set))]
    assert all(t == tokens["rows.jsonl"] for t in tokens.values()) and len(tokens["rows.jsonl"]) == 12
    (tmp_path / "notes.txt").write_text("alpha beta\n\ngamma delta\nriver\n\nstone")
    text = SFTDataModule(tmp_path / "notes.txt", model, seq_len=64, val_fraction=0.0, packing=False,
                         cache_dir=tmp_path / "c")
    text.setup()
    assert text.recipe.fmt == "text" and len(text.train_set) == 3
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", rows)
    (tmp_path / "mixed" / "b.csv").write_text("prompt,completion\na,b\n")
    with pytest.raises(ValueError, match="mixes file types"):
        SFTDataModule(tmp_path / "mixed", model)
