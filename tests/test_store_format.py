"""Store format versions: every older format still loads, a newer one is refused.

``tests/fixtures/store-format-<N>/`` holds actions written by the taskpoint that introduced
format N (see ``tests/fixtures/make_store_format.py``). A reader must load all of them; a
record from a format newer than :data:`taskpoint.format.manifest.FORMAT_VERSION` must be refused
with a message that says to upgrade, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import taskpoint
from taskpoint.format.manifest import FORMAT_VERSION

FIXTURES = Path(__file__).parent / "fixtures"
FORMATS = sorted(int(p.name.rsplit("-", 1)[1]) for p in FIXTURES.glob("store-format-*"))
MTIME = 1_700_000_000


def test_there_is_a_fixture_for_every_format_up_to_the_current_one() -> None:
    assert list(range(1, FORMAT_VERSION + 1)) == FORMATS


@pytest.fixture(params=FORMATS, ids=lambda n: f"format-{n}")
def task_root(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A writable copy of one format's fixture store; returns its task folder."""
    shutil.copytree(FIXTURES / f"store-format-{request.param}", tmp_path / "store", symlinks=True)
    return tmp_path / "store" / "fixture.train"


def expected_tree(tree: Path) -> None:
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*")) == [
        "empty", "latest", "notes.txt", "run.sh", "weights", "weights/model.bin",
    ]
    assert (tree / "weights" / "model.bin").read_bytes() == bytes(range(256)) * 64
    assert (tree / "notes.txt").read_text() == "epoch 3\n"
    assert os.readlink(tree / "latest") == "weights/model.bin"
    assert stat.S_IMODE((tree / "run.sh").stat().st_mode) == 0o755
    assert (tree / "notes.txt").stat().st_mtime == MTIME
    assert (tree / "empty").is_dir() and not any((tree / "empty").iterdir())


@pytest.mark.parametrize("run", ["bytes", "empty-bytes", "file", "dir-gzip", "dir-zstd",
                                 "dir-none", "sha256"])
def test_every_kind_of_an_older_format_loads(task_root: Path, run: str) -> None:
    if run == "dir-zstd":
        pytest.importorskip("zstandard", reason='codec "zstd" needs taskpoint[zstd]')
    ckpt = taskpoint.Checkpoint(str(task_root / run))
    restored = ckpt.load_sync()
    assert restored is not None
    if run == "bytes":
        assert restored.read_bytes() == b"step=41"
    elif run == "empty-bytes":
        assert restored.read_bytes() == b""
    elif run == "file":
        assert restored.name == "last.ckpt"
        assert restored.read_bytes() == b"\x00weights\xff" * 100
    elif run == "sha256":
        assert ckpt.committed()[0].checksum.startswith("sha256:")
        assert restored.read_bytes() == b"hashed with sha256"
    else:
        assert restored.name == "run-state"
        expected_tree(restored)
    assert all(ckpt.verify(m) for m in ckpt.committed())


def test_an_older_format_run_takes_new_attempts_and_saves(task_root: Path) -> None:
    url = str(task_root / "bytes")
    assert taskpoint.Checkpoint(url).status() is not None
    ckpt = taskpoint.Checkpoint(url)
    ckpt.save_sync(b"step=42")
    assert ckpt.attempt == 2
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None and restored.read_bytes() == b"step=42"


def test_records_without_a_format_field_read_as_format_1(task_root: Path) -> None:
    run = task_root / "bytes"
    (run / "attempts" / "000001").write_text(json.dumps({"started": 1.0, "pid": 1}))
    (run / "status.json").write_text(json.dumps({"state": "failed", "attempts": 2}))
    ckpt = taskpoint.Checkpoint(str(run))
    assert ckpt.status() == {"state": "failed", "attempts": 2}
    ckpt.save_sync(b"ok")
    assert ckpt.attempt == 2


def _newer(record_path: Path) -> None:
    record = json.loads(record_path.read_text())
    record.update(format=FORMAT_VERSION + 1, added_in_a_later_format={"x": 1})
    record_path.write_text(json.dumps(record))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_newer_manifest_is_refused_saying_upgrade(task_root: Path) -> None:
    run = task_root / "dir-gzip"
    _newer(run / "checkpoints" / "000001-000000000.manifest.json")
    with pytest.raises(taskpoint.CheckpointFormatError) as info:
        taskpoint.Checkpoint(str(run)).load_sync()
    message = str(info.value)
    assert f"format {FORMAT_VERSION + 1}" in message and "upgrade taskpoint" in message
    assert "000001-000000000.manifest.json" in message


def test_a_newer_attempt_marker_refuses_a_save_and_writes_nothing(task_root: Path) -> None:
    run = task_root / "file"
    _newer(run / "attempts" / "000001")
    before = _snapshot(run)
    with pytest.raises(taskpoint.CheckpointFormatError, match="upgrade taskpoint"):
        taskpoint.Checkpoint(str(run)).save_sync(b"would prune a newer checkpoint")
    assert _snapshot(run) == before


def test_a_newer_status_record_is_refused(task_root: Path) -> None:
    run = task_root / "bytes"
    _newer(run / "status.json")
    with pytest.raises(taskpoint.CheckpointFormatError, match=r"status\.json.*upgrade taskpoint"):
        taskpoint.Checkpoint(str(run)).status()


def test_the_current_format_is_what_new_records_carry(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(str(tmp_path / "run"), keep=2)
    ckpt.save_sync(b"x")
    (tmp_path / "tree").mkdir()
    ckpt.save_sync(tmp_path / "tree")
    ckpt.mark_finished("succeeded", attempts=1)
    bytes_manifest, tree_manifest = sorted((tmp_path / "run" / "checkpoints").glob("*.manifest.json"))
    for record in (tree_manifest, tmp_path / "run" / "attempts" / "000000", tmp_path / "run" / "status.json"):
        assert json.loads(record.read_text())["format"] == FORMAT_VERSION
    # Bytes and single files are stored as before: a format-1 reader still loads them.
    assert json.loads(bytes_manifest.read_text())["format"] == 1


def test_a_format_1_reader_refuses_a_format_2_tree(tmp_path: Path) -> None:
    """What taskpoint 0.1's check does with a format-2 manifest (its FORMAT_VERSION was 1)."""
    from taskpoint.format import manifest as manifest_module

    ckpt = taskpoint.Checkpoint(str(tmp_path / "run"))
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a.txt").write_text("a")
    ckpt.save_sync(tmp_path / "tree")
    (path,) = (tmp_path / "run" / "checkpoints").glob("*.manifest.json")
    record = json.loads(path.read_text())
    original = manifest_module.FORMAT_VERSION
    manifest_module.FORMAT_VERSION = 1
    try:
        with pytest.raises(taskpoint.CheckpointFormatError, match="upgrade taskpoint"):
            manifest_module.check_format(record, url=str(path))
    finally:
        manifest_module.FORMAT_VERSION = original
