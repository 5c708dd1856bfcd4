"""The planner's Llama-family geometry and LoRA subset against real transformers/PEFT models and published counts."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fsdp import planner
from lightning_fsdp.planner.llama import PRESETS, llama_dims, llama_model_spec, with_lora
from tests.helpers.hf import LORA, TINY_LLAMA


@pytest.mark.parametrize(
    ("preset", "params"),
    [("llama-3-8b", 8_030_261_248), ("llama-2-70b", 68_976_648_192), ("mistral-7b", 7_241_732_096)],
)
def test_published_parameter_counts(preset, params):
    assert llama_model_spec(llama_dims(PRESETS[preset])).numel == params


def test_llama_3_8b_lora_r16_trainable_count_as_peft_reports():
    dims = with_lora(llama_dims(PRESETS["llama-3-8b"]), 16, ("q_proj", "v_proj"))
    assert llama_model_spec(dims).trainable_numel == 6_815_744


def test_shapes_and_units_equal_a_real_model_with_and_without_lora():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    config = transformers.LlamaConfig(**TINY_LLAMA)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    spec = llama_model_spec(llama_dims(config.to_dict()))
    assert {p.name: p.shape for p in spec.params} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert [u.name for u in spec.blocks] == [u.name for u in planner.spec_from_module(model).blocks]
    with torch.device("meta"):
        lora_model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**LORA))
    lora_spec = llama_model_spec(with_lora(llama_dims(config.to_dict()), LORA["r"], LORA["target_modules"]))
    trainable = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    assert lora_spec.trainable_numel == trainable
    assert lora_spec.numel == sum(p.numel() for p in lora_model.parameters())


def test_lora_keeps_only_adapter_state_but_gathers_the_base():
    options = planner.PlanOptions(world_size=8, precision="bf16-mixed", batch_size=1, seq_len=4096)
    full = planner.estimate(llama_model_spec(llama_dims(PRESETS["llama-3-8b"])), options)
    dims = with_lora(llama_dims(PRESETS["llama-3-8b"]), 16, ("q_proj", "v_proj"))
    lora = planner.estimate(llama_model_spec(dims), options)
    # the frozen base is still stored, in bf16 under bf16-mixed (half the fp32 master weights), plus the adapters
    assert full.params / 2 < lora.params < full.params / 2 * 1.01
    assert lora.optimizer < full.optimizer / 500 and lora.grads < full.grads / 500
    assert lora.gathered >= full.gathered  # the frozen base is all-gathered for compute all the same


def test_estimate_command_takes_a_config_json_or_a_preset(tmp_path, capsys):
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert planner.main(["--hf-config", str(tmp_path), "-n", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == str(tmp_path) and out["activations"] > 0
    assert planner.main(["--hf-config", "llama-2-70b", "--lora-rank", "8", "-n", "8", "--precision", "bf16-mixed",
                         "--activation-checkpointing", "--device-memory", "80GB"]) == 0
    assert "trainable" in capsys.readouterr().out
    assert planner.main(["--lora-rank", "8", "--layers", "2", "--width", "64", "--vocab", "10"]) == 2


def test_the_chunked_loss_counts_one_chunk_of_logits_not_every_token():
    from lightning_fsdp.planner.estimate import PlanOptions, estimate
    from lightning_fsdp.planner.loss import loss_bytes

    vocab, d, tokens = 128_256, 4096, 8192
    whole = loss_bytes(vocab, d, 2, tokens, None)
    assert whole == tokens * vocab * (2 + 4 + 4 + 4)  # bf16 logits, their fp32 copy, log-softmax, its gradient
    assert loss_bytes(vocab, d, 2, tokens, 1024) == whole // 8 + tokens * d * 2
    assert loss_bytes(vocab, d, 2, 100, 1024) == loss_bytes(vocab, d, 2, 100, None) + 100 * d * 2
    spec = llama_model_spec(llama_dims(PRESETS["llama-3-8b"], 8192))
    plans = {c: estimate(spec, PlanOptions(precision="bf16-mixed", loss_chunk=c)) for c in (None, 1024)}
    assert plans[None].activations - plans[1024].activations == whole - loss_bytes(vocab, d, 2, tokens, 1024)


def test_max_seq_is_the_longest_sequence_that_fits(capsys):
    from lightning_fsdp.loss import DEFAULT_CHUNK_TOKENS
    from lightning_fsdp.planner.cli import longest_sequence, main
    from lightning_fsdp.planner.estimate import PlanOptions, estimate

    spec = llama_model_spec(with_lora(llama_dims(PRESETS["llama-3-8b"], 2048), 16, None))  # QLoRA on one card
    options = PlanOptions(precision="bf16-mixed", quantize_base="nf4", activation_checkpointing=True,
                          loss_chunk=DEFAULT_CHUNK_TOKENS)  # what --hf-config plans by default
    budget = 24 * 10**9
    longest = longest_sequence(spec, options, budget, 0.1)
    fits = [estimate(spec, PlanOptions(**{**options.__dict__, "seq_len": s})).device <= budget * 0.9
            for s in (longest, longest + 1)]
    assert longest > 4096 and fits == [True, False]
    args = ["estimate", "--hf-config", "llama-3-8b", "--lora-rank", "16", "--quantize-base", "nf4", "--precision", "bf16-mixed",
            "--activation-checkpointing", "--device-memory", "24GB", "--max-seq"]
    assert main(args[1:]) == 0 and f"is {longest} tokens" in capsys.readouterr().out
    assert main([*args[1:], "--loss-chunk", "none"]) == 0
    assert int(capsys.readouterr().out.split(" is ")[1].split()[0]) < longest  # the whole logits cost context
    assert main([*args[1:], "--loss-chunk", "0"]) == 2 and "positive number of tokens" in capsys.readouterr().err


def test_a_dpo_reference_copy_adds_one_nth_of_the_base_and_the_planner_says_so(tmp_path, capsys):
    """A full fine-tune's frozen reference copy: each rank's shard of every base parameter (the bytes
    ``tests/distributed/test_preference_sharded.py`` measures on a real sharded copy), in the frozen dtype; LoRA's
    adapters-off reference and precomputed log-probs add nothing."""
    import json

    from lightning_fsdp.planner.estimate import sharded_numel

    spec = llama_model_spec(llama_dims(PRESETS["llama-3-8b"]))
    plain = planner.estimate(spec, planner.PlanOptions(world_size=8, precision="bf16-mixed"))
    copy = planner.estimate(spec, planner.PlanOptions(world_size=8, precision="bf16-mixed", reference="copy"))
    assert copy.reference == sum(sharded_numel(p.shape, 8) * 2 for p in spec.params)  # bf16: frozen, compute dtype
    assert spec.numel * 2 / 8 <= copy.reference < spec.numel * 2 / 8 * 1.001
    assert copy.state == plain.state and copy.device > plain.device + copy.reference  # + its root while it scores
    lora = llama_model_spec(with_lora(llama_dims(PRESETS["llama-3-8b"]), 16, ("q_proj", "v_proj")))
    for mode in ("adapters_off", "precomputed"):
        other = planner.estimate(lora, planner.PlanOptions(world_size=8, precision="bf16-mixed", reference=mode))
        assert other.reference == 0 and other.device == planner.estimate(lora, planner.PlanOptions(
            world_size=8, precision="bf16-mixed")).device
    with pytest.raises(ValueError, match="LoRA"):
        planner.estimate(spec, planner.PlanOptions(reference="adapters_off"))

    assert planner.main(["--hf-config", "llama-3-8b", "-n", "8", "--precision", "bf16-mixed", "--reference", "copy"]) == 0
    assert "| DPO reference (copy) | 1.87 GiB | a frozen copy of the base, sharded: 1/N" in capsys.readouterr().out
    assert planner.main(["--hf-config", "llama-3-8b", "-n", "8", "--reference", "copy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reference"] == copy.reference * 2  # fp32 without mixed precision


def test_context_parallel_splits_the_activations_and_nearly_doubles_the_longest_sequence(capsys):
    """Llama-2-70B QLoRA on 2 × 24 GB: parameters are sharded over both ranks either way, each rank keeps the
    activations of half the tokens (plus the ring's buffers), so the longest sequence nearly doubles."""
    from lightning_fsdp.planner.cli import longest_sequence, main
    from lightning_fsdp.planner.estimate import PlanOptions, estimate

    spec = llama_model_spec(with_lora(llama_dims(PRESETS["llama-2-70b"], 4096), 4, ["q_proj", "v_proj"]))
    base = PlanOptions(world_size=2, precision="bf16-mixed", quantize_base="nf4", activation_checkpointing=True,
                       cpu_offload=True, loss_chunk=512, seq_len=8192)
    split = dataclasses.replace(base, context_parallel=2)
    one, two = estimate(spec, base), estimate(spec, split)
    assert (one.params, one.grads, one.optimizer) == (two.params, two.grads, two.optimizer)
    assert 0.5 < two.activations / one.activations < 0.6
    budget = 24 * 2**30
    longest = [longest_sequence(spec, o, budget, 0.1) for o in (base, split)]
    assert longest[1] % 4 == 0 and 1.9 < longest[1] / longest[0] <= 2.0
    args = ["--hf-config", "llama-2-70b", "--world-size", "2", "--lora-rank", "4", "--quantize-base", "nf4",
            "--precision", "bf16-mixed", "--activation-checkpointing", "--cpu-offload", "--device-memory", "24GiB",
            "--max-seq", "--cp", "2"]
    assert main(args) == 0 and " tokens × batch 1" in capsys.readouterr().out
    with pytest.raises(ValueError, match="context_parallel=3 must divide"):
        dataclasses.replace(base, context_parallel=3)
