"""Sharded ``TaskpointState`` and the DCP storage classes in one process (no process group)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState, TaskpointStorageReader, TaskpointStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

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


async def test_sharded_state_async_save_and_restore(lib: object, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    model, optimizer = _trained()
    state = TaskpointState(model, optimizer, sharded=True)
    assert await state.restore(taskpoint.Checkpoint(url)) is None
    assert await state.save(taskpoint.Checkpoint(url), epoch=2, step=5)
    assert not await state.save(taskpoint.Checkpoint(url), step=6, every=4)  # not due

    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    resume = await TaskpointState(fresh, fresh_opt, sharded=True).restore(taskpoint.Checkpoint(url))
    assert resume is not None and (resume.epoch, resume.step) == (2, 5)
    assert lib.bitwise_differences(fresh.state_dict(), model.state_dict()) == []  # type: ignore[attr-defined]
    assert len(taskpoint.Checkpoint(url).committed()) == 1  # the call that was not due saved none


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


def _dcp_saved(url: str, value: float) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.full((4, 3), value), "b": torch.arange(5.0) + value}
    dcp.save(state, storage_writer=TaskpointStorageWriter(taskpoint.Checkpoint(url)))
    return state


def test_dcp_reader_fetches_metadata_then_the_plans_files_and_cleans_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed.checkpoint as dcp

    url = f"file://{tmp_path / 'store'}"
    saved = _dcp_saved(url, 1.0)
    ckpt = taskpoint.Checkpoint(url)
    asked: list[object] = []
    load = ckpt.load_sync

    def recording(**kwargs: object) -> object:
        asked.append(kwargs.get("paths"))
        return load(**kwargs)  # type: ignore[arg-type]

    ckpt.load_sync = recording  # type: ignore[method-assign]
    target = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    staging = tmp_path / "staging"
    with caplog.at_level(logging.INFO, logger="taskpoint_pytorch._dcp"):
        dcp.load(target, storage_reader=TaskpointStorageReader(ckpt, staging=staging))
    assert all(torch.equal(target[k], saved[k]) for k in saved)
    assert [sorted(p) for p in asked] == [[".metadata"], [".metadata", "__0_0.distcp"]]  # type: ignore[call-overload]
    assert list(staging.iterdir()) == []  # read, then removed
    assert any(
        "rank 0 fetched .metadata and 1 of the 1 shard files" in r.getMessage()
        for r in caplog.records
    )


def _load_while_saving(
    url: str, tmp_path: Path, commit: Callable[[], object]
) -> tuple[BaseException, Path]:
    """``dcp.load`` from ``url`` that runs ``commit`` once it has planned, before it reads."""
    import torch.distributed.checkpoint as dcp

    staging = tmp_path / "staging"
    reader = TaskpointStorageReader(taskpoint.Checkpoint(url), staging=staging)
    plan = reader.prepare_global_plan

    def plan_then_commit(plans: Any) -> Any:
        commit()
        return plan(plans)

    reader.prepare_global_plan = plan_then_commit  # type: ignore[method-assign]
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(4, 3), "b": torch.zeros(5)}, storage_reader=reader)
    [(error, _)] = caught.value.failures.values()  # DCP wraps what each rank raised
    return error, staging


def test_dcp_reader_refuses_shards_of_a_checkpoint_committed_while_loading(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path / 'store'}"
    _dcp_saved(url, 1.0)
    error, staging = _load_while_saving(url, tmp_path, lambda: _dcp_saved(url, 2.0))
    assert isinstance(error, taskpoint.CheckpointCoordinationError)
    assert "committed at" in str(error) and "while loading" in str(error)
    assert "load again" in str(error)
    assert list(staging.iterdir()) == []

    # The newer checkpoint lacks the planned shard file: the same advice, naming it.
    other = tmp_path / "other"
    other.mkdir()
    (other / ".metadata").write_bytes(b"not this save's")
    error, _ = _load_while_saving(
        url, tmp_path, lambda: taskpoint.Checkpoint(url).save_sync(other)
    )
    assert isinstance(error, taskpoint.CheckpointCoordinationError)
    assert "lacks shard files" in str(error) and "'__0_0.distcp'" in str(error)
    assert "load again" in str(error)


def test_dcp_reader_refuses_a_checkpoint_that_is_not_a_dcp_save(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    url = f"file://{tmp_path / 'store'}"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.pt").write_bytes(b"x")
    taskpoint.Checkpoint(url).save_sync(tmp_path / "plain")
    with pytest.raises(BaseException, match=r"not a torch\.distributed\.checkpoint save"):
        dcp.load(
            {"w": torch.zeros(1)},
            storage_reader=TaskpointStorageReader(taskpoint.Checkpoint(url)),
        )
