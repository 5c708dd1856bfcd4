"""What a run shows a person, on a real single-process Trainer: the progress bar's title on ``max_steps`` runs and
the loss curve drawn from the CSV log."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_fsdp.callbacks import LossCurve
from lightning_fsdp.callbacks.loss_curve import read_curves
from lightning_fsdp.trainer.progress import StepRichProgressBar, epoch_title, progress_bar


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_epoch_title_counts_epochs_only_when_they_bound_the_run():
    assert epoch_title(0, -1) == epoch_title(0, None) == "Epoch 0"
    assert epoch_title(2, 5) == "Epoch 2/4"
    assert progress_bar(enabled=False) is None and isinstance(progress_bar(), StepRichProgressBar)


def test_a_max_steps_run_is_titled_by_its_epoch_and_its_losses_drawn(tmp_path):
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    bar, curve = StepRichProgressBar(), LossCurve()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, val_check_interval=4, log_every_n_steps=2,
                        logger=CSVLogger(tmp_path, name="csv", version=""), callbacks=[bar, curve],
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(Regression(), data, data)
    assert trainer.max_epochs == -1 and bar._get_train_description(0).strip() == "Epoch 0"

    metrics_csv = tmp_path / "csv" / "metrics.csv"
    curves = read_curves(metrics_csv, ("train_loss", "val_loss"))
    assert len(curves["train_loss"]) == 6 and len(curves["val_loss"]) == 3
    assert curves["train_loss"][-1][1] < curves["train_loss"][0][1]
    assert curve.path == tmp_path / "csv" / "loss_curve.png" and curve.path.stat().st_size > 5_000
