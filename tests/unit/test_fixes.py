"""Errors found below the front ends name the setting of the user's front end: the Trainer's, or Fabric's."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_fsdp import FSDPCustomFabricStrategy, FSDPCustomStrategy
from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.compatibility import check_fits, describe
from lightning_fsdp.fixes import FixWording, current_wording, worded_for
from lightning_fsdp.resilience.nonfinite import NonFiniteGuard

FRONT_ENDS = [
    (FSDPCustomStrategy, "pass ckpt_path=None", "set `strict_loading = False` on the LightningModule"),
    (FSDPCustomFabricStrategy, "do not call `fabric.load`",
     "pass `strict=False` to `fabric.load` or `fabric.load_raw`"),
]


@pytest.mark.parametrize(("front_end", "start_fresh", "matching_keys"), FRONT_ENDS, ids=["trainer", "fabric"])
def test_missing_checkpoint_and_mismatched_keys_name_the_setting(tmp_path, front_end, start_fresh, matching_keys):
    runtime = front_end().runtime
    missing = re.escape(f"does not exist. Check the path (or {start_fresh} to start fresh)")
    with pytest.raises(CheckpointError, match=missing):
        runtime.load(tmp_path / "missing", torch.nn.Linear(2, 2), [], strict=True)
    saved, current = describe({"a": torch.zeros(2)}), describe({"b": torch.zeros(2)})
    with worded_for(runtime.wording), pytest.raises(CheckpointError, match=re.escape(f"or {matching_keys} to load")):
        check_fits("ckpt", saved, current, strict=True)
    assert current_wording() == FixWording()  # only while the front end's work runs


def test_the_nonfinite_guard_keeps_the_wording_of_the_front_end_it_was_built_for():
    trainer_guard = FSDPCustomStrategy(skip_nonfinite_steps=True).runtime.resilience.nonfinite
    assert trainer_guard is not None and "gradient_clip_val" in trainer_guard.wording.clip_gradients
    assert NonFiniteGuard(3).wording == FixWording()  # built outside any front end: the neutral words
