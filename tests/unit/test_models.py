"""The example models: sizes, meta-device initialisation, causality, generation, single-process training."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_fsdp.data import ShapesDataModule
from lightning_fsdp.data.text import TokenWindows, encode, generated_corpus
from lightning_fsdp.models import (
    GPT,
    PRESETS,
    ConvBlock,
    GPTConfig,
    GPTLightningModule,
    ShapesCNN,
    TransformerBlock,
    config_with_params,
    count_params,
    get_preset,
)
from lightning_fsdp.models.gpt import RotaryEmbedding
from lightning_fsdp.models.gpt_module import lr_multiplier, sample_next
from lightning_fsdp.sharding import find_repeated_block_classes, materialize_meta_module, select_units
from tests.helpers.launch import run_python

TINY = dict(vocab_size=256, n_layer=2, n_head=2, d_model=32, seq_len=16)


def _unique_param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied tensor once


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_params_is_exact_for_every_preset(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert count_params(PRESETS[name]) == _unique_param_count(model)


def test_count_params_untied_adds_the_head():
    tied, untied = GPTConfig(**TINY), GPTConfig(**TINY, tie_weights=False)
    assert count_params(untied) - count_params(tied) == 256 * 32
    assert count_params(untied) == _unique_param_count(GPT(untied))
    with torch.device("meta"):
        model = GPT(untied)
    materialize_meta_module(model, torch.device("cpu"))
    assert torch.isfinite(model.head.weight).all()


def test_preset_names_match_their_size():
    for name, approx in {"gpt-5m": 5e6, "gpt-25m": 25e6, "gpt-50m": 50e6, "gpt-200m": 200e6}.items():
        assert 0.9 * approx < count_params(PRESETS[name]) < 1.1 * approx, name


def test_get_preset_and_config_with_params():
    cfg = get_preset("gpt-50m", seq_len=64)
    assert cfg.seq_len == 64 and cfg.d_model == PRESETS["gpt-50m"].d_model
    with pytest.raises(KeyError, match="gpt-5m"):
        get_preset("gpt-7b")
    sized = config_with_params(10_000_000, n_layer=8)
    assert sized.n_layer == 8 and sized.d_model % 64 == 0
    assert abs(count_params(sized) - 10_000_000) < 0.25 * 10_000_000


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=30, n_head=4), "not divisible"),
        (dict(d_model=24, n_head=8), "must be even"),
        (dict(n_layer=0), "n_layer"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_config_rejects_bad_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**TINY, **kwargs})


def test_meta_device_build_then_reset_initialises_everything():
    """What the strategy does: build on meta, allocate, `reset_parameters()` on every state owner."""
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**TINY))
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    materialize_meta_module(model, torch.device("cpu"))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # rotary tables are buffers: they must be recomputed, not left as uninitialised memory
    torch.testing.assert_close(model.rotary.cos, reference.rotary.cos)
    torch.testing.assert_close(model.rotary.sin, reference.rotary.sin)
    assert model.head is None  # tied: the output projection is the embedding matrix
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("ln1.weight") or name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.004
    # the residual projections use the scaled init (std 0.02 / sqrt(2 * n_layer))
    assert model.blocks[0].mlp.out.weight.std().item() < 0.75 * 0.02
    x = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(model(x)).all()


def test_rotary_reset_parameters_recomputes_tables():
    rotary = RotaryEmbedding(head_dim=8, max_seq_len=5)
    expected = rotary.cos.clone()
    rotary.cos.fill_(7.0)
    rotary.reset_parameters()
    torch.testing.assert_close(rotary.cos, expected)
    assert torch.equal(rotary.cos[0], torch.ones(4))  # position 0: no rotation
    assert "cos" not in rotary.state_dict()  # derived from the shape, never checkpointed


def test_auto_wrap_policy_finds_the_transformer_blocks():
    model = GPTLightningModule(**TINY)
    model.configure_model()
    assert find_repeated_block_classes(model) == {TransformerBlock}
    assert select_units(model, "auto") == ["net.blocks.0", "net.blocks.1"]
    assert select_units(model, ["TransformerBlock"]) == ["net.blocks.0", "net.blocks.1"]


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_generate_is_seeded_and_greedy_matches_argmax():
    torch.manual_seed(0)
    model = GPTLightningModule(**TINY)
    prompt = encode("abc")
    first = model.generate(prompt, max_new_tokens=20, temperature=0.9, top_k=5, seed=3)
    again = model.generate(prompt, max_new_tokens=20, temperature=0.9, top_k=5, seed=3)
    assert first.shape == (1, 23) and torch.equal(first, again)
    assert torch.equal(first[0, :3], prompt)
    greedy = model.generate(prompt, max_new_tokens=1, temperature=0.0)
    with torch.no_grad():
        expected = model(prompt[None])[0, -1].argmax()
    assert greedy[0, -1] == expected
    # a prompt longer than the context is cropped to the last seq_len tokens
    long = model.generate(torch.zeros(40, dtype=torch.long), max_new_tokens=2, temperature=0.0)
    assert long.shape == (1, 42)
    assert model.training  # restored


def test_sample_next_top_k_only_picks_the_top_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, 1.0, 2, g)) for _ in range(200)}
    assert picks == {1, 2}


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    values = [lr_multiplier(s, 10, 110, 0.1) for s in range(130)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[9:], values[10:]))
    assert values[110] == pytest.approx(0.1) and values[129] == pytest.approx(0.1)


def test_gpt_trains_in_a_plain_single_process_trainer(tmp_path):
    """No strategy of ours: the module works as an ordinary LightningModule and its loss falls."""
    L.seed_everything(0)
    tokens = encode(generated_corpus(20_000))
    train = DataLoader(TokenWindows(tokens[:18_000], 16), batch_size=16, shuffle=True, drop_last=True)
    val = DataLoader(TokenWindows(tokens[18_000:], 16), batch_size=16)
    model = GPTLightningModule(**TINY, lr=3e-3, warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        limit_val_batches=2, val_check_interval=40)
    trainer.fit(model, train, val)
    assert trainer.callback_metrics["train_loss"] < 3.5  # ln(256) = 5.55 at the start
    assert {"val_loss", "val_ppl", "val_acc"} <= set(trainer.callback_metrics)
    assert float(trainer.callback_metrics["val_ppl"]) == pytest.approx(float(trainer.callback_metrics["val_loss"].exp()), rel=1e-4)


@pytest.mark.parametrize("tie_weights", [True, False])
def test_gpt_with_the_chunked_loss_trains_as_with_the_whole_logits(tmp_path, tie_weights):
    """``loss_chunk`` (7: it divides no batch's 16 × 16 tokens) changes no loss, validation figure or final weight."""
    tokens = encode(generated_corpus(4_000))

    def fit(loss_chunk):
        L.seed_everything(0)
        train = DataLoader(TokenWindows(tokens[:3_000], 16), batch_size=16, shuffle=True, drop_last=True)
        val = DataLoader(TokenWindows(tokens[3_000:], 16), batch_size=16)
        model = GPTLightningModule(**{**TINY, "tie_weights": tie_weights}, lr=3e-3, warmup_steps=2, loss_chunk=loss_chunk)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                            limit_val_batches=2, val_check_interval=6)
        trainer.fit(model, train, val)
        return trainer.callback_metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}

    (whole, whole_params), (chunked, chunked_params) = fit(None), fit(7)
    for name in ("train_loss", "val_loss", "val_ppl", "val_acc"):
        torch.testing.assert_close(chunked[name], whole[name], msg=name)
    assert "train_acc" in whole and "train_acc" not in chunked  # accuracy needs the whole logits
    torch.testing.assert_close(chunked_params, whole_params)
    with pytest.raises(ValueError, match="positive integer"):
        GPTLightningModule(**TINY, loss_chunk=0)


