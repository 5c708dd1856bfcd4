"""Context parallelism, run for real: ring attention over gloo process groups against the unsplit attention, and
training at ``context_parallel=2`` against one process on the whole sequence."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_fsdp.parallel.sequence import SequenceLayout, document_ids, shifted_labels, split_batch
from tests.helpers.launch import SCRIPTS, run_python
from tests.helpers.parity import assert_step_gradients_equal


# -- the layout: pure functions ---------------------------------------------------------------------------------------
def test_each_rank_holds_a_head_and_a_tail_chunk_and_restore_inverts_the_split():
    row = torch.arange(16)[None]
    parts = [SequenceLayout(4, r).split(row) for r in range(4)]
    assert [p.tolist()[0] for p in parts[:2]] == [[0, 1, 14, 15], [2, 3, 12, 13]]
    assert torch.equal(SequenceLayout(4, 0).restore(parts), row)
    assert torch.equal(SequenceLayout(4, 3).positions(16), torch.tensor([6, 7, 8, 9]))


def test_a_length_that_does_not_split_names_the_multiple_to_pad_to():
    with pytest.raises(ValueError, match="multiple of 4, or pass the batch as a dict"):
        SequenceLayout(2, 0).split(torch.zeros(1, 10))
    with pytest.raises(ValueError, match="multiple of 4"):  # (inputs, targets) tuples cannot be padded for the user
        split_batch((torch.zeros(1, 10), torch.zeros(1, 10)), SequenceLayout(2, 0))


def test_a_batch_is_shifted_before_it_is_split_and_packed_rows_keep_their_documents():
    ids = torch.arange(8)[None] + 100
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    part, split = split_batch({"input_ids": ids, "position_ids": positions}, SequenceLayout(2, 1))
    assert part["input_ids"].tolist() == [[102, 103, 104, 105]]
    assert part["shift_labels"].tolist() == [[103, 104, 105, 106]]  # the chunk's last target is the next chunk's first
    assert part["position_ids"].tolist() == [[2, 0, 1, 2]] and split.documents.tolist() == [[1, 2, 2, 2]]
    assert shifted_labels(ids)[0, -1] == -100 and document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]


def test_a_row_that_does_not_split_evenly_is_padded_with_untrained_positions():
    ids = torch.arange(10)[None] + 100
    part, _ = split_batch({"input_ids": ids}, SequenceLayout(2, 1))  # 10 tokens → 12 in 4 chunks of 3
    assert part["input_ids"].tolist() == [[103, 104, 105, 106, 107, 108]]
    assert part["shift_labels"].tolist() == [[104, 105, 106, 107, 108, 109]]
    tail, _ = split_batch({"input_ids": ids}, SequenceLayout(2, 0))
    assert tail["input_ids"].tolist() == [[100, 101, 102, 109, 0, 0]]
    assert tail["shift_labels"].tolist() == [[101, 102, 103, -100, -100, -100]]
    assert tail["position_ids"].tolist() == [[0, 1, 2, 9, 10, 11]]


def test_padding_is_masked_out_of_the_labels_and_left_padding_is_refused():
    ids = torch.arange(8)[None]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    part, split = split_batch({"input_ids": ids, "attention_mask": mask}, SequenceLayout(1, 0))
    assert part["shift_labels"].tolist() == [[1, 2, 3, 4, 5, -100, -100, -100]] and "attention_mask" not in part
    assert split.documents is None and part["position_ids"].tolist() == [list(range(8))]
    with pytest.raises(ValueError, match="right-padded"):
        split_batch({"input_ids": ids, "attention_mask": mask.flip(1)}, SequenceLayout(1, 0))


def test_the_mesh_shards_over_shard_times_context_and_refuses_a_context_that_does_not_divide_the_world():
    from lightning_fsdp.parallel.mesh import MeshShape, resolve_mesh_shape

    shape = resolve_mesh_shape(1, "auto", 8, 1, context_parallel=2)
    assert shape == MeshShape(1, 4, 2) and shape.sizes == (8,) and shape.data_parallel_size == 4
    assert resolve_mesh_shape(2, "auto", 8, 2, context_parallel=2).sizes == (2, 4)
    with pytest.raises(ValueError, match="context_parallel=3 does not divide the world size 4"):
        resolve_mesh_shape(1, "auto", 4, 1, context_parallel=3)
    with pytest.raises(ValueError, match="positive int"):
        resolve_mesh_shape(1, "auto", 4, 1, context_parallel=0)


def test_hf_models_switch_to_ring_attention_and_a_custom_attention_is_refused():
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from lightning_fsdp.hf.ring_attention import RING_ATTENTION, use_ring_attention
    from tests.helpers.hf import TINY_LLAMA

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attn_implementation="eager"))
    assert use_ring_attention(torch.nn.ModuleDict({"model": model})) == 1
    assert model.config._attn_implementation == RING_ATTENTION
    ids = torch.arange(8)[None]  # outside a split it is transformers' SDPA: the same logits as "sdpa"
    sdpa = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attn_implementation="sdpa"))
    sdpa.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(input_ids=ids).logits, sdpa(input_ids=ids).logits)
    AttentionInterface.register("banded_attention", lambda *args, **kwargs: None)
    custom = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attn_implementation="banded_attention"))
    with pytest.raises(ValueError, match="cannot split LlamaForCausalLM's attention implementation 'banded_attention'"):
        use_ring_attention(custom)


# -- ring attention on real process groups ----------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_equals_the_unsplit_attention_and_its_gradients(world, tmp_path):
    """Both kernels, grouped queries, packed rows whose documents cross chunks and ranks (the script asserts)."""
    out = tmp_path / "ring.json"
    proc = run_python([str(SCRIPTS / "ring_attention.py"), str(world), str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 6 and all(c["max_err"] < 1e-5 for c in cases)


# -- training at context_parallel=2 against one process on whole sequences ---------------------------------------------
GLOBAL_BATCH, STEPS, LR, SEQ = 4, 3, 1e-2, 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.helpers.hf import write_llama

    return write_llama(tmp_path_factory.mktemp("cp") / "llama")


def _cp_runs(llama, tmp_path, *, packed: bool, lora: bool, world: int = 2, context: int = 2,
             **extra) -> tuple[dict, dict]:
    from tests.helpers.hf import LORA
    from tests.helpers.launch import train

    initial = str(tmp_path / "initial.pt")
    common = {"max_steps": STEPS, "seq": SEQ, "data": {"n": 24, "packed": packed}, "record_gradients": True}
    hf_ref = {"model_dir": str(llama), "from_pretrained": True, "lr": LR, "loss_chunk": None}
    hf = {"model_dir": str(llama), "lr": LR, "loss_chunk": None}
    if lora:
        hf_ref["lora"] = hf["lora"] = LORA
    reference = train({"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, "hf": hf_ref, **common,
                       **({"save_initial": initial} if lora else {})}, tmp_path, "reference")
    sharded = train({"devices": world, "batch_size": GLOBAL_BATCH * context // world, "empty_init": True, "hf": hf,
                     "strategy_kwargs": {"pretrained_weights": str(llama), "context_parallel": context}, **common,
                     **({"load_initial": initial} if lora else {}), **extra}, tmp_path, "sharded", timeout=300)
    return sharded, reference


# the full fine-tune also resumes across context sizes (5 launches): slow; the LoRA one keeps cp=2 in the default suite
@pytest.mark.parametrize("packed,lora", [pytest.param(False, False, marks=pytest.mark.slow), (True, True)],
                         ids=["full", "packed-lora"])
def test_hf_llama_at_context_parallel_2_trains_as_one_process(llama, tmp_path, packed, lora):
    checkpoints = {"checkpoint_dir": str(tmp_path / "ckpt"),
                   "checkpoint_kwargs": {"every_n_train_steps": 2, "save_top_k": -1}} if not lora else {}
    sharded, reference = _cp_runs(llama, tmp_path, packed=packed, lora=lora, **checkpoints)
    assert sharded["world_size"] == 2
    assert_step_gradients_equal(sharded, reference, STEPS)
    # the step's mean over every token (each rank's own mean differs: the row's last token has no target)
    assert len(reference["logged_losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(sharded["logged_losses"]), torch.tensor(reference["logged_losses"]))
    if checkpoints:  # cp is not part of the saved layout: the cp=2 checkpoint resumes on one rank, no split
        from tests.helpers.launch import train
        from tests.helpers.parity import assert_params_up_to_adam_noise

        resumed = train({"devices": 1, "batch_size": GLOBAL_BATCH, "max_steps": STEPS, "seq": SEQ, "data": {"n": 24},
                         "hf": {"model_dir": str(llama), "lr": LR, "loss_chunk": None}, "empty_init": True,
                         "strategy_kwargs": {"pretrained_weights": str(llama)},
                         "ckpt_path": str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")}, tmp_path, "resumed")
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(sharded["losses"][2:]))
        assert_params_up_to_adam_noise(resumed["params"], sharded["params"], LR)
        # and the other way round: two data-parallel ranks (cp=1) write it, the same two ranks resume at cp=2
        plain = {"batch_size": GLOBAL_BATCH // 2, "seq": SEQ, "data": {"n": 24}, "empty_init": True, "devices": 2,
                 "hf": {"model_dir": str(llama), "lr": LR, "loss_chunk": None}}
        train({**plain, "max_steps": 2, "strategy_kwargs": {"pretrained_weights": str(llama)},
               "checkpoint_dir": str(tmp_path / "ckpt1"), "checkpoint_kwargs": {"every_n_train_steps": 2}},
              tmp_path, "written_at_cp1")
        split = train({**plain, "max_steps": STEPS, "batch_size": GLOBAL_BATCH,
                       "strategy_kwargs": {"pretrained_weights": str(llama), "context_parallel": 2},
                       "ckpt_path": str(tmp_path / "ckpt1" / "epoch=0-step=2.ckpt")}, tmp_path, "resumed_at_cp2")
        torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(sharded["losses"][2:]))
        assert_params_up_to_adam_noise(split["params"], sharded["params"], LR)


@pytest.mark.slow
def test_hf_llama_at_context_parallel_2_and_shard_2_on_4_ranks_trains_as_one_process(llama, tmp_path):
    """Packed rows with LoRA on the three-dimensional mesh: two data-parallel pairs, each pair splitting its rows, the
    parameters sharded over all four ranks."""
    sharded, reference = _cp_runs(llama, tmp_path, packed=True, lora=True, world=4)
    assert sharded["world_size"] == 4
    assert_step_gradients_equal(sharded, reference, STEPS)
    torch.testing.assert_close(torch.tensor(sharded["logged_losses"]), torch.tensor(reference["logged_losses"]))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp2-shard2"])
def test_gpt_at_context_parallel_2_trains_as_one_process(world, tmp_path):
    """The package's GPT (rotary tables at global positions, ring attention in its own attention): both ranks
    splitting every sequence, and on 4 ranks two data-parallel pairs, each pair splitting its sequences."""
    from tests.helpers.launch import train

    gpt = {"vocab_size": 37, "n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": SEQ, "lr": LR, "warmup_steps": 1}
    common = {"gpt": gpt, "max_steps": STEPS, "data": {"n": 24}, "record_gradients": True}
    reference = train({"strategy": "auto", "devices": 1, "batch_size": GLOBAL_BATCH, **common}, tmp_path, "reference")
    sharded = train({"devices": world, "batch_size": GLOBAL_BATCH * 2 // world, "empty_init": True,
                     "strategy_kwargs": {"context_parallel": 2}, **common}, tmp_path, "sharded", timeout=300)
    assert sharded["world_size"] == world
    assert_step_gradients_equal(sharded, reference, STEPS)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(reference["losses"]))


def test_a_model_whose_attention_is_not_split_is_refused_on_every_rank(tmp_path):
    """A LightningModule of the user's own (its blocks mix tokens with no ring attention) at context_parallel=2."""
    from tests.helpers.launch import train

    spec = {"devices": 2, "batch_size": 4, "max_steps": 1, "seq": 8, "strategy_kwargs": {"context_parallel": 2}}
    run = train(spec, tmp_path, "refused", check=False)
    stderr = run["proc"].stderr
    assert run["proc"].returncode != 0
    assert stderr.count("did not attend across the context-parallel ranks") >= 2, stderr[-3000:]


