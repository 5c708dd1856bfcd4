"""How a sharded run is compared with its one-process reference when Adam sits between gradient and parameter."""

from __future__ import annotations

import torch


def assert_params_up_to_adam_noise(params: dict, expected: dict, lr: float) -> None:
    """Parameters at fp32 default tolerances but for a counted few elements. Adam turns float noise in a gradient
    element that is mathematically ~0 into a step of up to ``lr``: that happens to single elements (routed
    experts, attention reduced in another order), so they are counted (at most 1 in 1000, each within 2·lr), not
    covered by a looser tolerance for all."""
    assert params.keys() == expected.keys()
    off, total = 0, 0
    for name, want in expected.items():
        got = params[name]
        close = torch.isclose(got, want, rtol=1.3e-6, atol=1e-5)
        assert ((got - want).abs()[~close] <= 2 * lr).all(), name
        off, total = off + int((~close).sum()), total + want.numel()
    assert off <= total // 1000, (off, total)


def assert_step_gradients_equal(run: dict, reference: dict, steps: int) -> None:
    """Every one of ``steps`` steps' whole gradients at torch's fp32 tolerances (what Adam then turns into the
    parameters: it scales float noise in gradient elements that are mathematically ~0 up to a step of ``lr``, so
    parameters after Adam are compared through their gradients). Both runs recorded them (``record_gradients``)."""
    got, want = (torch.load(r["gradients_path"], weights_only=True) for r in (run, reference))
    assert len(got) == len(want) == steps
    for step, (mine, theirs) in enumerate(zip(got, want)):
        assert mine.keys() == theirs.keys() and mine
        for name, grad in theirs.items():
            torch.testing.assert_close(mine[name], grad, msg=lambda m, n=name, s=step: f"step {s}, {n}: {m}")
