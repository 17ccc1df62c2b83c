"""Fixtures for tests/envs: a fake hub (``datasets.load_dataset``) so hub code paths run offline."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_hub(monkeypatch):
    """Make ``datasets.load_dataset(name, config, split=...)`` return ``rows[(name, config, split)]``.

    Returns the dict to fill and a list recording every call.
    """
    import datasets
    from datasets import Dataset

    rows: dict[tuple, list[dict]] = {}
    calls: list[tuple] = []

    def load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        return Dataset.from_list(rows[(name, config, split)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return rows, calls
