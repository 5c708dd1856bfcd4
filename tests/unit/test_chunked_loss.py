"""The chunked causal-LM loss equals the loss over the whole logits, value and every gradient, without the logits.

Real transformers Llamas (tied and untied heads), chunk sizes that do and do not divide the token count, padding and
``-100`` runs, fp32 and bf16 autocast, through ``HFCausalLM``'s own step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fsdp.loss import IGNORE_INDEX, causal_lm_token_loss, chunked_causal_lm_eval, chunked_causal_lm_loss

pytest.importorskip("transformers")


def _labels(shape: tuple[int, int], vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, shape)
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -7:] = IGNORE_INDEX  # padding
    labels[1, 3:6] = IGNORE_INDEX  # a masked run inside
    return labels


class HookedLinear(nn.Linear):
    """Not a plain ``nn.Linear`` (its own ``forward``): the loss calls it as a module (the recomputing path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class InitialisedLinear(nn.Linear):
    """A subclass that keeps ``nn.Linear.forward`` (own initialisation only): the loss may multiply it itself."""


@pytest.mark.parametrize("chunk", [1, 5, 16, 4096])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("path", ["fused", "recomputed"])
def test_loss_and_gradients_equal_the_whole_logits(chunk, shift, path):
    from lightning_fsdp.loss.linear_cross_entropy import plain_linear

    torch.manual_seed(0)
    head = (nn.Linear if path == "fused" else HookedLinear)(24, 301)
    assert (plain_linear(head) is not None) == (path == "fused")
    assert plain_linear(InitialisedLinear(2, 3)) is not None
    hooked = nn.Linear(2, 3)
    hooked.register_forward_pre_hook(lambda module, args: None)  # e.g. FSDP2's unshard: the module must be called
    assert plain_linear(hooked) is None
    hidden = torch.randn(2, 19, 24, requires_grad=True)
    labels = _labels((2, 19), 301)
    whole, count = causal_lm_token_loss(head(hidden), labels, shift=shift)
    whole.backward()
    expected = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    total, chunked_count = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=chunk, shift=shift)
    total.backward()
    assert int(chunked_count) == int(count)
    torch.testing.assert_close(total, whole)
    for got, want in zip([hidden.grad, head.weight.grad, head.bias.grad], expected):
        torch.testing.assert_close(got, want)
    evaluated, _, correct = chunked_causal_lm_eval(hidden, head, labels, chunk_tokens=chunk, shift=shift)
    torch.testing.assert_close(evaluated, whole)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_hf_causal_lm_step_is_the_same_chunked(tmp_path, tied, precision):
    """``HFCausalLM``'s summed loss and every parameter's gradient, chunked (7 tokens) against the whole logits."""
    from lightning_fsdp.models import HFCausalLM
    from tests.helpers.hf import write_llama

    model_dir = write_llama(tmp_path / "llama", tie_word_embeddings=tied)
    torch.manual_seed(1)
    batch = {"input_ids": torch.randint(0, 37, (2, 23)), "labels": _labels((2, 23), 37),
             "attention_mask": torch.ones(2, 23, dtype=torch.long)}
    batch["attention_mask"][1, -7:] = 0
    results = []
    for chunk in (None, 7):
        module = HFCausalLM(model_dir, from_pretrained=True, loss_chunk=chunk)
        module.configure_model()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            total, count, _ = module.token_sums(batch)
        total.backward()
        results.append((total.detach(), count, {n: p.grad for n, p in module.named_parameters()}))
    (whole, n1, g1), (chunked, n2, g2) = results
    assert int(n1) == int(n2)
    if precision == "32-true":
        torch.testing.assert_close(chunked, whole)
        torch.testing.assert_close(g2, g1)
    else:  # the same bf16 matmuls, the head's gradient rounded to bf16 per chunk: bf16's relative error
        torch.testing.assert_close(chunked, whole, rtol=1.6e-2, atol=1e-5)
        for name in g1:
            assert (g2[name] - g1[name]).norm() <= 1e-2 * g1[name].norm(), name
    assert ("model.lm_head.weight" in g1) is not tied  # tied: one parameter, both gradients in it


