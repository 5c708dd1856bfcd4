"""The docs site builds with ``mkdocs build --strict``, and the Python examples of its pages and of the README run.

The examples run through Sybil, page by page in page order, each page in its own namespace, on one CPU process. A
block that needs several processes, a model download or names it does not define carries Sybil's skip directive
(``<!-- skip: next "reason" -->``) and is reported as skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional
from unittest import SkipTest

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SITE_PACKAGES = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings_handlers.python": "mkdocstrings[python]"}


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package is missing
        return True


# -- the site ----------------------------------------------------------------------------------------------------------
def test_site_builds_strictly(tmp_path: Path) -> None:
    missing = [package for module, package in SITE_PACKAGES.items() if _missing(module)]
    if missing:
        pytest.skip(f"the docs packages are not installed ({', '.join(missing)}): pip install -e '.[dev]'")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    # the generated pages are there, and were generated from the code and configs
    configs = (site / "reference" / "configs" / "index.html").read_text(encoding="utf-8")
    assert "strategy.cpu_offload" in configs and "experiment=assistant" in configs
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--device-memory" in cli and "--merge-into" in cli and "--no-checksums" in cli
    api = (site / "reference" / "api" / "lightning_fsdp" / "index.html").read_text(encoding="utf-8")
    assert "FSDPCustomStrategy" in api and "auto_wrap_policy" in api
    assert (site / "benchmarks" / "results" / "memory_per_rank_vs_world.png").is_file()
    layout = (site / "howto" / "layout" / "index.html").read_text(encoding="utf-8")
    assert "<code>trainer/</code>" in layout and "<code>callbacks/</code>" in layout


# -- the examples --------------------------------------------------------------------------------------------------------
class _Page:
    """A page's examples, evaluated in order on demand; the outcome of each is kept for its test."""

    def __init__(self, path: Path) -> None:
        from sybil import Document
        from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

        self.document = Document.parse(str(path), PythonCodeBlockParser(), SkipParser())
        self.examples = list(self.document)
        self.outcomes: dict[int, Optional[BaseException]] = {}

    def python_lines(self) -> list[int]:
        return [ex.line for ex in self.examples if type(ex.region.evaluator).__name__ == "PythonEvaluator"]

    def outcome(self, line: int) -> Optional[BaseException]:
        for index, example in enumerate(self.examples):
            if index not in self.outcomes:
                try:
                    example.evaluate()
                    self.outcomes[index] = None
                except Exception as err:  # noqa: BLE001 - kept for the example's own test
                    self.outcomes[index] = err
            if example.line == line and type(example.region.evaluator).__name__ == "PythonEvaluator":
                return self.outcomes[index]
        raise LookupError(f"no Python example at line {line}")


_PAGES: dict[Path, _Page] = {}


def _examples() -> list[Any]:
    if _missing("sybil"):
        return [pytest.param(None, 0, marks=pytest.mark.skip(reason="sybil is not installed: pip install -e '.[dev]'"),
                             id="sybil-missing")]
    params = []
    for path in PAGES:
        for line in _Page(path).python_lines():
            params.append(pytest.param(path, line, id=f"{path.relative_to(ROOT).as_posix()}:{line}"))
    return params


@pytest.fixture(scope="module")
def clean_process_group() -> Any:
    """The Trainer examples start a one-process gloo group; it ends with them, not with this worker."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("path", "line"), _examples())
def test_example_runs(path: Path, line: int, clean_process_group: Any, tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.getbasetemp())  # anything an example writes lands in pytest's temp folder
    page = _PAGES.get(path) or _PAGES.setdefault(path, _Page(path))
    outcome = page.outcome(line)
    if isinstance(outcome, SkipTest):
        pytest.skip(f"{path.relative_to(ROOT).as_posix()}:{line}: {outcome}")
    if outcome is not None:
        raise outcome
