"""Sharded ``TaskpointState`` and the DCP storage classes in one process (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState, TaskpointStorageReader, TaskpointStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_sharded_state_round_trips_in_one_process(lib: object, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    model, optimizer = _trained()
    state = TaskpointState(model, optimizer, sharded=True)
    assert state.restore_sync(taskpoint.Checkpoint(url)) is None  # nothing yet
    state.save_sync(taskpoint.Checkpoint(url), epoch=3, step=7, extra={"best": 0.5})

    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    resume = TaskpointState(fresh, fresh_opt, sharded=True).restore_sync(taskpoint.Checkpoint(url))
    assert resume is not None and (resume.epoch, resume.step, resume.extra) == (3, 7, {"best": 0.5})
    assert lib.bitwise_differences(fresh.state_dict(), model.state_dict()) == []  # type: ignore[attr-defined]
    assert lib.bitwise_differences(fresh_opt.state_dict(), optimizer.state_dict()) == []  # type: ignore[attr-defined]
    manifest = taskpoint.Checkpoint(url).committed()[0]
    assert manifest.parts is not None and sorted(manifest.parts) == ["0"]


def test_sharded_state_needs_a_taskpoint_checkpoint_and_blocking_saves(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with pytest.raises(ValueError, match="blocking"):
        TaskpointState(model, optimizer, sharded=True, blocking=False)
    state = TaskpointState(model, optimizer, sharded=True)
    with pytest.raises(TypeError, match=r"needs a taskpoint\.Checkpoint"):
        state.save_sync(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="background=True is refused"):
        state.save_sync(taskpoint.Checkpoint(f"file://{tmp_path}"), background=True)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="belong to one of the state's models"):
        TaskpointState(other, optimizer, sharded=True)


def test_dcp_reader_refuses_a_location_without_a_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _ = _trained()
    with pytest.raises(BaseException, match="no checkpoint committed"):
        dcp.load(
            {"model": model.state_dict()},
            storage_reader=TaskpointStorageReader(taskpoint.Checkpoint(f"file://{tmp_path}")),
        )
    with pytest.raises(TypeError, match=r"taskpoint\.Checkpoint"):
        TaskpointStorageWriter("file:///x")  # type: ignore[arg-type]