@pytest.mark.slow
def test_a_4k_token_sequence_through_smollm2_at_context_parallel_2_equals_one_process(tmp_path):
    """The real model (SmolLM2-135M-Instruct, 30 layers, grouped queries, tied head) with LoRA: one 4,096-token row
    split over 2 ranks gives the step's loss and adapter gradients of one process on the whole row."""
    from tests.helpers.hf import LORA
    from tests.helpers.launch import train
    from tests.helpers.real_model import smollm2_dir

    model = str(smollm2_dir())
    initial = str(tmp_path / "initial.pt")
    common = {"max_steps": 1, "seq": 4096, "data": {"n": 1}, "record_gradients": True}
    hf = {"model_dir": model, "lr": LR, "lora": LORA}
    reference = train({"strategy": "auto", "devices": 1, "batch_size": 1, "save_initial": initial,
                       "hf": {**hf, "from_pretrained": True}, **common}, tmp_path, "reference", timeout=600)
    sharded = train({"devices": 2, "batch_size": 1, "empty_init": True, "load_initial": initial, "hf": hf,
                     "strategy_kwargs": {"pretrained_weights": model, "context_parallel": 2}, **common},
                    tmp_path, "sharded", timeout=600)
    torch.testing.assert_close(torch.tensor(sharded["logged_losses"]), torch.tensor(reference["logged_losses"]))
    got, want = (torch.load(r["gradients_path"], weights_only=True)[0] for r in (sharded, reference))
    assert got.keys() == want.keys() and len(got) == 2 * 2 * 30
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, n=name: f"{n}: {m}")
