"""Saves by training time (``train_time_interval``): a timedelta, ``"auto"`` or a
``taskpoint.SaveInterval``, in automatic and manual optimization, under DDP.

The clock is a fake one that advances at each batch start (:class:`Tick`): no test sleeps.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from lightning.pytorch.loggers import CSVLogger
from taskpoint import SaveInterval
from taskpoint_lightning import TaskpointModelCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")

SCRIPT = Path(__file__).with_name("interval_script.py")


class Clock:
    """Seconds that pass only when :class:`Tick` says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tick(L.Callback):
    """Advances the clock by ``step_s`` at every batch start (a step that takes that long)."""

    def __init__(self, clock: Clock, step_s: float = 10.0) -> None:
        self.clock, self.step_s = clock, step_s

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.now += self.step_s


class ManualModule(lib.TinyModule):
    """:class:`TinyModule` with manual optimization (Lightning PR #21699: its own
    ``train_time_interval`` never saves there)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


def saved_steps(dirpath: Path) -> list[int]:
    """The global steps of the ``*-step=N.ckpt`` files Lightning wrote."""
    found = (re.search(r"step=(\d+)", p.name) for p in dirpath.glob("*.ckpt"))
    return sorted(int(m.group(1)) for m in found if m)


def fit(
    mc: TaskpointModelCheckpoint, clock: Clock, module: L.LightningModule, step_s: float = 10.0,
    **kw: Any,
) -> None:
    trainer = lib.trainer([Tick(clock, step_s), mc], max_epochs=2, **kw)
    trainer.fit(module, lib.loader("shuffle"))


@pytest.mark.parametrize("module", [lib.TinyModule, ManualModule], ids=["automatic", "manual"])
def test_saves_every_interval_of_training_time(tmp_path: Path, module: type) -> None:
    clock = Clock()
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    interval = SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock)
    dirpath = tmp_path / "ckpts"
    mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, save_top_k=-1, train_time_interval=interval)
    fit(mc, clock, module(), default_root_dir=tmp_path)  # 10 steps of 10 s

    # 30 s after the start, then 30 s after each save (25 s reached within the next step);
    # none at the epochs' ends (as ModelCheckpoint with train_time_interval).
    assert saved_steps(dirpath) == [3, 6, 9]
    assert mc.save_interval == interval.choice
    restored = ckpt.load_sync()
    assert restored is not None and saved_steps(restored) == [3, 6, 9]


def test_a_timedelta_saves_under_manual_optimization(tmp_path: Path) -> None:
    """``train_time_interval=timedelta(...)``, Lightning's own knob, saves under manual
    optimization (it never did in Lightning: PR #21699). A microsecond passes at every step."""
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    dirpath = tmp_path / "ckpts"
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=dirpath, save_top_k=-1, train_time_interval=timedelta(microseconds=1)
    )
    fit(mc, Clock(), ManualModule(), default_root_dir=tmp_path)
    assert saved_steps(dirpath) == list(range(1, 11))
    assert mc.save_interval is not None
    assert mc.save_interval.rule == "fixed"
    assert mc.save_interval.interval_s == pytest.approx(1e-6)
    # Lightning's state key names the timedelta as ModelCheckpoint does.
    assert "train_time_interval': datetime.timedelta(microseconds=1)" in mc.state_key


def _failed_attempts(url: str, n: int) -> None:
    """``n`` attempts that started and failed, recorded as a runner records them."""
    for _ in range(n):
        attempt = taskpoint.Checkpoint(url)
        attempt.mark_started()
        attempt.mark_ended("failed", "RuntimeError: planned")


