"""Fixtures shared by the core tests and every adapter's tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests, with the reason, where CUDA is missing."""
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=["file", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty checkpoint location on each store kind the suite runs against."""
    if request.param == "file":
        yield f"file://{tmp_path_factory.mktemp('store')}"
    else:
        url = f"memory://taskpoint-tests/{uuid.uuid4().hex}"
        yield url
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
