"""Runs every Python block of the guides (``docs/**/*.md``) as a test, so the docs cannot rot.

The blocks are collected by pytest-markdown-docs' Markdown collector (its syntax for
Material for MkDocs: ```` ```{.python fixture:NAME} ````), here without its
``--markdown-docs`` flag, which would also collect every docstring of every module under
``tests/`` and ``integrations/``. Each block runs as its own module, in an empty working
directory, so a task's checkpoints go to a fresh ``.taskpoint/checkpoints``, with none of the
environment contract's variables set.

A block names the reader's own code (``train_step(step)``, ``make_model()``) without
defining it; ``fixture:NAME`` in its info string supplies a stand-in from this file. Every
stand-in fails once on purpose, as a reclaimed machine would, so the block's task really
retries, and after the block has run it checks that the retry *resumed* from the checkpoint
instead of starting over (a test error otherwise). A block that needs what a test run does
not have says so with ``fixture:needs_cuda`` or ``fixture:needs_unsloth``, which skip it with
the reason.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ENV_CONTRACT = (
    "TASKPOINT_ROOT", "TASKPOINT_ACTION", "TASKPOINT_RUN_ID", "TASKPOINT_ATTEMPT",
    "TASKPOINT_GRACE_PERIOD",
)
"""Variables that would send the blocks' checkpoints elsewhere; unset for every block."""


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Every Markdown page of the guides; the API reference pages hold no code."""
    if file_path.suffix != ".md" or "api" in file_path.relative_to(Path(__file__).parent).parts:
        return None
    if parent.config.option.markdowndocs:  # the plugin's own flag collects it already
        return None
    from pytest_markdown_docs.plugin import MarkdownTextFile

    class GuidePage(MarkdownTextFile):  # type: ignore[misc]
        """A guide's blocks; one that needs CUDA is a ``gpu`` test, which ``pytest -m gpu``
        selects on a CUDA machine (``conftest.py`` skips it elsewhere, with the reason)."""

        def collect(self) -> Iterator[pytest.Item]:
            for item in super().collect():
                if "needs_cuda" in item.fixturenames:
                    item.add_marker(pytest.mark.gpu)
                yield item

    parent.config.option.markdowndocs_syntax = "superfences"
    collected: pytest.Collector = GuidePage.from_parent(parent, path=file_path)
    return collected


class SimulatedCrash(RuntimeError):
    """What a stand-in raises once, on purpose, as a dying attempt would."""


@pytest.fixture(autouse=True)
def docs_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: the default root ``.taskpoint/checkpoints`` is fresh."""
    for name in ENV_CONTRACT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _attempt() -> int:
    import taskpoint

    context = taskpoint.ctx()
    assert context is not None and context.attempt is not None, "called outside a task"
    return context.attempt