# -- the CNN -----------------------------------------------------------------------------------------------------------
def test_cnn_forward_and_auto_policy_units():
    model = ShapesCNN(widths=(8, 8, 16))
    assert model(torch.randn(3, 1, 32, 32)).shape == (3, 4)
    assert find_repeated_block_classes(model) == {ConvBlock}
    assert select_units(model, "auto") == ["features.0", "features.1", "features.2"]


def test_cnn_learns_the_shapes_in_one_process(tmp_path):
    L.seed_everything(0)
    data = ShapesDataModule(num_train=512, num_val=128, batch_size=16)
    model = ShapesCNN(widths=(8, 16, 16, 32), lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert trainer.callback_metrics["val_acc"] > 0.5  # chance is 0.25
    assert not torch.equal(model.features[0].bn.running_var, torch.ones(8))


BN_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from lightning_fsdp.models.cnn import average_batchnorm_stats
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
bn = nn.BatchNorm2d(3)
bn.running_mean.fill_(float(rank))
bn.running_var.fill_(2.0 + 2 * rank)
def mean(t):
    dist.all_reduce(t)
    return t / world
count = average_batchnorm_stats(nn.Sequential(bn), mean)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump([rank, count, bn.running_mean.tolist(), bn.running_var.tolist()], f)
dist.destroy_process_group()
"""


def test_average_batchnorm_stats_over_two_real_ranks(tmp_path):
    """Replicated BatchNorm buffers drift per rank; after averaging every rank holds the same statistics."""
    script = tmp_path / "bn.py"
    script.write_text(BN_SCRIPT)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)],
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [[0, 1, [0.5] * 3, [3.0] * 3], [1, 1, [0.5] * 3, [3.0] * 3]]
