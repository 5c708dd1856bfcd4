"""The generation engine in one process: transformers' own greedy ``generate`` and logits warpers as the reference,
sampling seeded per prompt (not per batch), stop tokens, and the budget checks.

Sharded generation (gather-once against streamed, any world size) runs for real in
``tests/distributed/test_grpo_sharded.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.generation import (
    Sampling,
    check_cache_fits,
    choose_rollout_mode,
    filter_logits,
    generate,
    kv_cache_bytes,
    row_seed,
)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [12]]


def test_greedy_completions_equal_transformers_generate_for_each_prompt_alone(model):
    """Left-padded in one batch, decoded with a key/value cache: each row as transformers decodes it unpadded."""
    stop = 33
    out = generate(model, PROMPTS, Sampling(10, temperature=0.0, stop_ids=(stop,)), pad_id=0)
    for i, prompt in enumerate(PROMPTS):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=stop,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        if stop in expected:
            expected = expected[: expected.index(stop) + 1]
        assert out.ids[i] == expected, i
        assert out.stopped[i] == (expected[-1] == stop)
        assert out.text_ids(i) == [t for t in expected if t != stop]


def test_a_stopped_row_leaves_the_batch_and_the_others_go_on(model):
    first = generate(model, PROMPTS, Sampling(10, temperature=0.0), pad_id=0)
    stop = first.ids[1][2]  # the third token of row 1: that row stops there, the others (probably) later
    out = generate(model, PROMPTS, Sampling(10, temperature=0.0, stop_ids=(stop,)), pad_id=0)
    for i, row in enumerate(first.ids):
        cut = row[: row.index(stop) + 1] if stop in row else row
        assert out.ids[i] == cut
    assert out.stopped[1] and out.tokens < first.tokens


def test_samples_depend_on_the_prompt_and_the_seed_not_on_the_batch(model):
    """The same (seed, prompt index, sample) gives the same completion whatever else shares its batch."""
    sampling = Sampling(8, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    together = generate(model, PROMPTS, sampling, pad_id=0, repeats=3)
    alone = generate(model, PROMPTS[2:3], sampling, pad_id=0, repeats=3, keys=[2])
    one_at_a_time = generate(model, PROMPTS, sampling, pad_id=0, repeats=3, batch_size=1)
    assert together.ids[6:9] == alone.ids
    assert together.ids == one_at_a_time.ids
    assert len({tuple(r) for r in together.ids[:3]}) > 1  # a prompt's samples differ from each other
    other_seed = generate(model, PROMPTS, Sampling(8, temperature=1.0, top_k=20, top_p=0.9, seed=4), pad_id=0, repeats=3)
    assert other_seed.ids != together.ids
    assert row_seed(3, 2, 0) != row_seed(3, 0, 2)


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(5, 50)
    for temperature, top_k, top_p in [(0.7, 10, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.5)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        torch.testing.assert_close(filter_logits(logits, temperature, top_k, top_p), expected)


def test_suppressed_tokens_are_never_chosen(model):
    greedy = generate(model, PROMPTS, Sampling(6, temperature=0.0), pad_id=0)
    banned = tuple({t for row in greedy.ids for t in row})
    out = generate(model, PROMPTS, Sampling(6, temperature=0.0, suppress_ids=banned), pad_id=0)
    assert not {t for row in out.ids for t in row} & set(banned)


def test_a_model_without_a_cache_decodes_each_prompt_on_its_own():
    class Bigram(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(16, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.table(ids)

    torch.manual_seed(0)
    bigram = Bigram()
    out = generate(bigram, [[1, 2], [3]], Sampling(4, temperature=0.0), pad_id=0)
    for prompt, row in zip([[1, 2], [3]], out.ids):
        token = prompt[-1]
        for expected in row:
            token = int(bigram.table.weight[token].argmax())
            assert expected == token


def test_bad_settings_and_budgets_are_named():
    with pytest.raises(ValueError, match="at least one new token"):
        Sampling(0)
    with pytest.raises(ValueError, match="cannot be negative"):
        Sampling(4, temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        Sampling(4, top_p=1.5)
    assert choose_rollout_mode("auto", 100, 1000) == "gather_once"
    assert choose_rollout_mode("auto", 900, 1000) == "stream"
    assert choose_rollout_mode("stream", 1, 10**9) == "stream"
    with pytest.raises(ValueError, match="not one of"):
        choose_rollout_mode("gather", 1, 1)
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    assert kv_cache_bytes(config, rows=4, tokens=10) == 2 * 3 * 2 * 8 * 4 * 10 * 4
    with pytest.raises(ValueError, match=r"needs 4.00 GiB.*Lower max_completion_length"):
        check_cache_fits(4 << 30, 6 << 30, "16 completions")


def test_sampling_draws_from_the_filtered_distribution():
    from lightning_fsdp.generation import row_generators, sample_rows

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    rows = 4000
    sampling = Sampling(1, temperature=0.7, top_k=4)
    tokens = sample_rows(logits.expand(rows, -1), sampling, row_generators(0, [(i, 0) for i in range(rows)], torch.device("cpu")))
    counts = torch.bincount(tokens, minlength=5).float() / rows
    expected = filter_logits(logits, 0.7, top_k=4).softmax(-1)[0]
    assert counts[3] == 0  # outside the top 4: never drawn
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_gather_once_folds_lora_into_the_gathered_copies_and_leaves_the_shards_untouched(model):
    """A sharded PEFT model (a 1-rank gloo mesh): gather-once decodes with the adapters folded into the gathered
    weights, as streaming decodes with them unfolded; afterwards every shard holds its bytes and no layer is merged."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_fsdp.generation import rollout_gathering
    from tests.helpers.launch import one_rank_gloo_mesh

    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = peft(input_ids=ids).logits
    with one_rank_gloo_mesh() as mesh:
        for layer in peft.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(peft, mesh=mesh)
        shards = {n: p.to_local().clone() for n, p in peft.named_parameters() if isinstance(p, DTensor)}
        runs = {}
        for mode in ("gather_once", "stream"):
            with rollout_gathering(peft, mode) as gathering:
                runs[mode] = (gathering, generate(peft, PROMPTS, Sampling(8, temperature=0.0), pad_id=0,
                                                  synchronized=gathering.synchronized))
        assert runs["gather_once"][0].folded == 4 and runs["stream"][0].folded == 0  # 2 layers × q, v
        assert runs["gather_once"][1].ids == runs["stream"][1].ids
        for once, streamed in zip(runs["gather_once"][1].logprobs, runs["stream"][1].logprobs):
            torch.testing.assert_close(torch.tensor(once), torch.tensor(streamed))
        for name, param in peft.named_parameters():
            if isinstance(param, DTensor):
                assert torch.equal(param.to_local(), shards[name]), name
        assert not any(m.merged_adapters for m in peft.modules() if hasattr(m, "merged_adapters"))
        with torch.no_grad():
            torch.testing.assert_close(peft(input_ids=ids).logits, expected)
