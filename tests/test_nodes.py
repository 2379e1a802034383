"""``taskpoint.distributed.nodes``: which ranks share a disk, what each stages, and failures
everywhere.

The ranks are threads meeting through a :class:`taskpoint.StoreCoordinator` on a local
folder (the real multi-node runs are the adapters' ``test_nodes.py``).
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import taskpoint
from taskpoint.checkpoint.mirror import FolderMirror
from taskpoint.distributed import nodes


def _on_ranks(tmp_path: Path, world: int, work: Callable[[taskpoint.Coordinator], Any]) -> list[Any]:
    """Run ``work`` on ``world`` threads, each its own rank; their results or errors."""
    session = uuid.uuid4().hex[:12]

    def one(rank: int) -> Any:
        coordinator = taskpoint.StoreCoordinator(
            str(tmp_path / "meet"), rank=rank, world_size=world, session=session, timeout=20,
            poll=0.02,
        )
        try:
            return work(coordinator)
        except Exception as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _disks(tmp_path: Path) -> list[Path]:
    """Ranks 0 and 1 share disk ``a``; rank 2 has ``b`` to itself."""
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    return [a, a, b]


def test_ranks_sharing_a_folder_have_one_leader_and_the_tokens_go(tmp_path: Path) -> None:
    folders = _disks(tmp_path)
    found = _on_ranks(tmp_path, 3, lambda c: nodes.find_disks(c, folders[c.rank]))
    assert [d.leaders for d in found] == [(0, 0, 2)] * 3
    assert found[0].count == 2 and found[0].leads(2) and not found[0].leads(1)
    assert not list((tmp_path / "a" / "out").iterdir())
    assert not list((tmp_path / "b" / "out").iterdir())


def test_each_disk_stages_only_what_the_first_disk_lacks(tmp_path: Path) -> None:
    folders = _disks(tmp_path)
    _write(folders[0], {
        "checkpoint-6/model.bin": "m", "checkpoint-6/rng_state_0.pth": "r0",
        "checkpoint-6/rng_state_1.pth": "r1", "runs/log": "l",
    })
    _write(folders[2], {
        "checkpoint-6/model.bin": "m", "checkpoint-6/rng_state_2.pth": "r2",
        "checkpoint-3/rng_state_2.pth": "old",  # rotated away on the first disk
        "runs/log2": "l2", "top.txt": "t",
    })
    same = (folders[0] / "checkpoint-6" / "model.bin").stat().st_mtime_ns
    os.utime(folders[2] / "checkpoint-6" / "model.bin", ns=(same, same))  # a tie: disk a

    def stage(c: taskpoint.Coordinator) -> list[str]:
        disks = nodes.find_disks(c, folders[c.rank])
        part = nodes.stage_part(c, folders[c.rank], disks)
        assert part.name == "out" and part.parent.name.startswith(nodes.PRIVATE_PREFIX)
        return nodes.list_files(part)

    staged = _on_ranks(tmp_path, 3, stage)
    assert staged[0] == [
        "checkpoint-6/model.bin", "checkpoint-6/rng_state_0.pth",
        "checkpoint-6/rng_state_1.pth", "runs/log",
    ]
    assert staged[1] == []
    assert staged[2] == ["checkpoint-6/rng_state_2.pth", "runs/log2"]
    assert nodes.list_files(folders[0])[0] == "checkpoint-6/model.bin"  # parts not listed


def test_a_path_several_disks_hold_goes_up_from_the_newest_copy(tmp_path: Path) -> None:
    """After a restore every disk holds every node's files; a file one node then rewrites
    in place (its shard of a sharded ``last.ckpt``) must win over the stale copies."""
    folders = _disks(tmp_path)
    restored = {"last.ckpt/__0_0.distcp": "old0", "last.ckpt/__2_0.distcp": "old2"}
    _write(folders[0], restored)
    _write(folders[2], restored)
    for folder in (folders[0], folders[2]):  # a restore keeps the saved times
        for path in folder.rglob("*.distcp"):
            os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    _write(folders[0], {"last.ckpt/__0_0.distcp": "new0"})  # each rank rewrites its shard
    _write(folders[2], {"last.ckpt/__2_0.distcp": "new2"})

    def stage(c: taskpoint.Coordinator) -> list[str]:
        disks = nodes.find_disks(c, folders[c.rank])
        part = nodes.stage_part(c, folders[c.rank], disks)
        return [f"{p}={(part / p).read_text()}" for p in nodes.list_files(part)]

    staged = _on_ranks(tmp_path, 3, stage)
    assert staged == [["last.ckpt/__0_0.distcp=new0"], [], ["last.ckpt/__2_0.distcp=new2"]]


def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    def step(c: taskpoint.Coordinator) -> list[Any]:
        def action() -> int:
            if c.rank == 1:
                raise OSError("disk full")
            return c.rank
        return nodes.run_everywhere(c, action, "restore")

    results = _on_ranks(tmp_path, 3, step)
    assert isinstance(results[1], OSError)
    for rank in (0, 2):
        assert isinstance(results[rank], taskpoint.CheckpointCoordinationError)
        assert "rank 1 (host " in str(results[rank])
        assert "OSError: disk full" in str(results[rank])


def test_mirror_commits_every_ranks_part_in_the_background(tmp_path: Path) -> None:
    folders = _disks(tmp_path)
    _write(folders[0], {"checkpoint-6/model.bin": "m", "checkpoint-6/rng_state_0.pth": "r0"})
    _write(folders[2], {"checkpoint-6/rng_state_2.pth": "r2"})
    url = str(tmp_path / "store")

    def save(c: taskpoint.Coordinator) -> None:
        disks = nodes.find_disks(c, folders[c.rank])
        part = nodes.stage_part(c, folders[c.rank], disks)
        mirror = FolderMirror(taskpoint.Checkpoint(url), blocking=False)
        mirror.save_part(part, coordinator=c, step=6, remove=part.parent)
        assert mirror.wait(30)
        assert not part.parent.exists()

    assert _on_ranks(tmp_path, 3, save) == [None, None, None]
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and restored.name == "out"
    assert nodes.list_files(restored) == [
        "checkpoint-6/model.bin", "checkpoint-6/rng_state_0.pth", "checkpoint-6/rng_state_2.pth",
    ]


def test_mirror_refuses_parts_for_another_systems_checkpoint(tmp_path: Path) -> None:
    class Other:
        def save_sync(self, data: Any) -> None: ...
        async def save(self, data: Any) -> None: ...
        def load_sync(self) -> None: ...
        async def load(self) -> None: ...

    part = tmp_path / "part"
    part.mkdir()
    coordinator = taskpoint.StoreCoordinator(str(tmp_path), rank=0, world_size=1, session="s")
    with pytest.raises(TypeError, match=r"taskpoint\.Checkpoint"):
        FolderMirror(Other()).save_part(part, coordinator=coordinator)
    assert not part.exists()


def test_each_disk_restores_once_and_every_rank_gets_the_result(tmp_path: Path) -> None:
    folders = _disks(tmp_path)
    calls: list[int] = []

    def restore_on(c: taskpoint.Coordinator) -> Any:
        def restore(disks: nodes.Disks) -> dict[str, int]:
            calls.append(c.rank)
            assert disks.sharing(c.rank) == {0: (0, 1), 2: (2,)}[c.rank]
            _write(folders[c.rank], {"checkpoint-6/model.bin": "m"})
            return {"step": 6}

        return nodes.restore_to_every_disk(
            c, folders[c.rank], restore, location="s3://b/run", world_size=3
        )

    assert _on_ranks(tmp_path, 3, restore_on) == [{"step": 6}] * 3
    assert sorted(calls) == [0, 2]  # the leader of each disk, once


def test_every_rank_checks_the_restore_and_one_rank_failing_fails_all(tmp_path: Path) -> None:
    folders = _disks(tmp_path)
    checked: list[tuple[int, Any]] = []

    def restore_on(c: taskpoint.Coordinator) -> Any:
        def restore(disks: nodes.Disks) -> str:
            _write(folders[c.rank], {"checkpoint-6/model.bin": "m"})
            return "checkpoint-6"

        def check(name: Any) -> None:
            checked.append((c.rank, name))
            if c.rank == 1:
                raise FileNotFoundError(f"rank 1 cannot see {name}")

        return nodes.restore_to_every_disk(
            c, folders[c.rank], restore, location="s3://b/run", world_size=3, check=check
        )

    outcomes = _on_ranks(tmp_path, 3, restore_on)
    assert sorted(checked) == [(0, "checkpoint-6"), (1, "checkpoint-6"), (2, "checkpoint-6")]
    assert isinstance(outcomes[1], FileNotFoundError)
    for other in (outcomes[0], outcomes[2]):
        assert isinstance(other, taskpoint.CheckpointCoordinationError), outcomes
        assert "see the restored checkpoint" in str(other)
        assert "rank 1 cannot see checkpoint-6" in str(other)


@pytest.mark.parametrize(
    "case", ["location", "world_size", "one_rank_fails", "leaders_differ"]
)
def test_restoring_fails_on_every_rank_and_says_why(tmp_path: Path, case: str) -> None:
    folders = _disks(tmp_path)
    restored: list[int] = []

    def restore_on(c: taskpoint.Coordinator) -> Any:
        def restore(disks: nodes.Disks) -> int:
            if case == "one_rank_fails" and c.rank == 2:
                raise OSError("disk b is read-only")
            restored.append(c.rank)
            return 6 if case != "leaders_differ" or c.rank == 0 else 9

        location = "s3://b/other" if case == "location" and c.rank == 1 else "s3://b/run"
        world = 4 if case == "world_size" and c.rank == 2 else 3
        return nodes.restore_to_every_disk(
            c, folders[c.rank], restore, location=location, world_size=world
        )

    outcomes = _on_ranks(tmp_path, 3, restore_on)
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    expected = {
        "location": "disagree about the checkpoint location",
        "world_size": "disagree about the world size",
        "one_rank_fails": "disk b is read-only",
        "leaders_differ": "found different checkpoints",
    }[case]
    assert all(expected in str(o) for o in outcomes), outcomes
    if case in ("location", "world_size"):
        assert restored == []  # nothing was restored
        assert all("Nothing was restored" in str(o) for o in outcomes), outcomes
        odd = [1] if case == "location" else [2]  # the same culprit on every rank
        assert [getattr(o, "ranks", None) for o in outcomes] == [odd] * 3, outcomes
    if case == "one_rank_fails":
        assert isinstance(outcomes[2], OSError)
        assert all(isinstance(o, taskpoint.CheckpointCoordinationError) for o in outcomes[:2])
