"""Tiny models for tests: small enough for several CPU processes, shaped to catch sharding bugs.

Dimensions default to values no world size of 2, 3 or 4 divides (uneven shards), the LM head is tied to the
embedding, and any parameter can be frozen.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset


class Block(nn.Module):
    """Pre-norm transformer block (causal self-attention + MLP)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has an exactly-zero gradient: Adam would amplify its noise
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 3 * dim + 1)
        self.out = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyLM(L.LightningModule):
    """A decoder LM as a LightningModule; built in ``__init__`` or, with ``build_in_configure_model``, lazily."""

    def __init__(
        self,
        vocab: int = 37,
        dim: int = 18,
        heads: int = 3,
        layers: int = 3,
        seq: int = 7,
        tied: bool = True,
        frozen: tuple[str, ...] = (),
        lr: float = 1e-2,
        build_in_configure_model: bool = False,
        optimizer: str = "adamw",
        shard_first_layer_myself: bool = False,
        shard_myself: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: Optional[nn.Module] = None
        if not build_in_configure_model:
            self._build()

    def _build(self) -> None:
        h = self.hparams
        net = nn.Module()
        net.emb = nn.Embedding(h.vocab, h.dim)
        net.pos = nn.Embedding(h.seq, h.dim)
        net.layers = nn.ModuleList([Block(h.dim, h.heads) for _ in range(h.layers)])
        net.norm = nn.LayerNorm(h.dim)
        net.head = nn.Linear(h.dim, h.vocab, bias=False)
        if h.tied:
            net.head.weight = net.emb.weight
        self.net = net
        for name, p in self.named_parameters():
            if any(name.startswith(f) for f in h.frozen):
                p.requires_grad_(False)

    def configure_model(self) -> None:
        if self.net is None:
            self._build()
        if self.hparams.shard_first_layer_myself:  # as a ModelParallelStrategy user would
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not isinstance(self.net.layers[0], FSDPModule):
                fully_shard(self.net.layers[0], mesh=self.device_mesh)
        if self.hparams.shard_myself:  # every block, then the root: as a ModelParallelStrategy user does
            from torch.distributed.fsdp import FSDPModule, fully_shard

            mesh = self.device_mesh
            if "data_parallel" in (mesh.mesh_dim_names or ()):  # ModelParallelStrategy's 2-D mesh
                mesh = mesh["data_parallel"]
            if not isinstance(self, FSDPModule):
                for layer in self.net.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        h = net.emb(x) + net.pos(torch.arange(x.shape[1], device=x.device))
        for layer in net.layers:
            h = layer(h)
        return net.head(net.norm(h))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)


def token_dataset(n: int = 64, vocab: int = 37, seq: int = 7, seed: int = 0) -> Dataset:
    """Next-token pairs from a fixed random sequence; the same on every rank (the sampler splits it)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return TensorDataset(data[:, :-1].clone(), data[:, 1:].clone())


def packed_dataset(n: int = 64, vocab: int = 37, seq: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Packed causal-LM rows: documents of random lengths end to end, ``position_ids`` restarting at each, labels
    aligned with the inputs (transformers' convention)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        positions, filled = [], 0
        while filled < seq:
            length = min(int(torch.randint(1, max(2, seq // 2) + 1, (1,), generator=g)), seq - filled)
            positions.append(torch.arange(length))
            filled += length
        rows.append({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat(positions)})
    return rows


class DistributedOrderSampler(Sampler[int]):
    """The global order Lightning's injected ``DistributedSampler`` (shuffle, seed 0) deals out to the ranks.

    With per-rank batch ``b`` on ``W`` ranks, step ``k`` of the sharded run sees exactly the slice
    ``perm[k*b*W:(k+1)*b*W]`` of this order, so a single process using it with batch ``b*W`` is the reference.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def loader(n: int, batch_size: int, vocab: int = 37, seq: int = 7, seed: int = 0, reference_order: bool = False,
           packed: bool = False) -> DataLoader:
    """Rank loaders are plain (Lightning injects the sampler); the reference replays the distributed order."""
    sampler = DistributedOrderSampler(n, int(os.environ.get("PL_GLOBAL_SEED", 0))) if reference_order else None
    data = packed_dataset(n, vocab, seq, seed) if packed else token_dataset(n, vocab, seq, seed)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


def build_model(spec: dict[str, Any]) -> tuple[L.LightningModule, int, int]:
    """The test model a job spec asks for, with the vocabulary and sequence length its data needs: ``spec["hf"]``
    (``HFCausalLM`` arguments; the tiny Llama's vocabulary, sequences of 7) or ``spec["model"]`` (``TinyLM``)."""
    if spec.get("gpt"):
        from lightning_fsdp.models import GPTLightningModule

        gpt = GPTLightningModule(**spec["gpt"])
        return gpt, gpt.config.vocab_size, gpt.config.seq_len
    if spec.get("hf"):
        from lightning_fsdp.models import HFCausalLM

        hf = dict(spec["hf"])
        cls = _nf4_reference_class() if hf.pop("nf4_reference", False) else HFCausalLM
        return cls(**hf), 37, 7
    kwargs = dict(spec.get("model", {}))
    if "frozen" in kwargs:
        kwargs["frozen"] = tuple(kwargs["frozen"])
    model = TinyLM(**kwargs)
    return model, model.hparams.vocab, model.hparams.seq


def _nf4_reference_class() -> type:
    from lightning_fsdp.models import HFCausalLM

    class NF4Reference(HFCausalLM):
        """The QLoRA reference in one process: ``from_pretrained``, then every frozen ``nn.Linear`` weight of the decoder
        layers replaced by torchao's ``to_nf4`` of its bf16 value, as QLoRA defines the quantized base."""

        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

            for module in self.model.get_base_model().model.layers.modules():
                if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                    module.weight = nn.Parameter(to_nf4(module.weight.detach().to(torch.bfloat16)), requires_grad=False)

    return NF4Reference

