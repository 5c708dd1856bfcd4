"""The quantized base (QLoRA, ``quantize_base="nf4"``) in one process: the NF4 arithmetic split over parts, the
choices the strategy makes, and its errors. Sharded runs (gloo, 2 and 4 ranks) are in ``tests/distributed``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.parallel.mesh import local_shard
from lightning_fsdp.sharding import nf4
from lightning_fsdp.sharding.quantize import check_method

pytest.importorskip("torchao")


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_each_part_quantizes_to_its_chunk_of_the_whole_given_the_agreed_mean(parts):
    """Double quantization subtracts one mean over all block absmaxes: with that mean (each part's absmaxes,
    concatenated in order), every part's fields equal ``torch.chunk(to_nf4(whole), parts)`` exactly."""
    torch.manual_seed(0)
    weight = torch.randn(512, 256) * torch.linspace(0.01, 0.1, 512)[:, None]  # rows of different scales, as in models
    whole = nf4.quantize_whole(weight)
    rows = [r.to(nf4.DTYPE) for r in weight.chunk(parts)]
    mean = torch.cat([nf4.block_absmax(r) for r in rows]).mean()
    alone = nf4.quantize_rows(rows[0], nf4.block_absmax(rows[0]).mean())
    for part, chunk in zip(rows, torch.chunk(whole, parts)):
        fields = nf4.quantize_rows(part, mean)
        for name, value in nf4.fields(chunk).items():
            assert torch.equal(fields[name], value), name
    if parts > 1:  # quantized on its own, a part would differ: the statistics must be agreed
        chunk = nf4.fields(torch.chunk(whole, parts)[0])
        assert not torch.equal(alone["scaler_mean"], chunk["scaler_mean"])
        assert not torch.equal(alone["quantized_scalers"], chunk["quantized_scalers"])


def test_shards_must_hold_whole_scaler_blocks():
    assert nf4.shard_fits((512, 256), 2) and nf4.shard_fits((256, 256), 4)
    assert not nf4.shard_fits((128, 256), 4)  # 32 rows × 256 = 8192: half a scaler block
    assert not nf4.shard_fits((258, 256), 2) and not nf4.shard_fits((37, 64), 1) and not nf4.shard_fits((64,), 1)
    assert nf4.bytes_per_element() == pytest.approx(0.5 + 1 / 64 + 2 / 16384)


def test_unknown_method_and_missing_torchao_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"must be one of \['nf4'\] or None, got 'fp4'"):
        check_method("fp4")
    assert check_method(None) is None and check_method("nf4") == "nf4"
    monkeypatch.setattr(nf4, "_MODULE", "torchao_is_not_installed.nf4")
    nf4._torchao.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'lightning-fsdp\[qlora\]'"):
            FSDPCustomStrategy(quantize_base="nf4")
    finally:
        monkeypatch.undo()
        nf4._torchao.cache_clear()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.frozen = nn.Linear(dim, dim, bias=False)
        self.odd = nn.Linear(18, 18, bias=False)  # 324 elements: not a whole scaler block
        self.adapter = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x[..., :18] @ self.odd.weight.T
        return x + self.frozen(x) + self.adapter(x) + nn.functional.pad(y, (0, x.shape[-1] - 18))


class FrozenBase(L.LightningModule):
    """Blocks with a frozen projection; built in ``__init__`` (eagerly) or in ``configure_model`` (meta device)."""

    def __init__(self, freeze: bool = True, lazy: bool = False) -> None:
        super().__init__()
        self.freeze, self.blocks = freeze, None
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(256) for _ in range(2))
        for block in self.blocks:
            block.frozen.requires_grad_(not self.freeze)
            block.odd.requires_grad_(not self.freeze)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _fit(tmp_path, model: L.LightningModule) -> L.Trainer:
    trainer = L.Trainer(strategy=FSDPCustomStrategy(quantize_base="nf4"), accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 256)), batch_size=4))
    return trainer


def test_an_eager_model_is_quantized_whole_and_odd_shapes_stay_with_a_notice(tmp_path):
    model = FrozenBase()
    expected = nf4.quantize_whole(model.blocks[0].frozen.weight)
    with pytest.warns(UserWarning, match=r"2 frozen weight\(s\) stay unquantized .*blocks.0.odd.weight \(18, 18\)"):
        trainer = _fit(tmp_path, model)
    quantized = trainer.strategy.quantized_base
    assert quantized.names == ("blocks.0.frozen.weight", "blocks.1.frozen.weight") == quantized.from_model
    assert quantized.unquantized == ("blocks.0.odd.weight", "blocks.1.odd.weight")
    local = local_shard(model.blocks[0].frozen.weight)
    for name, value in nf4.fields(expected).items():
        assert torch.equal(nf4.fields(local)[name], value), name
    assert model.blocks[0].odd.weight.dtype == torch.float32
    params = trainer.strategy.state_bytes().params
    assert params < 2 * 256 * 256 * 4 + 2 * 256 * 256 * 0.6 + 2 * 18 * 18 * 4  # the frozen base in ~0.52 B/element


