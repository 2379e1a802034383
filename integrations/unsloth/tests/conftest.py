"""Fixtures for the taskpoint-unsloth tests (run in integrations/unsloth's own environment).

Without Unsloth installed (the root workspace's environment) every test module skips
itself with ``pytest.importorskip("unsloth")``, so nothing here imports Unsloth eagerly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # unsloth_testkit, for tests and children

GPU_SKIP = "needs a CUDA device (torch.cuda.is_available() is False)"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests, with the reason, where CUDA is missing.

    With ``TASKPOINT_REQUIRE_GPU=1`` (the GPU script and workflow) that is an error instead,
    so a CUDA runner whose driver is broken fails rather than passing with everything skipped.
    """
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu and not _cuda_available():
        if os.environ.get("TASKPOINT_REQUIRE_GPU") == "1":
            raise pytest.UsageError(
                f"TASKPOINT_REQUIRE_GPU=1 but {len(gpu)} gpu test(s) would be skipped: "
                "torch.cuda.is_available() is False (no driver, or one too old for this torch)"
            )
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Bitwise-reproducible CPU math, the same as in the child processes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its tokenizer saved to disk, as a local base model."""
    import unsloth_testkit as kit

    return kit.make_base_model(tmp_path_factory.mktemp("base") / "tiny-llama")


@pytest.fixture(scope="session")
def reference(
    tmp_path_factory: pytest.TempPathFactory, base_model: Path
) -> Callable[..., Any]:
    """``reference(**overrides)``: the uninterrupted run's result, computed once per overrides."""
    import torch
    import unsloth_testkit as kit

    cache: dict[tuple[tuple[str, Any], ...], kit.Result] = {}

    def get(**overrides: Any) -> kit.Result:
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out = tmp_path_factory.mktemp("reference")
                cache[key] = kit.run_unsloth_sft(None, out, base_model, **overrides)
            finally:
                torch.set_num_threads(before)
        return cache[key]

    return get