class Calls:
    """The calls a stand-in saw: ``(attempt, value)`` each; raises once at ``crash_at``."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.seen: list[tuple[int, Any]] = []

    def hit(self, value: Any = None) -> None:
        self.seen.append((_attempt(), value))
        if len(self.seen) == self.crash_at:
            raise SimulatedCrash(f"simulated crash at call {self.crash_at}")

    def split(self) -> tuple[list[Any], list[Any]]:
        """The values of the attempt that crashed, and of the attempt after it."""
        assert len(self.seen) >= self.crash_at, (
            f"the block called the stand-in {len(self.seen)} times, never reaching the crash at "
            f"call {self.crash_at}: does it call its task?"
        )
        crashed = self.seen[self.crash_at - 1][0]
        before = [v for a, v in self.seen if a == crashed]
        after = [v for a, v in self.seen if a == crashed + 1]
        assert after, f"no attempt after attempt {crashed} crashed: the task was not retried"
        return before, after


def resumed_from_a_checkpoint(workdir: Path) -> None:
    """The store under ``workdir`` records a retry that loaded a committed checkpoint."""
    records = [
        json.loads(p.read_text())
        for p in workdir.glob(".taskpoint/checkpoints/*/*/attempts/*.resume.json")
    ]
    assert any(r.get("checkpoint") for r in records), (
        "no attempt resumed from a checkpoint (no attempts/<n>.resume.json names one)"
    )


# -- stand-ins for the reader's code -----------------------------------------------------


@pytest.fixture
def train_step(docs_workdir: Path) -> Iterator[Callable[[int], None]]:
    """``train_step(step)``: one step of work. Dies in step 5 of the first attempt; the
    retry must start past step 0, at most at the step that died."""
    calls = Calls(crash_at=6)
    yield calls.hit
    before, after = calls.split()
    assert 0 < after[0] <= before[-1], f"the retry started at step {after[0]}, not resumed"
    resumed_from_a_checkpoint(docs_workdir)


def _weights(model: Any) -> tuple[float, ...]:
    return tuple(v for p in model.parameters() for v in p.detach().flatten().tolist())


@pytest.fixture
def train_one_epoch(docs_workdir: Path) -> Iterator[Callable[..., None]]:
    """``train_one_epoch(model, opt)``: one epoch of a PyTorch loop. Dies in the 4th epoch;
    the retry's model must start from the weights a completed epoch ended with."""
    import torch

    calls = Calls(crash_at=4)
    ends: list[tuple[float, ...]] = []

    def train_one_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        calls.hit(_weights(model))
        x = torch.randn(8, model.in_features if hasattr(model, "in_features") else 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ends.append(_weights(model))

    yield train_one_epoch
    _, after = calls.split()
    assert after[0] in ends, "the retry's model did not start from a saved epoch's weights"
    resumed_from_a_checkpoint(docs_workdir)


@pytest.fixture
def next_chunk(docs_workdir: Path) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``next_chunk(rng)``: the next ``(x, y)`` chunk for ``partial_fit``, drawn from ``rng``.
    Dies in the 4th chunk; the retry's generator must continue a saved one."""
    import numpy as np

    calls = Calls(crash_at=4)

    def next_chunk(rng: np.random.Generator) -> tuple[Any, Any]:
        calls.hit(json.dumps(rng.bit_generator.state))
        x = rng.standard_normal((32, 8))
        return x, (x[:, 0] > 0).astype(int)

    yield next_chunk
    before, after = calls.split()
    assert after[0] in before[1:], "the retry drew from a fresh generator, not the saved one"
    resumed_from_a_checkpoint(docs_workdir)


class _LightningParts:
    """``make_model()`` / ``make_loader()`` for Lightning: a tiny regression, 10 batches an
    epoch. Dies in step 25; the retry must start at a saved step."""

    def __init__(self) -> None:
        self.calls = Calls(crash_at=26)

    def make_model(self) -> Any:
        import lightning as L
        import torch

        calls = self.calls

        class Tiny(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                calls.hit(self.global_step)
                x, y = batch
                return torch.nn.functional.mse_loss(self.layer(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        torch.manual_seed(0)
        return Tiny()

    def make_loader(self) -> Any:
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
        return DataLoader(data, batch_size=4)

    def check(self, workdir: Path) -> None:
        _, after = self.calls.split()
        assert after[0] > 0, "the retry started at step 0, not resumed"
        resumed_from_a_checkpoint(workdir)


class _HfParts:
    """``make_model()`` / ``make_dataset()`` for the Hugging Face Trainer: a linear
    regressor on 80 rows (10 steps an epoch at the Trainer's batch of 8). Dies in the 26th
    forward pass; the retry must run fewer steps than a fresh start would."""

    def __init__(self) -> None:
        self.calls = Calls(crash_at=26)

    def make_model(self) -> Any:
        import torch

        calls = self.calls

        class Regressor(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(4, 1)

            def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
                calls.hit()
                return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

        torch.manual_seed(0)
        return Regressor()

    def make_dataset(self) -> Any:
        import torch

        class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
            def __init__(self) -> None:
                g = torch.Generator().manual_seed(0)
                self.x = torch.randn(80, 4, generator=g)
                self.y = torch.randn(80, generator=g)

            def __len__(self) -> int:
                return len(self.y)

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                return {"x": self.x[i], "labels": self.y[i]}

        return Rows()

    def check(self, workdir: Path) -> None:
        _, after = self.calls.split()
        # Started over, the retry would run every step: at least as many as the first
        # attempt reached before it died.
        assert len(after) < self.calls.crash_at, f"the retry ran {len(after)} steps: it started over"
        resumed_from_a_checkpoint(workdir)


@pytest.fixture
def _framework_parts(request: pytest.FixtureRequest, docs_workdir: Path) -> Iterator[Any]:
    """The page's stand-ins: its file names the framework (``lightning.md``, ``hf.md``)."""
    page = Path(str(request.node.path)).stem
    parts = {"lightning": _LightningParts, "hf": _HfParts}.get(page)
    assert parts is not None, f"no make_model()/make_dataset() stand-ins for {page}.md"
    made = parts()
    yield made
    made.check(docs_workdir)


@pytest.fixture
def make_model(_framework_parts: Any) -> Callable[[], Any]:
    """``make_model()``: the reader's model (a LightningModule on the Lightning page)."""
    return _framework_parts.make_model  # type: ignore[no-any-return]


@pytest.fixture
def make_loader(_framework_parts: Any) -> Callable[[], Any]:
    """``make_loader()``: the reader's training DataLoader."""
    return _framework_parts.make_loader  # type: ignore[no-any-return]


@pytest.fixture
def make_dataset(_framework_parts: Any) -> Callable[[], Any]:
    """``make_dataset()``: the reader's training dataset."""
    return _framework_parts.make_dataset  # type: ignore[no-any-return]


@pytest.fixture
def restores_sigterm() -> Iterator[None]:
    """For blocks that send themselves SIGTERM: the test process's own handler and
    taskpoint's preemption notice are put back afterwards."""
    import signal

    from taskpoint import preemption

    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)
    preemption.reset()


# -- blocks a test run cannot execute ----------------------------------------------------


@pytest.fixture
def needs_cuda() -> None:
    """Skips a block that needs a CUDA device where torch sees none."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture
def needs_unsloth() -> None:
    """Unsloth pins older transformers/TRL/torch than this environment: its block runs in
    ``.venv-unsloth``, through ``tests/test_docs.py::test_unsloth_quickstart``."""
    pytest.skip(
        "Unsloth runs in its own environment (.venv-unsloth): "
        "tests/test_docs.py::test_unsloth_quickstart runs this block there"
    )


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch, docs_workdir: Path) -> Iterator[None]:
    """The variables ``torchrun`` gives a worker, for a group of one process (rank 0 of 1,
    a free loopback port): a block written for torchrun runs as that one rank, gloo on CPU.
    The process group it starts is destroyed afterwards if the block did not."""
    import socket
    import uuid

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": f"docs-{uuid.uuid4().hex[:8]}", "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # `torchrun train.py`: the task's name
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
