"""Activation offloading's pack/unpack path, exercised on CPU with plain copies (``copy_on_cpu``): a real Hugging
Face model trains exactly as without it, with and without activation checkpointing, and no parameter travels."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.sharding.activation_offload import ActivationOffload

pytest.importorskip("transformers")


def _llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import TINY_LLAMA

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _step(model, ids, offload=None):
    with offload if offload is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_offloaded_activations_give_the_same_loss_and_gradients(checkpointing):
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads = _step(_llama(checkpointing), ids)
    offload = ActivationOffload(min_bytes=0, copy_on_cpu=True)
    model = _llama(checkpointing)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved: list[int] = []
    original = offload._pack

    def pack(tensor):
        packed = original(tensor)
        if packed is not tensor:
            moved.append(tensor.untyped_storage().data_ptr())
        return packed

    offload._pack = pack
    offload_loss, offload_grads = _step(model, ids, offload)
    assert offload.offloaded == len(moved) > 0 and offload.offloaded_bytes > 0
    assert not weights & set(moved)  # no weight (or transposed weight) travels: only activations
    assert torch.equal(offload_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(offload_grads[name], grad), name


def test_on_cpu_without_copy_on_cpu_nothing_moves():
    offload = ActivationOffload(min_bytes=0)
    _step(_llama(False), torch.randint(0, 37, (1, 8)), offload)
    assert offload.offloaded == 0
