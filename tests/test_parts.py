"""Checkpoints written by several processes at once, coordinated through the store.

Each writer is a plain Python process (``tp_part_writer.py``, no torch) meeting the others
through a :class:`taskpoint.StoreCoordinator`, on a local directory and on every object
store the suite runs (``memory://`` is private to one process, so it is left out).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import taskpoint
from taskpoint.distributed._parts import merge_parts
from taskpoint.distributed.coordination import COORDINATION, check_agreement
from taskpoint.format.manifest import Blob, Entry, Manifest

WRITER = Path(__file__).parent / "tp_part_writer.py"


@pytest.fixture
def url(store_url: str) -> str:
    if store_url.startswith("memory://"):
        pytest.skip("memory:// is private to one process")
    return store_url


HANG_S = 240.0
"""Bounds every wait for a writer process: only a hang reaches it, however loaded the machine."""


class Writers:
    """Starts writer processes, releases them together and collects what each reported.

    Every gather waits ``timeout`` (generous: it only bounds a hang) unless a writer's spec
    gives a round a short one, where the test knows the rank waited for never comes.
    """

    def __init__(self, url: str, tmp: Path, world_size: int, timeout: float = HANG_S) -> None:
        self.url = url
        self.tmp = tmp
        self.world_size = world_size
        self.timeout = timeout
        self.session = uuid.uuid4().hex[:12]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.released: set[int] = set()
        (tmp / self.session).mkdir(parents=True)

    def _file(self, name: str, rank: int) -> Path:
        return self.tmp / self.session / f"{name}-{rank}"

    def start(self, rank: int, files: dict[str, str], **spec: Any) -> None:
        full = {
            "url": self.url, "meet": self.url, "rank": rank, "world_size": self.world_size,
            "session": self.session, "timeout": self.timeout,
            "folder": str(self.tmp / self.session / f"rank-{rank}"), "files": files,
            "ready": str(self._file("ready", rank)), "go": str(self._file("go", rank)),
            "out": str(self._file("out", rank)), **spec,
        }
        self.procs[rank] = subprocess.Popen([sys.executable, str(WRITER), json.dumps(full)])

    def go(self, *ranks: int) -> None:
        """Once the writers ``ranks`` (default: every one not yet released) have started,
        let them begin their saves at the same moment."""
        ranks = ranks or tuple(r for r in self.procs if r not in self.released)
        deadline = time.monotonic() + HANG_S
        for rank in ranks:
            while not self._file("ready", rank).exists():
                assert self.procs[rank].poll() is None, f"writer {rank} exited before its save"
                assert time.monotonic() < deadline, f"writer {rank} never started"
                time.sleep(0.05)
        for rank in ranks:
            self._file("go", rank).touch()
        self.released.update(ranks)

    def results(self, *, killed: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
        """What each writer reported; those in ``killed`` must have died by SIGKILL."""
        if set(self.procs) - self.released:
            self.go()
        for rank, proc in self.procs.items():
            assert proc.wait(timeout=HANG_S) == (-signal.SIGKILL if rank in killed else 0)
        return {
            rank: json.loads(self._file("out", rank).read_text())
            for rank in self.procs if rank not in killed
        }

    def wait_entered(self, number: int, ranks: list[int]) -> None:
        """Wait until ``ranks`` have entered gather ``number`` (their records are stored)."""
        store = taskpoint.Checkpoint(self.url)._store
        deadline = time.monotonic() + HANG_S
        folder = f"{COORDINATION}/{self.session}/{number:06d}"
        while sorted(n for n in store.list(folder) if n.endswith(".json")) != [
            f"{r:06d}.json" for r in ranks
        ]:
            assert time.monotonic() < deadline, f"ranks {ranks} never entered round {number}"
            time.sleep(0.1)


def _committed(url: str) -> list[Manifest]:
    return taskpoint.Checkpoint(url).committed()


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()
    }


SHARED = {".metadata": "the same on every rank"}


@pytest.mark.slow
def test_commits_once_every_part_arrived_and_restores_one_part(url: str, tmp_path: Path) -> None:
    writers = Writers(url, tmp_path, 3)
    for rank in (0, 1):
        writers.start(rank, {f"shard-{rank}.bin": f"rank {rank} " * 100, **SHARED})
    writers.go()
    writers.wait_entered(0, [0, 1])  # ranks 0 and 1 wait for rank 2: nothing is committed
    assert _committed(url) == []
    writers.start(2, {"shard-2.bin": "rank 2 " * 100, "sub/own.txt": "x", **SHARED})
    results = writers.results()
    assert all(r.get("ok") for r in results.values()), results

    manifests = _committed(url)
    assert len(manifests) == 1
    manifest = manifests[0]
    assert manifest.parts is not None and sorted(manifest.parts) == ["0", "1", "2"]
    assert "shard-1.bin" in manifest.parts["1"] and ".metadata" in manifest.parts["1"]
    assert manifest.stats is not None and manifest.stats["writers"] == 3

    whole = taskpoint.Checkpoint(url).load_sync()
    assert whole is not None
    assert _tree(whole) == {
        ".metadata": SHARED[".metadata"], "shard-0.bin": "rank 0 " * 100,
        "shard-1.bin": "rank 1 " * 100, "shard-2.bin": "rank 2 " * 100, "sub/own.txt": "x",
    }
    one = taskpoint.Checkpoint(url).load_sync(part=2)
    assert one is not None
    assert _tree(one) == {
        ".metadata": SHARED[".metadata"], "shard-2.bin": "rank 2 " * 100, "sub/own.txt": "x"
    }
    with pytest.raises(taskpoint.CheckpointCoordinationError, match=r"no part of rank 3.*\[0, 1, 2\]"):
        taskpoint.Checkpoint(url).load_sync(part=3)


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # the ranks' agreement, not the store, is the point
def test_a_path_two_writers_fill_differently_fails_every_writer(url: str, tmp_path: Path) -> None:
    taskpoint.Checkpoint(url).save_sync(b"previous")
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"model.pt": "weights of rank 0"})
    writers.start(1, {"model.pt": "weights of rank 1!"})
    results = writers.results()
    for result in results.values():
        assert "CheckpointCoordinationError" in result["error"], results
        assert "ranks 0 and 1 both wrote 'model.pt' with different content" in result["error"]
        assert result["ranks"] == [0, 1] and result["committed"] is None  # on every rank
    assert len(_committed(url)) == 1  # only the previous checkpoint
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and restored.read_bytes() == b"previous"


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # processes and timeouts: one object store is enough
def test_a_writer_that_never_arrives_fails_the_others_naming_it(url: str, tmp_path: Path) -> None:
    writers = Writers(url, tmp_path, 3)
    # rank 0 enters after rank 1 has, so its 3 s wait is only for rank 2; rank 1's 5 s
    # wait needs rank 0 to follow it at once
    writers.start(0, {"a": "0"}, timeouts={"0": 3.0}, **{"await": {"0": [1]}})
    writers.start(1, {"b": "1"}, timeouts={"0": 5.0})
    results = writers.results()
    for result in results.values():
        assert "CheckpointCoordinationError" in result["error"], results
        assert "rank(s) [2] of 3 never arrived" in result["error"]
        assert result["ranks"] == [2]
        assert 3.0 <= result["seconds"] < HANG_S
    assert _committed(url) == []


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # processes and timeouts: one object store is enough
def test_a_writer_killed_after_uploading_leaves_nothing_committed(url: str, tmp_path: Path) -> None:
    """Rank 1 uploads and is killed before sending its part: rank 0 gives up waiting,
    commits nothing, and the previous checkpoint stays the newest."""
    taskpoint.Checkpoint(url).save_sync(b"previous")
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"a": "0"}, timeouts={"2": 3.0})
    writers.start(1, {"b": "1"}, die_before_round=2)
    result = writers.results(killed=(1,))[0]
    assert "rank(s) [1] of 2 never arrived" in result["error"], result
    assert result["ranks"] == [1] and result["committed"] is None
    assert len(_committed(url)) == 1
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and restored.read_bytes() == b"previous"


OUTCOME = 3
"""The number of the save's last round, in which rank 0 broadcasts the outcome."""


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # processes and timeouts: one object store is enough
def test_a_writer_killed_after_its_part_was_gathered_leaves_a_commit_every_survivor_hears(
    url: str, tmp_path: Path
) -> None:
    """Rank 2 is killed once rank 0 has its part, before the outcome: rank 0 commits, and
    rank 1 hears so from rank 0 alone instead of waiting for rank 2, timing out and
    guessing from a store listing (on S3 a cached one, from before the commit)."""
    taskpoint.Checkpoint(url).save_sync(b"previous")  # so every writer lists checkpoints/
    writers = Writers(url, tmp_path, 3)
    # waiting for rank 2 in the outcome round would time out after 20 s
    writers.start(0, {"a": "0"}, timeouts={str(OUTCOME): 20.0})
    writers.start(1, {"b": "1"}, timeouts={str(OUTCOME): 20.0})
    writers.start(2, {"c": "2"}, die_after_round=OUTCOME - 1)
    results = writers.results(killed=(2,))
    assert results[0].get("ok") and results[1].get("ok"), results
    manifests = _committed(url)
    assert manifests[-1].parts is not None  # the new commit, the newest
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and _tree(restored) == {"a": "0", "b": "1", "c": "2"}


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # processes and timeouts: one object store is enough
def test_a_committer_killed_after_committing_leaves_the_others_finding_the_commit(
    url: str, tmp_path: Path
) -> None:
    """Rank 0 commits and is killed before it broadcasts the outcome: the others time out
    waiting for it, look in the store with a fresh listing (not the one their filesystem
    cached before the commit) and say the checkpoint was committed."""
    taskpoint.Checkpoint(url).save_sync(b"previous")  # so every writer lists checkpoints/
    writers = Writers(url, tmp_path, 3)
    writers.start(0, {"a": "0"}, die_before_round=OUTCOME)
    writers.start(1, {"b": "1"}, timeouts={str(OUTCOME): 3.0})
    writers.start(2, {"c": "2"}, timeouts={str(OUTCOME): 3.0})
    results = writers.results(killed=(0,))
    manifests = _committed(url)
    assert manifests[-1].parts is not None  # the new commit, the newest
    for result in results.values():
        assert "CheckpointCoordinationError" in result["error"], results
        assert "WAS committed" in result["error"], results
        assert "rank 0 vanished after committing" in result["error"]
        assert result["ranks"] == [0]
        assert result["committed"] is not None and result["committed"].endswith(manifests[-1].key)
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and _tree(restored) == {"a": "0", "b": "1", "c": "2"}


