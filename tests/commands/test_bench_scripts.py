"""Every benchmark under bench/ imports against the package as it is: a function renamed in the package would
otherwise break a benchmark unseen until its next run."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(path.stem for path in BENCH.glob("*.py")))
def test_benchmark_imports(script):
    importlib.import_module(f"bench.{script}")
