"""The planner's arithmetic: sharding like FSDP2, GPT parameter counts, per-rank bytes, verdicts and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from lightning_fsdp import planner
from lightning_fsdp.planner import GPTDims, PlanOptions, estimate, gpt_model_spec
from tests.helpers.models import TinyLM

GPT2_SMALL = GPTDims(n_layer=12, d_model=768, n_head=12, vocab_size=50257, seq_len=1024)
SMALL = GPTDims(n_layer=4, d_model=64, n_head=4, vocab_size=1000, seq_len=32)


@pytest.mark.parametrize("dim0", [1, 2, 5, 7, 8, 37, 100])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_shard_rows_follow_torch_chunk(dim0, shards):
    chunks = torch.arange(dim0).chunk(shards)
    expected = [len(c) for c in chunks] + [0] * (shards - len(chunks))
    assert [planner.shard_rows(dim0, shards, r) for r in range(shards)] == expected
    assert planner.padded_numel((dim0, 3), shards) == -(-dim0 // shards) * 3


def test_shard_rows_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="outside a shard group"):
        planner.shard_rows(8, 2, 2)


def test_gpt2_small_parameter_count():
    """GPT-2 small with tied embeddings is the well-known 124,439,808 parameters."""
    assert planner.gpt_param_count(GPT2_SMALL) == 124_439_808


def test_gpt_count_is_12_l_d2_plus_embeddings():
    d, L, V, s = 256, 6, 1000, 64
    dims = GPTDims(n_layer=L, d_model=d, n_head=4, vocab_size=V, seq_len=s)
    assert planner.gpt_param_count(dims) == L * (12 * d * d + 13 * d) + V * d + s * d + 2 * d
    untied = dataclasses.replace(dims, tie_weights=False, bias=False, norm_bias=False, learned_pos=False)
    assert planner.gpt_param_count(untied) == L * (12 * d * d + 2 * d) + 2 * V * d + d


def test_planner_counts_the_package_gpt_presets_exactly():
    from lightning_fsdp.models import PRESETS, count_params

    for name, cfg in PRESETS.items():
        dims = planner.package_gpt(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len, cfg.mlp_ratio)
        assert planner.gpt_param_count(dims) == count_params(cfg), name


def test_packaged_hydra_config_is_built_on_meta_and_recognised():
    spec = planner.spec_from_config(planner.load_config("model=gpt_5m"), "model=gpt_5m")
    from lightning_fsdp.models import PRESETS, count_params

    preset = PRESETS["gpt-5m"]
    assert spec.numel == count_params(preset)
    assert len(spec.blocks) == preset.n_layer
    assert spec.gpt is not None and spec.gpt.rotary and not spec.gpt.bias and not spec.gpt.learned_pos
    assert (spec.gpt.n_layer, spec.gpt.d_model, spec.gpt.n_head) == (preset.n_layer, preset.d_model, preset.n_head)


def test_gpt_dims_validation():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTDims(n_layer=2, d_model=10, n_head=3, vocab_size=5, seq_len=4)
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        GPTDims(n_layer=0, d_model=8, n_head=2, vocab_size=5, seq_len=4)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_partition_the_unsharded_state(world):
    spec = gpt_model_spec(SMALL)
    options = PlanOptions(world_size=world)
    per_rank = [planner.state_bytes(spec, options, r) for r in range(world)]
    est = estimate(spec, options)
    assert sum(sum(r) for r in per_rank) == est.unsharded_state
    assert per_rank[0] == (est.params, est.grads, est.optimizer)  # rank 0 holds the largest shard
    assert all(sum(r) <= est.state for r in per_rank)
    # within padding of the ideal: at most one extra row per parameter
    slack = sum(4 * 4 * (p.numel // p.shape[0]) for p in spec.params)
    assert est.ideal_state <= est.state <= est.ideal_state + slack


def test_state_bytes_match_a_real_fully_sharded_module_layout():
    """Each rank's local rows equal what ``torch.chunk`` gives a real parameter (as FSDP2's DTensor shards do)."""
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))
    spec = planner.spec_from_module(model, "mlp", policy=None)
    for world in (2, 3, 4):
        for rank in range(world):
            expected = sum(
                p.chunk(world)[rank].numel() if rank < len(p.chunk(world)) else 0 for p in model.parameters()
            )
            params, _, _ = planner.state_bytes(spec, PlanOptions(world_size=world, optimizer="none"), rank)
            assert params == 4 * expected


def test_optimizer_states_and_precisions():
    spec = gpt_model_spec(SMALL)
    n = spec.numel
    adamw = estimate(spec, PlanOptions(optimizer="adamw"))
    sgd = estimate(spec, PlanOptions(optimizer="sgd"))
    assert (adamw.params, adamw.grads, adamw.optimizer) == (4 * n, 4 * n, 8 * n)
    assert sgd.optimizer == 4 * n
    mixed = estimate(spec, PlanOptions(precision="bf16-mixed", world_size=2))
    fp32 = estimate(spec, PlanOptions(world_size=2))
    assert mixed.state == fp32.state  # sharded master weights stay fp32
    assert mixed.gathered * 2 == fp32.gathered  # units are gathered in bf16
    assert mixed.activations < fp32.activations
    true_bf16 = estimate(spec, PlanOptions(precision="bf16-true", world_size=2))
    assert true_bf16.state * 2 == fp32.state


def test_frozen_parameters_have_no_grads_or_optimizer_state():
    with torch.device("meta"):
        model = TinyLM(frozen=("net.layers.0", "net.emb"))
    spec = planner.spec_from_module(model, "frozen")
    est = estimate(spec, PlanOptions())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert est.grads == 4 * trainable and est.optimizer == 8 * trainable
    assert est.params == 4 * sum(p.numel() for p in model.parameters())


def test_gathered_is_root_plus_a_unit_and_its_prefetch():
    spec = gpt_model_spec(SMALL)
    block = spec.blocks[0].numel
    est = estimate(spec, PlanOptions(world_size=4))
    assert est.gathered == 4 * (spec.root.numel + 2 * block)
    assert estimate(spec, PlanOptions(world_size=4, prefetch=0)).gathered == 4 * (spec.root.numel + block)
    assert est.unsharded_grads == 4 * (spec.root.numel + block)


def test_ddp_single_offload_and_hybrid():
    spec = gpt_model_spec(SMALL)
    single = estimate(spec, PlanOptions(strategy="single"))
    ddp = estimate(spec, PlanOptions(strategy="ddp", world_size=4))
    assert ddp.state == single.state == single.unsharded_state
    assert ddp.comm_buffers == single.grads and ddp.device == single.device + ddp.comm_buffers
    off = estimate(spec, PlanOptions(world_size=4, cpu_offload=True))
    on = estimate(spec, PlanOptions(world_size=4))
    assert off.host == on.state and off.device == on.device - on.state
    hybrid = estimate(spec, PlanOptions(world_size=4, replicate=2))
    assert hybrid.shard == 2 and hybrid.state == estimate(spec, PlanOptions(world_size=2)).state
    with pytest.raises(ValueError, match="replicate=3 must divide world_size=4"):
        PlanOptions(world_size=4, replicate=3)


def test_activation_formula_per_layer():
    """(9 + 2r)·d elements per token and layer in the compute dtype (+ fp32 norm statistics and the per-head
    log-sum-exp), plus embeddings and the loss over the vocab."""
    b, s, d, L, V, h = 2, 32, 64, 4, 1000, 4
    dims = GPTDims(n_layer=L, d_model=d, n_head=h, vocab_size=V, seq_len=s)
    per_layer = (9 + 2 * 4) * d * 4 + (4 + h) * 4
    outside = 2 * d * 4 + V * 12
    assert planner.gpt_activation_bytes(dims, b) == b * s * (L * per_layer + outside)
    ac = planner.gpt_activation_bytes(dims, b, activation_checkpointing=True)
    assert ac == b * s * (L * d * 4 + per_layer + outside)
    rotary = dataclasses.replace(dims, rotary=True, learned_pos=False)
    assert planner.gpt_activation_bytes(rotary, b) - planner.gpt_activation_bytes(dims, b) == b * s * L * 2 * d * 4
    eager = planner.gpt_activation_bytes(dims, b, attention="eager")
    assert eager - planner.gpt_activation_bytes(dims, b) == b * s * L * (2 * h * s * 4 - h * 4)
    assert planner.gpt_activation_bytes(dims, 2 * b) == 2 * planner.gpt_activation_bytes(dims, b)
    # GPTLightningModule(loss_chunk=c): one chunk of logits, plus the hidden states the chunked loss keeps
    chunk = 3
    saved = planner.gpt_activation_bytes(dims, b) - planner.gpt_activation_bytes(dims, b, loss_chunk=chunk)
    assert saved == (b * s - chunk) * dims.vocab_size * 12 - b * s * d * 4


def test_cli_plans_the_loss_each_model_computes(capsys):
    """The GPT example computes the whole logits unless its config sets ``loss_chunk``; ``--loss-chunk`` overrides."""
    gpt = ["--layers", "2", "--width", "64", "--vocab", "50000", "--seq", "4096", "--json"]

    def activations(*extra: str) -> int:
        assert planner.main([*gpt, *extra]) == 0
        return json.loads(capsys.readouterr().out)["activations"]

    whole, chunked = activations(), activations("--loss-chunk", "512")
    assert activations("--loss-chunk", "none") == whole
    assert whole - chunked == (4096 - 512) * 50000 * 12 - 4096 * 64 * 4


def _saved_bytes(module: nn.Module, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters and buffers excluded."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(n for ptr, n in storages.items() if ptr not in own)


def test_saved_activations_of_the_package_gpt_match_exactly():
    """The package decoder (rotary, SDPA, GELU MLP): the count is exact per layer, and the root adds the
    embedding output, final norm, and what cross entropy keeps."""
    from lightning_fsdp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    b, s = 2, 16
    one, two = (GPT(GPTConfig(n_layer=n, n_head=4, d_model=64, seq_len=s, vocab_size=100)) for n in (1, 2))
    idx = torch.randint(0, 100, (b, s))
    per_layer_measured = _saved_bytes(two, idx) - _saved_bytes(one, idx)
    dims = planner.package_gpt(1, 64, 4, vocab_size=100, seq_len=s)
    outside = b * s * (2 * 64 * 4 + 100 * 12)
    assert planner.gpt_activation_bytes(dims, b) - outside == per_layer_measured


def test_saved_activations_of_a_real_block_match_the_per_layer_count():
    """Count the tensors autograd really saves for one TinyLM block (SDPA attention, MLP 3·d+1 wide)."""
    torch.manual_seed(0)
    d, heads, b, s = 48, 4, 2, 16
    from tests.helpers.models import Block

    block = Block(d, heads)
    x = torch.randn(b, s, d, requires_grad=True)
    saved = _saved_bytes(block, x)
    dims = GPTDims(n_layer=1, d_model=d, n_head=heads, vocab_size=1, seq_len=s, mlp_ratio=(3 * d + 1) / d)
    per_layer = planner.gpt_activation_bytes(dims, b) - b * s * (2 * d * 4 + 1 * 12)
    # q, k, v are views of one projection here, so the attention output comes out in the layout that makes the
    # projection's input a view: one d-sized copy fewer than the count allows for
    assert saved == per_layer - b * s * d * 4


def test_verdict_fits_and_advises():
    spec = gpt_model_spec(GPT2_SMALL)
    options = PlanOptions(world_size=1, batch_size=1, precision="bf16-mixed")
    need = estimate(spec, options).device
    assert planner.verdict(spec, options, int(need / 0.9) + 1).fits
    tight = planner.verdict(spec, options, int(need * 0.5))
    assert not tight.fits and tight.needed == need
    text = "\n".join(tight.advice)
    assert "more ranks" in text and "cpu_offload=True" in text
    # activations dominate at a large batch: checkpointing them is the advice, more ranks cannot help
    big_batch = dataclasses.replace(options, batch_size=16)
    with_ac = estimate(spec, dataclasses.replace(big_batch, activation_checkpointing=True)).device
    assert with_ac < estimate(spec, big_batch).device
    acts = planner.verdict(spec, big_batch, int(with_ac / 0.9) + 1)
    assert any("activation checkpointing" in a for a in acts.advice)
    assert not any("more ranks" in a for a in acts.advice)
    world = planner.minimum_world_size(spec, options, tight.usable)
    assert world is not None and world > 1
    assert estimate(spec, dataclasses.replace(options, world_size=world)).device <= tight.usable
    assert estimate(spec, dataclasses.replace(options, world_size=world // 2)).device > tight.usable
    ddp = planner.verdict(spec, PlanOptions(strategy="ddp", world_size=4, batch_size=1), 1 * planner.GiB)
    assert any("fsdp_custom" in a for a in ddp.advice)


def test_largest_gpt_fits_more_layers_when_sharded():
    template = GPTDims(n_layer=1, d_model=512, n_head=8, vocab_size=8192, seq_len=128)
    budget = 1 * planner.GiB
    fsdp = planner.largest_gpt(template, PlanOptions(world_size=4, batch_size=2), budget)
    ddp = planner.largest_gpt(template, PlanOptions(world_size=4, strategy="ddp", batch_size=2), budget)
    assert fsdp is not None and ddp is not None
    assert planner.gpt_param_count(fsdp) > 3 * planner.gpt_param_count(ddp)
    for dims, options in ((fsdp, PlanOptions(world_size=4, batch_size=2)),):
        assert estimate(gpt_model_spec(dims), options).peak <= budget
        bigger = dataclasses.replace(dims, n_layer=dims.n_layer + 1)
        assert estimate(gpt_model_spec(bigger), options).peak > budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 1024**3), ("24GB", 24 * 10**9), ("512MiB", 512 * 1024**2), ("1.5e9", 1_500_000_000), ("2g", 2 * 1024**3)],
)
def test_parse_bytes(text, expected):
    assert planner.parse_bytes(text) == expected


def test_spec_from_module_follows_the_wrap_policy_and_tied_weights():
    with torch.device("meta"):
        model = TinyLM(layers=3)
    spec = planner.spec_from_module(model, "tiny")
    assert [u.name for u in spec.units] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]
    assert spec.numel == sum(p.numel() for p in model.parameters())  # the tied head counted once


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_config_yaml_and_checkpoint_sources_agree(tmp_path):
    yaml = tmp_path / "model.yaml"
    yaml.write_text("_target_: tests.helpers.models.TinyLM\nvocab: 41\ndim: 24\nheads: 4\nlayers: 2\nseq: 9\n")
    from_config = planner.spec_from_config(planner.load_config(str(yaml)), "yaml")
    model = TinyLM(vocab=41, dim=24, heads=4, layers=2, seq=9)
    assert from_config.numel == sum(p.numel() for p in model.parameters())
    assert from_config.gpt == GPTDims(n_layer=2, d_model=24, n_head=4, vocab_size=41, seq_len=9)

    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 0}, ckpt)
    shapes = planner.shapes_from_checkpoint(ckpt)
    # a state dict names a tied weight twice; the planner cannot tell it is shared, so it counts both
    assert sum(torch.Size(s).numel() for s in shapes.values()) == sum(v.numel() for v in model.state_dict().values())
    spec = planner.spec_from_shapes(shapes, "ckpt")
    assert [u.name for u in spec.units] == ["net.layers.0", "net.layers.1", ""]
    # with the saved hyper-parameters the planner knows the head is tied and reads the GPT dimensions
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, ckpt)
    spec = planner.spec_from_checkpoint(ckpt)
    assert spec.numel == sum(p.numel() for p in model.parameters())
    assert spec.gpt is not None and (spec.gpt.n_layer, spec.gpt.d_model, spec.gpt.seq_len) == (2, 24, 9)
    assert spec.gpt.learned_pos and not spec.gpt.rotary

    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": model.state_dict()}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    assert planner.shapes_from_checkpoint(tmp_path / "sharded") == shapes


def test_cli_prints_the_plan_and_a_verdict(capsys):
    argv = ["--layers", "12", "--width", "768", "--vocab", "50257", "--heads", "12", "--seq", "1024"]
    assert planner.main(argv + ["-n", "8", "--precision", "bf16-mixed", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "124.44M parameters" in out and "FITS" in out and "ideal state / 8" in out
    assert planner.main(argv + ["--device-memory", "2GiB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "more ranks" in out
    assert planner.main(argv + ["-n", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["numel"] == 124_439_808 and data["shard"] == 4


def test_cli_errors_name_the_problem(capsys):
    assert planner.main(["--layers", "2"]) == 2
    assert "--layers needs --width and --vocab" in capsys.readouterr().err
    assert planner.main([]) == 2
    assert "exactly one of --config, --checkpoint" in capsys.readouterr().err
    assert planner.main(["--config", "no_such.yaml"]) == 2
    assert "no such YAML file" in capsys.readouterr().err