@pytest.mark.slow
def test_a_committer_killed_before_committing_leaves_the_others_saying_what_they_know(
    tmp_path: Path,
) -> None:
    """Rank 0 is killed once it has every part, before it commits: rank 1 cannot hear the
    outcome, so it says what the store shows (no manifest) without claiming more."""
    url = f"file://{tmp_path / 'store'}"
    taskpoint.Checkpoint(url).save_sync(b"previous")
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"a": "0"}, die_after_round=2)
    writers.start(1, {"b": "1"}, timeouts={"3": 3.0})
    result = writers.results(killed=(0,))[1]
    assert "rank 0 never reported the outcome" in result["error"], result
    assert "does not know whether rank 0 committed" in result["error"]
    assert "was not in the store when rank 1 looked" in result["error"]
    assert result["ranks"] == [0] and result["committed"] is None
    assert len(_committed(url)) == 1


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # the ranks' agreement, not the store, is the point
def test_writers_disagreeing_about_location_fail_before_any_upload(url: str, tmp_path: Path) -> None:
    other = url.rstrip("/") + "-elsewhere"
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"a": "0" * 1000})
    writers.start(1, {"b": "1" * 1000}, url=other)
    results = writers.results()
    for result in results.values():
        assert "ranks disagree about the checkpoint location" in result["error"], results
        assert other in result["error"]
        assert result["ranks"] == [1]  # every rank names the same one: not rank 0's URL
    for where in (url, other):
        store = taskpoint.Checkpoint(where)._store
        assert store.list("objects") == [] and store.list("checkpoints") == []


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # processes and timeouts: one object store is enough
def test_writers_disagreeing_about_world_size_fail_clearly(url: str, tmp_path: Path) -> None:
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"a": "0"})
    writers.start(1, {"b": "1"}, world_size=3)
    results = writers.results()
    for result in results.values():  # said at once: no rank waits for rank 2 until it times out
        assert "ranks disagree about the world size" in result["error"], results
        assert result["ranks"] == [0, 1]
    assert _committed(url) == []


