"""taskpoint and Flyte 2 together: Flyte's checkpoint object is a ``CheckpointLike``, and a
Flyte task can bind ``taskpoint.Checkpoint.at(url)`` to keep Flyte's retries while using
taskpoint's store. The contrast tests show what Flyte's built-in checkpoint does instead.

Every Flyte run here is a real local run (``flyte.with_runcontext(mode="local")``) with
Flyte's own retries; the per-adapter tests live in ``integrations/*/tests/test_flyte.py``.
"""

from __future__ import annotations

import datetime
import inspect
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flyte
import fsspec
import pytest
import taskpoint
from taskpoint import TaskpointWarning

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = flyte.Backoff(base=datetime.timedelta(0))




def _retries(count: int) -> flyte.RetryStrategy:
    return flyte.RetryStrategy(count=count, backoff=NO_WAIT)


@pytest.fixture
def run_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``run_local(task, *args)``: a local Flyte run, its raw data under ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    flyte.init()

    def run(task: Any, *args: Any) -> Any:
        raw = str(tmp_path / "flyte-raw")
        return flyte.with_runcontext(mode="local", raw_data_path=raw).run(task, *args).outputs()[0]

    return run


# -- the protocol ----------------------------------------------------------------------


def test_flyte_checkpoint_satisfies_checkpoint_like(run_local: Callable[..., Any]) -> None:
    env = flyte.TaskEnvironment(name="tp_flyte_protocol")
    seen: list[Any] = []

    @env.task
    def probe() -> bool:
        seen.append(flyte.ctx().checkpoint)
        return isinstance(flyte.ctx().checkpoint, taskpoint.CheckpointLike)

    assert run_local(probe) is True
    (checkpoint,) = seen
    assert isinstance(checkpoint, flyte.Checkpoint)
    assert not isinstance(checkpoint, taskpoint.Checkpoint)
    # runtime_checkable only checks names: the async/sync split must match too.
    for name, is_async in [
        ("save", True),
        ("load", True),
        ("save_sync", False),
        ("load_sync", False),
    ]:
        assert inspect.iscoroutinefunction(getattr(checkpoint, name)) is is_async, name


# -- lineage: an attempt that dies before saving ------------------------------------------


def test_taskpoint_store_resumes_past_an_attempt_that_died_before_saving(
    run_local: Callable[..., Any], tmp_path: Path
) -> None:
    """The acceptance test: attempt 1 saves and dies, attempt 2 dies before saving, and
    attempt 3 still resumes from attempt 1's state through taskpoint's store."""
    store = tmp_path / "store"
    env = flyte.TaskEnvironment(name="tp_flyte_lineage")
    starts: list[int] = []
    urls: list[str] = []

    @env.task(retries=_retries(2))
    def train(steps: int) -> int:
        action = flyte.ctx().action  # the same for every attempt of this action
        urls.append(f"file://{store}/{action.run_name}/{action.name}")
        ckpt = taskpoint.Checkpoint.at(urls[-1])
        restored = ckpt.load_sync()
        start = int(restored.read_bytes()) if restored else 0
        starts.append(start)
        if len(starts) == 2:
            raise RuntimeError("attempt 2 dies before saving anything")
        for step in range(start, steps):
            ckpt.save_sync(str(step + 1).encode())
            if len(starts) == 1 and step + 1 == 4:
                raise RuntimeError("attempt 1 dies after saving step 4")
        return start

    assert run_local(train, 10) == 4
    assert starts == [0, 4, 4]
    assert len(urls) == 3 and len(set(urls)) == 1
    url = urls[0]
    committed = taskpoint.Checkpoint(url).committed()
    assert int(taskpoint.Checkpoint(url).load_sync().read_bytes()) == 10  # type: ignore[union-attr]
    # Two store attempts saved (Flyte's 1 and 3); the one that never saved claimed nothing.
    assert committed[0].attempt == 1 and committed[0].seq == 5


