"""Fixtures for the taskpoint-hf tests: one CPU thread, cached uninterrupted references."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # taskpoint_hf_testkit, for tests and children

import taskpoint_hf_testkit as kit
import torch
from taskpoint import preemption


@pytest.fixture(autouse=True)
def sigterm_as_before() -> Iterator[None]:
    """A test that signals its own process leaves no notice and no handler behind."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
    preemption.reset()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Bitwise-reproducible CPU math, the same as in the child processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., kit.Result]:
    """``reference(recipe, **overrides)``: the uninterrupted run's result, computed once."""
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], kit.Result] = {}

    def get(recipe: str, **overrides: Any) -> kit.Result:
        key = (recipe, tuple(sorted(overrides.items())))
        if key not in cache:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out = tmp_path_factory.mktemp(f"reference-{recipe}")
                cache[key] = kit.RECIPES[recipe](None, out, **overrides)
            finally:
                torch.set_num_threads(before)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Trainer output_dir holding complete checkpoint-3, -6, -9 and -12."""
    out = tmp_path_factory.mktemp("trained") / "out"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kit.run_classifier(None, out, save_total_limit=None)
    finally:
        torch.set_num_threads(before)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9",
    ]
    return out
