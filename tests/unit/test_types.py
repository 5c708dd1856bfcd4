"""The package type-checks: mypy runs on it with the settings in ``pyproject.toml`` (``[tool.mypy]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_package_type_checks():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"