def test_bad_chunks_and_heads_are_named(tmp_path):
    from lightning_fsdp.models import HFCausalLM
    from tests.helpers.hf import write_llama

    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="must be a positive integer"):
            HFCausalLM(tmp_path, loss_chunk=bad)
    with pytest.raises(ValueError, match="must be a positive integer"):
        chunked_causal_lm_loss(torch.zeros(1, 2, 3), nn.Linear(3, 4), torch.zeros(1, 2, dtype=torch.long), chunk_tokens=0)

    module = HFCausalLM(write_llama(tmp_path / "llama"), from_pretrained=True)
    module.configure_model()
    module.model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"cannot use the chunked loss.*loss_chunk=None"):
        module.token_sums((torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)))


def test_under_torch_compile_untrained_positions_stay_and_still_count_for_nothing():
    """Compiled, the loss keeps every position (no data-dependent shapes); ``-100`` still adds nothing."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    total = torch.compile(lambda h: chunked_causal_lm_loss(h, head, labels, chunk_tokens=4)[0])(hidden)
    total.backward()
    compiled_grad, hidden.grad = hidden.grad, None
    whole, _ = causal_lm_token_loss(head(hidden), labels)
    whole.backward()
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(compiled_grad, hidden.grad)


def test_back_propagating_the_fused_loss_twice_is_refused():
    """Its backward scales the kept gradients in place (no copy of the head's weight gradient), so a second
    backward of the same graph would be wrong: it is refused by name."""
    torch.manual_seed(0)
    head = nn.Linear(8, 32, bias=False)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.randint(0, 32, (2, 6))
    total, _ = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=4)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagate twice"):
        total.backward()


def test_the_token_loss_lifts_half_precision_to_fp32_and_keeps_fp64():
    """A float64 reference loop must not be rounded to fp32 inside the loss it checks against."""
    labels = torch.tensor([[0, 1, IGNORE_INDEX, 2]])
    logits = torch.randn(1, 4, 3, dtype=torch.float64)
    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float64, torch.float64)):
        total, count = causal_lm_token_loss(logits.to(dtype), labels)
        assert total.dtype == expected and int(count) == 2
    exact = torch.nn.functional.cross_entropy(logits[0, :-1], torch.tensor([1, IGNORE_INDEX, 2]), reduction="sum")
    assert causal_lm_token_loss(logits, labels)[0].item() == exact.item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 512])
def test_token_and_sequence_log_probs_through_a_frozen_head_equal_the_whole_logits(chunk, temperature):
    """LoRA's, QLoRA's and every reference's head is frozen: its fused path (no chunk recomputed) gives the log-probs,
    entropies, per-row sums and hidden-state gradients of the whole logits."""
    from lightning_fsdp.loss.chunked import sequence_log_probs, token_log_probs

    torch.manual_seed(0)
    rows, width, hidden_size, vocab = 3, 7, 8, 11
    head = nn.Linear(hidden_size, vocab, bias=True).requires_grad_(False)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, width))
    labels[0, :3] = IGNORE_INDEX
    labels[2, 5:] = IGNORE_INDEX
    weights = torch.randn(rows, width)

    logits = head(hidden).float() / temperature
    log_softmax = logits.log_softmax(-1)
    target = labels[:, 1:].clamp(min=0)
    keep = labels[:, 1:] != IGNORE_INDEX
    expected = torch.zeros(rows, width)
    expected[:, 1:] = log_softmax[:, :-1].gather(-1, target.unsqueeze(-1)).squeeze(-1) * keep
    expected_entropy = torch.zeros(rows, width)
    expected_entropy[:, 1:] = -(log_softmax.exp() * log_softmax).sum(-1)[:, :-1] * keep
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), hidden, retain_graph=True)

    logps, entropy = token_log_probs(hidden, head, labels, chunk_tokens=chunk, temperature=temperature)
    (grad,) = torch.autograd.grad((logps * weights).sum(), hidden)
    torch.testing.assert_close(logps, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    torch.testing.assert_close(grad, expected_grad)
    assert not entropy.requires_grad

    if temperature == 1.0:
        sums, counts = sequence_log_probs(hidden, head, labels, chunk_tokens=chunk)
        torch.testing.assert_close(sums, expected.sum(1))
        assert counts.tolist() == keep.sum(1).tolist()
        (row_grad,) = torch.autograd.grad((sums * weights[:, 0]).sum(), hidden)
        (expected_row_grad,) = torch.autograd.grad((expected.sum(1) * weights[:, 0]).sum(), hidden)
        torch.testing.assert_close(row_grad, expected_row_grad)
