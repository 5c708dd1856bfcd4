"""``ShardedAverage`` and its ``ShardedEMA`` callback in one process (plain tensors): the update rule, the swap, what it tracks, and the refusal of
Lightning's own ``WeightAveraging`` under ``fsdp_custom`` (before any process starts)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_fsdp import ShardedAverage, ShardedEMA
from tests.helpers.models import TinyLM


class Frozen(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trained = nn.Linear(3, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(2)  # float running stats, and an integer counter


def test_update_is_the_exponential_moving_average_and_the_first_update_copies():
    module = Frozen()
    ema = ShardedAverage(decay=0.75)
    ema.update(module)
    first = module.trained.weight.detach().clone()
    with torch.no_grad():
        module.trained.weight.add_(4.0)
    ema.update(module)
    average = dict(zip(ema.names, ema.average_tensors()))
    torch.testing.assert_close(average["trained.weight"], 0.75 * first + 0.25 * (first + 4.0))
    assert ema.n_averaged == 2


def test_frozen_parameters_and_integer_buffers_are_not_copied():
    module = Frozen()
    ema = ShardedAverage()
    ema.update(module)
    assert ema.names == ["trained.weight", "trained.bias", "norm.weight", "norm.bias", "norm.running_mean",
                          "norm.running_var"]
    assert ShardedAverage(use_buffers=False).tracked(module)[-1][0] == "norm.bias"


def test_swap_exchanges_weights_and_average_and_after_fit_the_model_holds_the_average():
    module = Frozen()
    ema = ShardedEMA(decay=0.5)
    ema.average.update(module)
    trained = module.trained.weight.detach().clone()
    with torch.no_grad():
        module.trained.weight.mul_(3.0)
    ema.average.update(module)  # average = 0.5·w + 0.5·3w = 2w
    ema.on_validation_epoch_start(None, module)
    torch.testing.assert_close(module.trained.weight, 2 * trained)
    ema.on_validation_epoch_end(None, module)
    torch.testing.assert_close(module.trained.weight, 3 * trained)
    ema.on_train_end(None, module)
    torch.testing.assert_close(module.trained.weight, 2 * trained)


def test_average_on_another_device_and_the_state_that_is_saved():
    module = Frozen()
    ema = ShardedEMA(device="cpu", decay=0.9, update_every_n_steps=2)
    ema.average.update(module)
    assert {str(t.device) for t in ema.average_tensors()} == {"cpu"}
    assert ema.state_dict() == {"latest_update_step": 0, "latest_update_epoch": -1, "n_averaged": 1, "decay": 0.9}
    assert ema.should_update(step_idx=0) and not ema.should_update(step_idx=1)
    with pytest.raises(ValueError, match="decay must be in"):
        ShardedEMA(decay=1.5)


@pytest.mark.parametrize("callback", [EMAWeightAveraging(decay=0.9)], ids=["EMAWeightAveraging"])
def test_lightnings_weight_averaging_is_refused_naming_the_replacement(tmp_path, callback):
    from lightning_fsdp.parallel.process_group import release_process_group

    release_process_group()  # a one-process fit earlier in this worker (test_memory, test_quantize) left its group
    trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=1, max_steps=1, callbacks=[callback],
                        logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=r"EMAWeightAveraging` keeps a full, unsharded copy.*ShardedEMA"):
        trainer.fit(TinyLM(), torch.utils.data.DataLoader([0]))
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group was created


def test_an_average_must_fit_the_model_it_is_loaded_into():
    """What both checkpoint formats check before reading an average: its keys are model keys of the same dtype and
    shape; the model keys it lacks (frozen parameters) are fine."""
    from lightning_fsdp.checkpoint import CheckpointError
    from lightning_fsdp.checkpoint.compatibility import check_entry_fits

    model = {"w": (torch.float32, (2, 3)), "frozen": (torch.float32, (2, 2))}
    check_entry_fits("ckpt", {"w": (torch.float32, (2, 3))}, model, what="ema_state_dict")
    unknown = r"its 'ema_state_dict' holds \[other\], which the current model does not have"
    with pytest.raises(CheckpointError, match=unknown):
        check_entry_fits("ckpt", {"w": (torch.float32, (2, 3)), "other": (torch.float32, (1,))}, model,
                         what="ema_state_dict")
    with pytest.raises(CheckpointError, match=r"w: checkpoint shape \(3, 2\), ema_state_dict \(2, 3\)"):
        check_entry_fits("ckpt", {"w": (torch.float32, (3, 2))}, model, what="ema_state_dict")