def test_auto_saves_more_often_after_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"auto"`` reads the run's failures from the store: a run that failed often gets a
    shorter interval (and more saves) than a new one, which uses the prior."""
    monkeypatch.delenv("TASKPOINT_MTBF_PRIOR_S", raising=False)
    runs: dict[str, tuple[TaskpointModelCheckpoint, list[int]]] = {}
    for name, failures in (("new", 0), ("failing", 60)):
        url = f"file://{tmp_path / name / 'store'}"
        _failed_attempts(url, failures)
        clock, dirpath = Clock(), tmp_path / name / "ckpts"
        ckpt = taskpoint.Checkpoint(url)
        mc = TaskpointModelCheckpoint(
            ckpt, dirpath=dirpath, save_top_k=-1,
            train_time_interval=SaveInterval.for_checkpoint(ckpt, "auto", clock=clock),
        )
        # Steps of 10 ms: an upload commits within a step or two, below both runs'
        # Young/Daly intervals (auto never saves faster than uploads commit).
        fit(mc, clock, lib.TinyModule(), step_s=0.01, default_root_dir=tmp_path / name)
        runs[name] = (mc, saved_steps(dirpath))

    new, failing = (runs[n][0].save_interval for n in ("new", "failing"))
    assert new is not None and failing is not None
    assert new.failures == 0 and failing.failures == 60
    assert new.mtbf_s == pytest.approx(4 * 3600, rel=0.01)  # the prior
    assert failing.mtbf_s is not None and failing.mtbf_s < 4 * 3600 / 50
    assert failing.save_cost_s is not None and failing.save_cost_s > 0
    # The first save comes at the first step, to measure its cost; then the interval.
    assert runs["new"][1][0] == 1 and runs["failing"][1][0] == 1
    assert failing.interval_s < new.interval_s
    assert len(runs["failing"][1]) > len(runs["new"][1])


def test_auto_from_the_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_time_interval="auto"`` makes its interval at setup from the checkpoint, with
    the prior from ``TASKPOINT_MTBF_PRIOR_S``; its state key stays ``"auto"``."""
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "1800")
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", train_time_interval="auto")
    assert mc.save_interval is None  # made at setup
    logger = CSVLogger(tmp_path / "logs", name="", version="")
    fit(mc, Clock(), lib.TinyModule(), default_root_dir=tmp_path, logger=logger)
    assert mc.save_interval is not None
    assert mc.save_interval.mtbf_s == pytest.approx(1800, rel=0.01)
    assert mc.save_interval.rule != "fixed"
    assert "train_time_interval': 'auto'" in mc.state_key
    assert saved_steps(tmp_path / "ckpts")[0] == 1  # the first save measures the cost
    # The interval and its inputs reach the loggers beside the saves' figures.
    with (tmp_path / "logs" / "metrics.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("taskpoint/interval_s")]
    assert rows and float(rows[-1]["taskpoint/mtbf_s"]) == pytest.approx(1800, rel=0.01)


def test_bad_intervals_are_named(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    with pytest.raises(TypeError, match=r"train_time_interval takes .*got 30"):
        TaskpointModelCheckpoint(ckpt, train_time_interval=30)
    with pytest.raises(ValueError, match=r"positive timedelta; got datetime.timedelta\(0\)"):
        TaskpointModelCheckpoint(ckpt, train_time_interval=timedelta(0))
    with pytest.raises(ValueError, match=r"'auto' and every_n_train_steps=5 are mutually"):
        TaskpointModelCheckpoint(ckpt, train_time_interval="auto", every_n_train_steps=5)


@pytest.mark.slow
def test_ddp_ranks_save_at_rank_zeros_steps(tmp_path: Path) -> None:
    """Two DDP ranks whose clocks disagree (10 s a step on rank 0, 4 s on rank 1) save at
    the same steps: those rank 0's clock calls for."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), f"file://{tmp_path / 'store'}", str(tmp_path)],
        capture_output=True, text=True, timeout=400, env=env,
    )
    # each rank's error lines first: the tail alone may hold only the rank that saw the other fail
    errors = [line for line in done.stderr.splitlines() if "Error" in line][-20:]
    assert done.returncode == 0, "\n".join(errors) + "\n...\n" + done.stderr[-3000:]
    # 20 samples over 2 ranks in batches of 4: 3 steps an epoch, 12 in all.
    steps = {r: (tmp_path / f"saves-rank{r}.txt").read_text().split() for r in (0, 1)}
    assert steps[0] == ["3", "6", "9", "12"]
    assert steps[1] == steps[0]
    assert saved_steps(tmp_path / "ckpts") == [3, 6, 9, 12]