def test_flyte_checkpoint_on_platform_prefixes_loses_state_past_attempt_n_minus_1(
    tmp_path: Path,
) -> None:
    """The contrast, with Flyte's own ``flyte.Checkpoint``: on a cluster every attempt gets
    its own prefix (``--checkpoint-path {{.checkpointOutputPrefix}}``) and reads only the
    previous attempt's (``--prev-checkpoint {{.prevCheckpointPrefix}}``). Wired that way,
    attempt 3 finds nothing once attempt 2 died before saving; taskpoint's store, used the
    same way, still has attempt 1's state."""

    def prefix(attempt: int) -> str:
        return str(tmp_path / "flyte" / f"attempt-{attempt}" / "_flytecheckpoints")

    url = f"file://{tmp_path / 'store'}"
    flyte_starts: list[int] = []
    taskpoint_starts: list[int] = []
    for attempt in range(3):
        flyte_ckpt = flyte.Checkpoint(prefix(attempt), prefix(attempt - 1) if attempt else None)
        tp_ckpt = taskpoint.Checkpoint.at(url)
        for ckpt, starts in ((flyte_ckpt, flyte_starts), (tp_ckpt, taskpoint_starts)):
            restored = ckpt.load_sync()
            starts.append(int(restored.read_bytes()) if restored else 0)
            if attempt == 0:
                ckpt.save_sync(b"4")  # attempt 2 (index 1) saves nothing

    assert flyte_starts == [0, 4, 0], "Flyte's attempt 3 starts over"
    assert taskpoint_starts == [0, 4, 4], "taskpoint's attempt 3 resumes from attempt 1"


def test_flyte_local_mode_reuses_one_checkpoint_object(run_local: Callable[..., Any]) -> None:
    """What Flyte's local mode actually does: all attempts share one checkpoint object and
    each retry re-stages it as the previous one, so locally an attempt that never saved does
    not lose state. The loss above is a property of per-attempt prefixes on a cluster."""
    env = flyte.TaskEnvironment(name="tp_flyte_local_mode")
    starts: list[int] = []
    paths: list[tuple[str, str | None]] = []

    @env.task(retries=_retries(2))
    def train() -> int:
        ckpt = flyte.ctx().checkpoint
        paths.append((ckpt.remote_destination, ckpt.remote_source))
        restored = ckpt.load_sync()
        starts.append(int(restored.read_bytes()) if restored else 0)
        if len(starts) == 1:
            ckpt.save_sync(b"4")
        if len(starts) < 3:
            raise RuntimeError(f"attempt {len(starts)} fails")
        return starts[-1]

    assert run_local(train) == 4
    assert starts == [0, 4, 4]
    assert len(set(paths)) == 1, "every local attempt got the same destination and source"


# -- background saves inside a Flyte task -----------------------------------------------


