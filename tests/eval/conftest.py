"""Fixtures of the evaluation tests."""

from __future__ import annotations

import datasets
import pytest

from tests.benchmark_fixtures import write_sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Each benchmark's rows in one kind of source (tests/benchmark_fixtures.py)."""
    return write_sources(tmp_path_factory.mktemp("benchmarks"))


@pytest.fixture
def hub_cache(sources, tmp_path, monkeypatch):
    from huggingface_hub import constants  # noqa: PLC0415

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(sources["hub"]))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
