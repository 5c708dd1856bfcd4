"""The package as users get it: a built wheel, installed, discovered through its entry points."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.helpers.launch import REPO

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import setuptools.command.bdist_wheel"], capture_output=True).returncode != 0,
    reason="building a wheel offline needs setuptools>=70 (the dev extra installs it)",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next((tmp / "dist").glob("lightning_fsdp-*.whl"))
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    return wheel, site


def test_wheel_ships_configs_and_entry_points(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("lightning_fsdp/configs/") and n.endswith(".yaml") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[lightning.pytorch.strategies]" in text and "fsdp_custom_hybrid" in text
    assert "lightning-fsdp = lightning_fsdp.cli:main" in text
    # every subpackage in the tree ships: a package left out of pyproject's list only fails on a user's machine
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "lightning_fsdp").rglob("__init__.py")}
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages <= shipped, f"missing from [tool.setuptools] packages: {sorted(packages - shipped)}"
    # every config group's YAML ships too (a group folder left out of the list ships nothing)
    yamls = {"lightning_fsdp/" + str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")}
    assert yamls <= set(names), f"config files missing from the wheel: {sorted(yamls - set(names))}"


def test_tools_discover_strategies_without_knowing_the_module(installed, tmp_path):
    _, site = installed
    probe = (
        "from importlib.metadata import entry_points\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "eps = {ep.name: ep for ep in entry_points(group='lightning.pytorch.strategies')}\n"
        "specs = {n: ep.load() for n, ep in eps.items()}\n"
        "for spec in specs.values(): spec.register(StrategyRegistry)\n"
        "import lightning_fsdp\n"
        "assert lightning_fsdp.__file__.startswith(%r), lightning_fsdp.__file__\n"
        "print(sorted(n for n in StrategyRegistry.available_strategies() if n.startswith('fsdp_custom')))\n"
    ) % str(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['fsdp_custom', 'fsdp_custom_hybrid', 'fsdp_custom_offload', 'fsdp_custom_qlora']"
