"""A tiny training setup whose result depends on every RNG, shared by the tests and the
child scripts they start (loaded by path: the tests run with --import-mode=importlib).

The loop draws from torch (DataLoader shuffle, dropout), NumPy (input noise) and Python
``random`` (a loss scale), steps an Adam optimizer, a StepLR scheduler and a CPU GradScaler,
and keeps a loss history as extra state, so leaving any of them out of a resume changes
the final parameters.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from taskpoint import CheckpointLike
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 6
SAMPLES = 24
BATCH = 6
STEPS_PER_EPOCH = SAMPLES // BATCH
EPOCHS = 5
SEED = 0


@dataclass
class Parts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loader: DataLoader[Any]

    def state(self, **kwargs: Any) -> TaskpointState:
        return TaskpointState(self.model, self.optimizer, self.scheduler, self.scaler, **kwargs)


class DelegatingCheckpoint:
    """A CheckpointLike passing its blocking saves and loads to ``inner``; the test
    wrappers below change what a save does around the inner one. The async forms are not
    used by these children."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def save_sync(self, data: Any) -> None:
        self.inner.save_sync(data)

    async def save(self, data: Any) -> None:
        raise NotImplementedError

    def load_sync(self) -> Path | None:
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        raise NotImplementedError


class SlowCheckpoint(DelegatingCheckpoint):
    """Delegates to a checkpoint; each save sleeps ``delay`` seconds first (an upload that
    takes a while), in the thread that saves."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def save_sync(self, data: Any) -> None:
        time.sleep(self.delay)
        super().save_sync(data)


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=gen)
    return TensorDataset(x, y)


def build(seed: int = SEED) -> Parts:
    """Seed every RNG, then make the model and its training objects."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    return Parts(model, optimizer, scheduler, scaler, loader)


def train_step(parts: Parts, xb: torch.Tensor, yb: torch.Tensor) -> float:
    noise = torch.from_numpy(np.random.normal(0.0, 0.05, size=tuple(xb.shape)).astype(np.float32))
    scale = 1.0 + random.uniform(-0.1, 0.1)
    parts.model.train()
    loss = nn.functional.mse_loss(parts.model(xb + noise) * scale, yb)
    parts.optimizer.zero_grad()
    parts.scaler.scale(loss).backward()
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    return float(loss.detach())


def run(
    parts: Parts,
    state: TaskpointState | None = None,
    checkpoint: CheckpointLike | None = None,
    *,
    epochs: int = EPOCHS,
    before_step: Callable[[int], None] | None = None,
    on_resume: Callable[[Any], None] | None = None,
    background: bool = False,
) -> dict[str, Any]:
    """Train to ``epochs``, resuming from and saving to ``checkpoint`` each epoch when given
    (in the background with ``background``: the last save is waited for at the end)."""
    resume = state.restore_sync(checkpoint) if state is not None and checkpoint is not None else None
    if on_resume is not None:
        on_resume(resume)
    start, step = (resume.epoch, resume.step) if resume else (0, 0)
    history: list[float] = list(resume.extra["history"]) if resume else []
    for epoch in range(start, epochs):
        for xb, yb in parts.loader:
            step += 1
            if before_step is not None:
                before_step(step)
            history.append(train_step(parts, xb, yb))
        parts.scheduler.step()
        if state is not None and checkpoint is not None:
            state.save_sync(
                checkpoint, epoch=epoch + 1, step=step, extra={"history": history},
                background=background,
            )
    if state is not None and background:
        state.wait()
    return snapshot(parts, history)


async def run_async(
    parts: Parts,
    state: TaskpointState,
    checkpoint: CheckpointLike,
    *,
    epochs: int = EPOCHS,
    before_step: Callable[[int], None] | None = None,
    on_resume: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """:func:`run` with the async ``restore``/``save``."""
    resume = await state.restore(checkpoint)
    if on_resume is not None:
        on_resume(resume)
    start, step = (resume.epoch, resume.step) if resume else (0, 0)
    history: list[float] = list(resume.extra["history"]) if resume else []
    for epoch in range(start, epochs):
        for xb, yb in parts.loader:
            step += 1
            if before_step is not None:
                before_step(step)
            history.append(train_step(parts, xb, yb))
        parts.scheduler.step()
        await state.save(checkpoint, epoch=epoch + 1, step=step, extra={"history": history})
    return snapshot(parts, history)


STEPS = 12
"""Steps of :func:`run_steps`."""


def data_generator() -> torch.Generator:
    """The generator :func:`run_steps` draws each step's batch from (saved as the state's
    ``generators={"data": ...}``, so a resumed run draws the same batches mid-epoch)."""
    return torch.Generator().manual_seed(4321)


def run_steps(
    parts: Parts,
    data: torch.Generator,
    state: TaskpointState | None = None,
    checkpoint: CheckpointLike | None = None,
    *,
    steps: int = STEPS,
    every: int | None = None,
    background: bool = False,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """A loop counted in steps, one batch drawn from ``data`` per step, calling
    ``save_sync(..., step=, every=every)`` after every step when a checkpoint is given."""
    resume = state.restore_sync(checkpoint) if state is not None and checkpoint is not None else None
    history: list[float] = list(resume.extra["history"]) if resume else []
    for step in range((resume.step if resume else 0) + 1, steps + 1):
        if before_step is not None:
            before_step(step)
        x = torch.randn(BATCH, FEATURES, generator=data)
        history.append(train_step(parts, x, x[:, :1] - x[:, 1:2]))
        if state is not None and checkpoint is not None:
            state.save_sync(
                checkpoint, step=step, extra={"history": history}, every=every,
                background=background,
            )
    if state is not None and background:
        state.wait()
    return snapshot(parts, history)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def snapshot(parts: Parts, history: list[float]) -> dict[str, Any]:
    """Copies of everything whose end state must match an uninterrupted run."""
    return _clone(
        {
            "model": parts.model.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict(),
            "history": history,
        }
    )


def bitwise_differences(a: Any, b: Any, path: str = "state") -> list[str]:
    """Where ``a`` and ``b`` differ, comparing tensors byte for byte."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        bytes_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bytes_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return [] if torch.equal(bytes_a, bytes_b) else [f"{path}: tensor bytes differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in bitwise_differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in bitwise_differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if np.float64(a).tobytes() == np.float64(b).tobytes() else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
