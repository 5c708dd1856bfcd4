"""LightningCLI: the strategy by registry name, by class path with init args, and from a YAML config whose policies
are lists of class names; an unknown strategy argument is named. Real ``fit`` runs of ``tests/scripts/cli_app.py``."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import SCRIPTS, run_python

APP = str(SCRIPTS / "cli_app.py")
FIT = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--model.dim", "12", "--model.heads", "2"]


def _fit(tmp_path, *args, devices=1):
    out = tmp_path / "cli.json"
    proc = run_python([APP, *FIT, "--trainer.devices", str(devices), "--trainer.default_root_dir", str(tmp_path), *args],
                      env={"CLI_APP_OUT": str(out)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_strategy_by_registry_name_on_two_ranks(tmp_path):
    report = _fit(tmp_path, "--trainer.strategy", "fsdp_custom", devices=2)
    assert report["strategy"] == "lightning_fsdp.trainer.strategy.FSDPCustomStrategy"
    assert report["world_size"] == 2 and report["global_step"] == 2
    assert report["wrapped_units"] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]


def test_strategy_by_class_path_with_init_args(tmp_path):
    report = _fit(
        tmp_path,
        "--trainer.strategy", "lightning_fsdp.FSDPCustomStrategy",
        "--trainer.strategy.auto_wrap_policy", "[Block]",
        "--trainer.strategy.state_dict_type", "full",
    )
    assert report["strategy"] == "lightning_fsdp.trainer.strategy.FSDPCustomStrategy"
    assert report["wrapped_units"] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]
    assert report["state_dict_type"] == "full" and "Block" in report["auto_wrap_policy"]


def test_strategy_from_a_yaml_config_with_policies_as_class_name_lists(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_fsdp.FSDPCustomStrategy\n"
        "    init_args:\n"
        "      auto_wrap_policy: [tests.helpers.models.Block]\n"
        "      activation_checkpointing_policy: [Block]\n"
        "      reshard_after_forward: false\n"
        "model:\n"
        "  lr: 0.02\n"
    )
    report = _fit(tmp_path, "--config", str(config))
    assert report["wrapped_units"] == ["net.layers.0", "net.layers.1", "net.layers.2", ""]
    assert "Block" in report["activation_checkpointing_policy"]


@pytest.mark.parametrize("typo", ["--trainer.strategy.auto_wrap_polcy", "--trainer.strategy.init_args.cpu_ofload"])
def test_unknown_strategy_argument_is_named(tmp_path, typo):
    proc = run_python([APP, *FIT, "--trainer.strategy", "lightning_fsdp.FSDPCustomStrategy", typo, "true"],
                      cwd=tmp_path)
    assert proc.returncode != 0
    assert typo.rsplit(".", 1)[1] in proc.stderr, proc.stderr[-3000:]