@pytest.mark.slow
@pytest.mark.stores("file", "s3")  # the ranks' agreement, not the store, is the point
def test_one_writer_failing_fails_every_writer(url: str, tmp_path: Path) -> None:
    writers = Writers(url, tmp_path, 2)
    writers.start(0, {"a": "0"})
    writers.start(1, {}, folder=str(tmp_path / "missing" / "nowhere"))
    results = writers.results()
    assert results[1]["error"].startswith("NotADirectoryError")
    assert "rank 1: NotADirectoryError" in results[0]["error"]
    assert results[0]["ranks"] == [1]
    assert _committed(url) == []


# -- the merge and the manifest, without processes ------------------------------------


def _file(path: str, content: str) -> Entry:
    digest = "0" * 32
    blob = Blob("a" * 32, 0, len(content), "none", len(content), digest)
    return Entry(path, "file", 0o644, 0, len(content), f"xxh3-128:{content.ljust(32, '0')[:32]}", (blob,))


def test_merge_keeps_shared_paths_once_and_each_rank_s_paths() -> None:
    a = (Entry("d", "dir", 0o755), _file("d/x", "aa"), _file("m", "mm"))
    b = (Entry("d", "dir", 0o700), _file("d/y", "bb"), _file("m", "mm"))
    entries, objects, parts = merge_parts([(a, {"a" * 32: 9}), (b, {"a" * 32: 9})])
    assert [e.path for e in entries] == ["d", "d/x", "m", "d/y"]
    assert parts == {"0": ("d", "d/x", "m"), "1": ("d", "d/y", "m")}
    assert objects == {"a" * 32: 9}


