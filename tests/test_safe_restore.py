"""Restoring a directory never writes outside the restore folder."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
from taskpoint import Checkpoint, CheckpointUnsafeError
from taskpoint.format.manifest import Manifest, manifest_name, payload_name

# Entries are refused by what the archive or the tree holds, whichever store it came from:
# the file store and one object store (a download through an object-store backend) are
# enough.
pytestmark = pytest.mark.stores("file", "s3")


def _commit_archive(url: str, build: Callable[[tarfile.TarFile], None]) -> None:
    """Commit a hand-made tar.gz as if taskpoint had saved it, with a valid checksum."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        build(tar)
    data = buf.getvalue()
    fs, path = fsspec.core.url_to_fs(url)
    payload = payload_name(0, 0, "evil0000")
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    fs.pipe_file(f"{path}/checkpoints/{payload}", data)
    manifest = Manifest(
        kind="directory", name="tree", codec="gzip", size=len(data),
        checksum="sha256:" + hashlib.sha256(data).hexdigest(), payload=payload,
        attempt=0, seq=0, created=time.time(),
    )
    fs.pipe_file(f"{path}/checkpoints/{manifest_name(0, 0)}", manifest.to_json())


def _file(tar: tarfile.TarFile, name: str, data: bytes = b"pwned") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _link(tar: tarfile.TarFile, name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    tar.addfile(info)


def _device(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    tar.addfile(info)


def _fifo(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    tar.addfile(info)


CASES: dict[str, Callable[[tarfile.TarFile, Path], None]] = {
    "absolute path": lambda tar, victim: _file(tar, str(victim / "abs.txt")),
    "dot-dot": lambda tar, victim: _file(tar, "../../../../../../" + str(victim / "up.txt")),
    "symlink outside": lambda tar, victim: _link(tar, "escape", str(victim)),
    "relative symlink outside": lambda tar, victim: _link(tar, "escape", "../../../../../../../.."),
    "dot-dot inside a name": lambda tar, victim: _file(
        tar, "a/../../" + os.path.relpath(victim / "mid.txt", "/")
    ),
    "hard link outside": lambda tar, victim: _link(
        tar, "hard", str(victim / "target.txt"), tarfile.LNKTYPE
    ),
    "device": lambda tar, victim: _device(tar, "null"),
    "fifo": lambda tar, victim: _fifo(tar, "pipe"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unsafe_entries_are_refused(store_url: str, tmp_path: Path, case: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "target.txt").write_text("original")
    _commit_archive(store_url, lambda tar: CASES[case](tar, victim))
    workdir = tmp_path / "restore"
    with pytest.raises(CheckpointUnsafeError, match="refusing archive entry"):
        Checkpoint(store_url, workdir=workdir).load_sync()
    assert sorted(p.name for p in victim.iterdir()) == ["target.txt"]
    assert (victim / "target.txt").read_text() == "original"
    assert not list(workdir.rglob("*.txt")), "a refused restore is removed, not half-left"


def test_saving_a_link_that_leaves_the_tree_is_refused(store_url: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.txt").write_text("ok")
    (tree / "escape").symlink_to(tmp_path)
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(b"previous")
    with pytest.raises(CheckpointUnsafeError, match="points outside the tree"):
        ckpt.save_sync(tree)
    assert ckpt.load_sync().read_bytes() == b"previous"  # type: ignore[union-attr]


def test_saving_an_absolute_link_is_refused(store_url: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("a")
    (tree / "abs").symlink_to(tree / "a.txt")
    with pytest.raises(CheckpointUnsafeError, match="only relative links"):
        Checkpoint(store_url).save_sync(tree)


def test_saving_a_fifo_is_refused(store_url: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    os.mkfifo(tree / "pipe")
    with pytest.raises(CheckpointUnsafeError, match="not a regular file"):
        Checkpoint(store_url).save_sync(tree)