def test_a_meta_model_without_pretrained_weights_initialises_through_stand_ins(tmp_path):
    """``reset_parameters`` writes a full-precision stand-in; the base is then quantized in place."""
    model = FrozenBase(lazy=True)
    with pytest.warns(UserWarning, match="stay unquantized"):
        trainer = _fit(tmp_path, model)
    weight = nf4.dequantize(local_shard(model.blocks[0].frozen.weight)).float()
    assert trainer.strategy.quantized_base.from_model == ()
    bound = 1 / 256**0.5  # nn.Linear's uniform init
    assert weight.abs().max() <= bound * 1.01 and weight.std() > bound / 3


def test_nothing_frozen_to_quantize_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"no FSDP unit of FrozenBase holds a frozen nn.Linear weight.*Freeze the base"):
        _fit(tmp_path, FrozenBase(freeze=False))


def test_the_planner_fits_llama_2_70b_qlora_on_two_24gb_cards_with_offload():
    from lightning_fsdp.planner.estimate import PlanOptions, estimate
    from lightning_fsdp.planner.llama import PRESETS, llama_dims, llama_model_spec, with_lora

    spec = llama_model_spec(with_lora(llama_dims(PRESETS["llama-2-70b"], 2048), 16, ("q_proj", "v_proj")))
    options = dict(world_size=2, precision="bf16-mixed", activation_checkpointing=True, cpu_offload=True)
    lora = estimate(spec, PlanOptions(**options))
    qlora = estimate(spec, PlanOptions(**options, quantize_base="nf4"))
    gib = 1024**3
    assert 2 * qlora.host < 40 * gib < 2 * lora.host  # host memory over both ranks: well under 64 GB
    # one MLP weight in bf16 and one 4 MiB step of codes (torchao's own path held 17 bytes per element: 3.7 GiB)
    assert qlora.device < 22 * gib and qlora.dequantized == 28672 * 8192 * 2 + (1 << 22) * 13
    assert qlora.params < 0.3 * lora.params


def test_a_resume_must_hold_the_base_quantized_as_in_training(tmp_path):
    from lightning_fsdp.checkpoint import CheckpointError
    from lightning_fsdp.checkpoint.base_weights import check_quantization
    from lightning_fsdp.sharding.quantize import QuantizedBase

    saved = QuantizedBase("nf4", ("a.weight", "b.weight"))
    check_quantization(tmp_path, saved, ["a.weight", "b.weight"])
    check_quantization(tmp_path, None, [])
    with pytest.raises(CheckpointError, match="trained on a base held in full precision, but this run quantizes 1"):
        check_quantization(tmp_path, None, ["a.weight"])
    with pytest.raises(CheckpointError, match=r"quantized with 'nf4' \(2 weights\), but this run holds the base in full"):
        check_quantization(tmp_path, saved, [])
    with pytest.raises(CheckpointError, match=r"\[b.weight\] differ .*depends on the number of shards"):
        check_quantization(tmp_path, saved, ["a.weight"])
    other = QuantizedBase.from_dict({**saved.to_dict(), "block_size": 32})
    with pytest.raises(CheckpointError, match="quantized with {'block_size': 32"):
        check_quantization(tmp_path, other, ["a.weight", "b.weight"])
    assert QuantizedBase.from_dict(saved.to_dict()) == saved


def test_nf4_matmuls_dequantize_as_torchao_does_a_step_at_a_time(monkeypatch):
    """``F.linear`` on an NF4 weight (forward and backward) and ``nf4.dequantize`` equal torchao's own
    ``LinearNF4`` and ``get_original_weight`` bit for bit, over several steps of blocks."""
    from lightning_fsdp.sharding import nf4

    ao = nf4._torchao()
    monkeypatch.setattr(nf4, "DEQUANTIZE_STEP", 96)  # three blocks of codes a step, and a shorter last step
    torch.manual_seed(0)
    weight = nf4.quantize_whole(torch.randn(256, 320))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(nf4.dequantize(weight, dtype), weight.get_original_weight().to(dtype))
    x = torch.randn(3, 320, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_()
    out, reference = torch.nn.functional.linear(x, weight), ao.LinearNF4.apply(reference_x, weight)
    assert torch.equal(out, reference)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad)
    assert torch.equal(x.grad, reference_x.grad)


def test_dequantizing_one_weight_holds_the_result_and_one_step_not_torchaos_17_bytes_an_element(tmp_path):
    """Peak RSS while an 8192 × 8192 NF4 weight is dequantized to bf16, in a fresh process with large buffers
    mapped and unmapped (so that freed memory leaves the RSS)."""
    import json

    from tests.helpers.launch import run_python

    script = tmp_path / "dequantize.py"
    script.write_text(
        "import json, sys, torch\n"
        "from lightning_fsdp.memory import PeakMemory\n"
        "from lightning_fsdp.sharding import nf4\n"
        "n = 8192\n"
        "weight = nf4.quantize_whole(torch.randn(n, n, dtype=torch.bfloat16))\n"
        "peaks = {}\n"
        "for name, fn in (('torchao', lambda: weight.get_original_weight()), ('ours', lambda: nf4.dequantize(weight))):\n"
        "    tracker = PeakMemory(); tracker.reset(); out = fn(); del out\n"
        "    peaks[name] = tracker.peak() / n / n\n"
        "print(json.dumps(peaks))\n"
    )
    proc = run_python([str(script)], timeout=240, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert peaks["ours"] < 3.0 < 12.0 < peaks["torchao"], peaks