def test_merge_names_both_ranks_of_a_conflict() -> None:
    a = (_file("m", "aa"),)
    b = (Entry("m", "dir", 0o755),)
    with pytest.raises(taskpoint.CheckpointCoordinationError, match="ranks 0 and 1 both wrote 'm'") as info:
        merge_parts([(a, {}), (b, {})])
    assert info.value.ranks == [0, 1]


def test_the_agreement_check_names_the_odd_ranks_out_and_what_was_not_done() -> None:
    with pytest.raises(taskpoint.CheckpointCoordinationError, match=r"location.*Nothing was x") as info:
        check_agreement(["s3://b/y", "s3://b/x", "s3://b/x"], [3, 3, 3], undone="Nothing was x")
    assert info.value.ranks == [0]  # most ranks named s3://b/x
    with pytest.raises(taskpoint.CheckpointCoordinationError) as info:
        check_agreement(["s3://b/y", "s3://b/x"], [2, 2], undone="Nothing was x")
    assert info.value.ranks == [1]  # a tie: rank 0's URL is the agreed one
    with pytest.raises(taskpoint.CheckpointCoordinationError, match="world size") as info:
        check_agreement(["u"] * 3, [3, 4, 3], undone="Nothing was x")
    assert info.value.ranks == [1]
    with pytest.raises(taskpoint.CheckpointCoordinationError, match="as rank 0") as info:
        check_agreement(["u"] * 2, [2, 2], ranks=[0, 0], undone="Nothing was x")
    assert info.value.ranks == [1]
    check_agreement([None, None], [2, 2], undone="Nothing was x")  # agreeing: no error


def test_store_coordinator_checks_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank must be"):
        taskpoint.StoreCoordinator(str(tmp_path), rank=2, world_size=2, session="s")
    with pytest.raises(ValueError, match="session"):
        taskpoint.StoreCoordinator(str(tmp_path), rank=0, world_size=2, session="a/b")
    with pytest.raises(ValueError, match="timeout"):
        taskpoint.StoreCoordinator(str(tmp_path), rank=0, world_size=1, session="s", timeout=0)