def test_background_save_in_a_flyte_task_is_resumed_by_the_retry(
    run_local: Callable[..., Any], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    env = flyte.TaskEnvironment(name="tp_flyte_background")
    starts: list[int] = []

    @env.task(retries=_retries(1))
    def train(steps: int) -> int:
        ckpt = taskpoint.Checkpoint.at(url)
        restored = ckpt.load_sync()
        start = int(restored.read_bytes()) if restored else 0
        starts.append(start)
        try:
            for step in range(start, steps):
                ckpt.save_sync(str(step + 1).encode(), background=True)
                if len(starts) == 1 and step + 1 == 6:
                    raise RuntimeError("attempt 1 dies with a save in flight")
        finally:
            ckpt.wait()  # Flyte does not know the upload thread: finish it before exiting
        return start

    assert run_local(train, 8) == 6
    assert starts == [0, 6]
    assert int(taskpoint.Checkpoint(url).load_sync().read_bytes()) == 8  # type: ignore[union-attr]


# -- checksums ---------------------------------------------------------------------------


def test_a_flipped_byte_flyte_returns_it_taskpoint_falls_back(tmp_path: Path) -> None:
    good, newer = b"older" * 100, b"newer" * 100

    flyte_object = str(tmp_path / "flyte" / "_flytecheckpoints")
    flyte.Checkpoint(flyte_object).save_sync(newer)
    _flip_byte(flyte_object)
    retry = flyte.Checkpoint(str(tmp_path / "next"), flyte_object)  # its restore lives as long
    restored = retry.load_sync()
    assert restored is not None
    assert len(restored.read_bytes()) == len(newer) and restored.read_bytes() != newer, (
        "Flyte hands back the damaged bytes without a word"
    )

    url = f"file://{tmp_path / 'store'}"
    ckpt = taskpoint.Checkpoint.at(url, keep=2)
    ckpt.save_sync(good)
    ckpt.save_sync(newer)
    fs, root = fsspec.core.url_to_fs(url)
    payloads = sorted(
        p for p in fs.ls(f"{root}/checkpoints", detail=False) if p.endswith(".payload")
    )
    _flip_byte(payloads[-1])
    with pytest.warns(TaskpointWarning, match="skipping"):
        restored = taskpoint.Checkpoint.at(url).load_sync()
    assert restored is not None and restored.read_bytes() == good


def _flip_byte(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[10] ^= 0xFF
    Path(path).write_bytes(bytes(data))


# -- packing -----------------------------------------------------------------------------


def test_directory_save_stores_weights_as_they_are_where_flyte_deflates_them(
    tmp_path: Path,
) -> None:
    """Weights do not compress: Flyte deflates them at gzip level 9 anyway, taskpoint
    samples each block and stores weights as they are, compressing only what pays. What
    that is worth in time is a benchmark's to say (``bench/bench_checkpoint.py``, its
    ``reference`` rows), not a test's."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(4):
        (tree / f"shard-{i}.bin").write_bytes(os.urandom(4 * 2**20))
    (tree / "config.json").write_text('{"layers": 2}' * 100)

    flyte_dest = tmp_path / "flyte" / "_flytecheckpoints"
    flyte.Checkpoint(str(flyte_dest)).save_sync(tree)
    url = f"file://{tmp_path / 'store'}"
    taskpoint.Checkpoint.at(url).save_sync(tree)

    header = flyte_dest.read_bytes()[:10]
    assert header[:3] == b"\x1f\x8b\x08" and header[8] == 2  # deflate, "maximum compression"
    (manifest,) = taskpoint.Checkpoint.at(url).committed()
    blobs = {e.path: e.blobs for e in manifest.entries or ()}
    shards = [b for i in range(4) for b in blobs[f"shard-{i}.bin"]]
    assert {b.codec for b in shards} == {"none"}
    assert sum(b.length for b in shards) == 4 * 4 * 2**20  # stored byte for byte
    assert [b.codec for b in blobs["config.json"]] == ["gzip"]  # text pays
    flyte_retry = flyte.Checkpoint(str(tmp_path / "next"), str(flyte_dest))  # owns its restore dir
    flyte_back = flyte_retry.load_sync()
    taskpoint_back = taskpoint.Checkpoint.at(url).load_sync()
    assert flyte_back is not None and taskpoint_back is not None
    for name in ("shard-3.bin", "config.json"):
        assert (taskpoint_back / name).read_bytes() == (tree / name).read_bytes()
        assert (flyte_back / name).read_bytes() == (tree / name).read_bytes()


# -- safe restore ------------------------------------------------------------------------


def test_an_archive_escaping_through_a_link_flyte_extracts_taskpoint_refuses(
    tmp_path: Path,
) -> None:
    """A checkpoint archive holding a link to a folder outside, then a file through it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    archive = tmp_path / "flyte" / "_flytecheckpoints"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        link = tarfile.TarInfo("escape")
        link.type, link.linkname = tarfile.SYMTYPE, str(victim)
        tar.addfile(link)
        data = b"written by a checkpoint"
        entry = tarfile.TarInfo("escape/planted.txt")
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))

    retry = flyte.Checkpoint(str(tmp_path / "next"), str(archive))
    if sys.version_info < (3, 14):  # tarfile extracts without a filter by default before 3.14
        retry.load_sync()
        assert (victim / "planted.txt").read_bytes() == data, "Flyte wrote outside its folder"
        (victim / "planted.txt").unlink()

    # taskpoint refuses such a tree when saving (and such an archive when restoring:
    # tests/test_safe_restore.py::test_unsafe_entries_are_refused).
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "escape").symlink_to(victim)
    with pytest.raises(taskpoint.CheckpointUnsafeError):
        taskpoint.Checkpoint.at(f"file://{tmp_path / 'store'}").save_sync(tree)
    assert list(victim.iterdir()) == []


