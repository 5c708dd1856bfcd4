"""Bring your own LightningModule: one Trainer flag shards it with FSDP2. Run: `python examples/quickstart.py`."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fsdp  # noqa: F401  (registers strategy="fsdp_custom")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.blocks(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    L.seed_everything(0)  # every rank builds the same data; the sampler gives each rank its part
    x = torch.randn(4096, 64)
    data = DataLoader(TensorDataset(x, x[:, :8].sum(1, keepdim=True)), batch_size=64)
    trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=2, max_epochs=3, logger=False)
    trainer.fit(Regressor(), data)