def test_a_store_broadcast_waits_for_rank_0_alone(tmp_path: Path) -> None:
    """Rank 1 gets rank 0's value though rank 2 never comes; rank 0 waits for no one."""
    url = f"file://{tmp_path / 'store'}"

    def coordinator(rank: int) -> taskpoint.StoreCoordinator:
        return taskpoint.StoreCoordinator(
            url, rank=rank, world_size=3, session="b", timeout=30, poll=0.01
        )

    root, other = coordinator(0), coordinator(1)
    started = time.monotonic()
    assert root.broadcast({"key": "k"}) == {"key": "k"}
    assert other.broadcast("ignored") == {"key": "k"}
    assert time.monotonic() - started < 20  # no wait for rank 2's timeout
    assert sorted(p.name for p in (tmp_path / "store" / "coordination" / "b" / "000000").iterdir()) == [
        "000000.json"
    ]
    with pytest.raises(
        taskpoint.CheckpointCoordinationError, match=r"rank 1 waited 0\.2s .* rank 0 never broadcast"
    ) as caught:
        other.broadcast(None, timeout=0.2)  # rank 0 is not in this round
    assert caught.value.ranks == [0]


def test_one_writer_alone_commits_a_one_part_tree(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("hello")
    url = f"file://{tmp_path / 'store'}"
    coord = taskpoint.StoreCoordinator(url, rank=0, world_size=1, session="solo")
    ckpt = taskpoint.Checkpoint(url)
    seen: list[taskpoint.SaveStats] = []
    ckpt.on_commit(seen.append)
    ckpt.save_part_sync(tmp_path / "src", coordinator=coord)
    ckpt.save_part_sync(tmp_path / "src", coordinator=coord)  # again: content reused
    assert [s.seq for s in seen] == [0, 1] and seen[1].uploaded == 0
    restored = taskpoint.Checkpoint(url).load_sync(part=0)
    assert restored is not None and (restored / "f").read_text() == "hello"
    raw = json.loads((tmp_path / "store" / "checkpoints" / ckpt.committed()[0].key).read_text())
    assert raw["parts"] == {"0": ["f"]} and raw["format"] == 2
    # coordination rounds of earlier saves are removed as later ones complete: left are
    # the last all-gather's (the parts, round 6) and the broadcast after it (the outcome)
    rounds = sorted(p.name for p in (tmp_path / "store" / "coordination" / "solo").iterdir())
    assert rounds == ["000006", "000007"]


def test_adapter_steps_commit_parts_and_abort_leaves_nothing(store_url: str, tmp_path: Path) -> None:
    """begin_parts / upload_part / commit, as an adapter with its own collectives runs them."""
    folders = []
    for rank in (0, 1):
        folder = tmp_path / f"rank-{rank}"
        (folder / "d").mkdir(parents=True)
        (folder / "d" / f"shard-{rank}").write_bytes(bytes([rank]) * 300_000)
        folders.append(folder)
    ckpt = taskpoint.Checkpoint(store_url)
    with ckpt.begin_parts() as aborted:
        ckpt.upload_part(folders[0])
    with pytest.raises(RuntimeError, match="already finished"):
        aborted.commit([])
    assert ckpt.committed() == []

    commit = ckpt.begin_parts()
    records = [taskpoint.Checkpoint(store_url).upload_part(f) for f in folders]
    stats = commit.commit(records)
    assert stats.size == 600_000 and (stats.attempt, stats.seq) == (commit.attempt, commit.seq)
    restored = taskpoint.Checkpoint(store_url).load_sync()
    assert restored is not None and restored.name == "rank-0"
    assert sorted(p.name for p in (restored / "d").iterdir()) == ["shard-0", "shard-1"]
    assert [n for n in ckpt._store.list("leases") if n.endswith(".json")] == []


def test_a_parts_field_naming_an_unknown_path_is_corrupt() -> None:
    entries = (_file("a", "aa"),)
    from taskpoint.format.manifest import tree_checksum

    good = Manifest(
        kind="directory", name="t", codec="none", size=2, checksum=tree_checksum(entries),
        payload=None, attempt=0, seq=0, created=1.0, format=2, entries=entries,
        objects={"a" * 32: 9}, parts={"0": ("a",)},
    )
    assert Manifest.from_json(good.to_json(), url="u").parts == {"0": ("a",)}
    raw = json.loads(good.to_json())
    for bad in ({"0": ["a", "b"]}, {"x": ["a"]}, {"0": []}, [["a"]]):
        raw["parts"] = bad
        with pytest.raises(taskpoint.CheckpointCorruptError, match="parts"):
            Manifest.from_json(json.dumps(raw).encode(), url="u")
    del raw["parts"]  # a single writer's tree: no parts, still valid
    assert Manifest.from_json(json.dumps(raw).encode(), url="u").parts is None
