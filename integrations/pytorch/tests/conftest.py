"""Fixtures for the PyTorch adapter's tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).parent


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def lib() -> ModuleType:
    """The shared tiny training setup (``tp_torch_training.py``)."""
    return _load("tp_torch_training")


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as in the child processes, so results compare bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def child_env() -> dict[str, str]:
    """Environment for child Python processes: one thread, tests folder importable.

    Bytecode caching stays on for them even where the parent runs with
    PYTHONDONTWRITEBYTECODE: each child would otherwise recompile torch's Python sources
    (torch._dynamo alone, imported by every optimizer, takes over 15 s on 2 slow cores).
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    return env