# -- atomic commit -----------------------------------------------------------------------

_FLYTE_SAVER = """
import sys, flyte
ckpt = flyte.Checkpoint(sys.argv[1])
ckpt.save_sync(b"good" * 1024)
print("saved", flush=True)
ckpt.save_sync(sys.argv[2])  # a FIFO: the copy blocks until the test feeds it
"""


def test_a_save_killed_midway_flyte_loses_the_previous_checkpoint(tmp_path: Path) -> None:
    """Flyte opens its one checkpoint object for writing in place, so a process killed
    mid-save on a file system leaves a torn object where the good one was. taskpoint's
    commit is the manifest written last: tests/test_crash_during_save.py kills saves at
    random instants and always finds the previous checkpoint."""
    dest = tmp_path / "flyte" / "_flytecheckpoints"
    fifo = tmp_path / "new-state"
    os.mkfifo(fifo)
    child = subprocess.Popen(
        [sys.executable, "-c", _FLYTE_SAVER, str(dest), str(fifo)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "saved\n"
        with fifo.open("wb") as feed:  # opens once the child reads: dest is truncated by then
            feed.write(b"new!" * 65536)  # half of a 512 KiB state
            feed.flush()
            deadline = time.monotonic() + 30
            while dest.stat().st_size == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    assert child.returncode == -signal.SIGKILL
    torn = dest.read_bytes()  # usually the part of the new state copied so far
    assert len(torn) < 8 * 65536 and set(torn.split(b"new!")) <= {b""}, "neither old nor new"
    retry = flyte.Checkpoint(str(tmp_path / "next"), str(dest))
    restored = retry.load_sync()  # an empty object reads as "no checkpoint"
    assert (restored.read_bytes() if restored else b"") == torn, "the good one is gone"


# -- a process-wide side effect of Flyte --------------------------------------------------


def test_flyte_init_makes_obstore_the_fsspec_s3_handler() -> None:
    """Why the fixture above restores fsspec's registry, and a hazard inside Flyte tasks:
    after ``flyte.init()`` an ``s3://`` URL resolves to obstore's fsspec store, which takes
    other ``storage_options`` than s3fs (``key``/``secret``/``client_kwargs`` are refused).
    Checked in a fresh process: the registration happens once, when flyte.storage loads."""
    probe = (
        "import flyte, fsspec\n"
        "flyte.init()\n"
        "print(*(fsspec.get_filesystem_class(p).__module__ for p in ('s3', 'gs', 'file')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == [
        "obstore.fsspec",
        "obstore.fsspec",
        "fsspec.implementations.local",
    ]


def test_taskpoint_keeps_its_own_backends_after_flyte_init() -> None:
    """taskpoint resolves bucket protocols to s3fs / gcsfs / adlfs itself, so its
    ``storage_options`` keep their meaning inside a Flyte task."""
    probe = (
        "import flyte\n"
        "flyte.init()\n"
        "from taskpoint.store.store import Store\n"
        "s3 = Store('s3://bucket/p', {'key': 'k', 'secret': 's',\n"
        "           'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9'}}).fs\n"
        "gs = Store('gs://bucket/p', {'token': 'anon'}).fs\n"
        "print(type(s3).__module__, type(gs).__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["s3fs.core", "gcsfs.core"]
