"""``lightning-fsdp check``, run for real: two gloo ranks started by its own ``-n``, every check in one launch."""

from __future__ import annotations

import pytest

from tests.helpers.launch import run_python

COMMAND = ["-m", "lightning_fsdp", "check"]


def test_the_self_check_reports_every_check_and_passes_on_this_machine():
    """At context_parallel=2, so the parity and the throughput run go through ring attention too."""
    proc = run_python([*COMMAND, "-n", "2", "--cp", "2", "--model", "gpt-tiny", "--steps", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout
    for check in ("backend and devices", "all-gather bandwidth", "reduce-scatter bandwidth", "parity: sharded vs one"
                  " device", "bf16", "torch.compile", "step throughput", "model FLOPs utilisation",
                  "planner vs measured"):
        assert f"| {check}" in table, table
    assert "gloo, 2 × cpu" in table and "cp=2" in table and "every check passed" in table
    assert "GB/s" in table and "tokens/s" in table and "planned" in table
    assert table.count("lightning-fsdp check:") == 1  # rank 0 prints the table
    assert "FutureWarning" not in proc.stderr and "deprecated" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["-n", "2", "--cp", "3"], "--cp 3 does not divide the 2 ranks"),
    (["--model", "gpt-huge"], "is not a GPT preset"),
    (["--cp", "0"], "positive int"),
])
def test_bad_arguments_are_refused_before_any_process_starts(args, message):
    proc = run_python([*COMMAND, *args], timeout=60)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]
