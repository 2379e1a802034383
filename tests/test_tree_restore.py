"""Restoring format-2 trees of many small files: exact, one open per file, and all or nothing.

A small file is one blob of a pack object; the restore creates it holding its bytes, with
its mode and modification time, in one open (``archive.Extractor.create``), and writes a
pack's files from several threads at once. These tests hold that to the same exactness as
any other restore, on real stores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
from taskpoint import Checkpoint, CheckpointCorruptError

FILES = 700
"""More files than one writing thread takes (``_tree_restore._BATCH``), in several folders."""


def _tree(root: Path) -> Path:
    """``FILES`` small files in 7 folders, with odd modes and times, empty files, and hard
    and symbolic links to small files."""
    for i in range(FILES):
        folder = root / f"d{i % 7}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"f{i:04d}"
        path.write_bytes(b"" if i % 50 == 0 else os.urandom(16 + i % 40))
        path.chmod((0o444, 0o664, 0o755, 0o600, 0o640)[i % 5])
        os.utime(path, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i))
    os.link(root / "d3" / "f0003", root / "d0" / "hard-to-small")
    os.link(root / "d0" / "f0000", root / "d1" / "hard-to-empty")
    (root / "d2" / "sym").symlink_to("../d3/f0010")
    return root


def _listing(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root`` with what a restore must reproduce of it."""
    found: dict[str, tuple[Any, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            found[rel] = ("dir", st.st_mode)
        else:
            found[rel] = ("file", st.st_mode, st.st_mtime_ns, st.st_nlink, path.read_bytes())
    return found


def test_many_small_files_round_trip_exactly(store_url: str, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    Checkpoint(store_url).save_sync(tree)
    restored = Checkpoint(store_url, workdir=tmp_path / "work").load_sync()
    assert restored is not None
    assert _listing(restored) == _listing(tree)
    assert (restored / "d0" / "hard-to-small").stat().st_ino == (
        restored / "d3" / "f0003"
    ).stat().st_ino
    assert (restored / "d1" / "hard-to-empty").stat().st_ino == (
        restored / "d0" / "f0000"
    ).stat().st_ino


def _counting(monkeypatch: pytest.MonkeyPatch, name: str, under: Path) -> list[str]:
    """The paths under ``under`` that calls of ``os.<name>`` got, in order."""
    calls: list[str] = []
    real: Callable[..., Any] = getattr(os, name)
    prefix = str(under)

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(prefix):
            calls.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, counted)
    return calls


def test_a_small_file_is_opened_once_and_its_mode_and_time_set_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small file was created empty, opened again to write its bytes, then given its
    mode and time by path: two opens and two path lookups more per file, most of the
    time of a 200k-file restore after the file system's own cost."""
    tree = _tree(tmp_path / "tree")
    url = f"file://{tmp_path / 'store'}"
    Checkpoint(url).save_sync(tree)
    work = tmp_path / "work"
    opened = _counting(monkeypatch, "open", work)
    chmodded = _counting(monkeypatch, "chmod", work)
    timed = _counting(monkeypatch, "utime", work)

    restored = Checkpoint(url, workdir=work).load_sync()

    assert restored is not None
    files = [p for p in restored.rglob("*") if p.is_file() and not p.is_symlink()]
    folders = {str(p) for p in restored.rglob("*") if p.is_dir() and not p.is_symlink()}
    assert len(files) == FILES + 2
    assert len(opened) == FILES == len(set(opened))  # the hard links are no new files
    assert set(chmodded) <= folders | {str(restored)}
    assert set(timed) <= folders | {str(restored)}


def test_a_damaged_blob_in_a_pack_of_many_files_fails_the_restore_whole(
    tmp_path: Path,
) -> None:
    """The threads writing a pack's files stop at the first blob that fails its hash: the
    load fails (the only checkpoint is damaged), leaves no restored files behind, and
    marks the object broken."""
    tree = _tree(tmp_path / "tree")
    url = f"file://{tmp_path / 'store'}"
    ckpt = Checkpoint(url)
    ckpt.save_sync(tree)
    (manifest,) = ckpt.committed()
    entry = next(e for e in manifest.entries or () if e.path == "d5/f0600")
    (blob,) = entry.blobs
    fs, root = fsspec.core.url_to_fs(url)
    key = f"{root}/objects/{blob.object}"
    data = bytearray(fs.cat_file(key))
    data[blob.offset] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    work = tmp_path / "work"

    with pytest.warns(UserWarning, match="damaged"), pytest.raises(CheckpointCorruptError):
        Checkpoint(url, workdir=work).load_sync()

    assert not [p for p in work.rglob("*") if not p.is_dir()]
    assert not ckpt.verify(manifest)


def test_the_collector_pause_ends_with_the_last_and_keeps_a_disabled_collector_off() -> None:
    import gc

    from taskpoint.format._gc import paused
    from taskpoint.format.manifest import Manifest

    assert gc.isenabled()
    first = paused()
    with paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the first is still open
    first.end()
    first.end()
    assert gc.isenabled()
    with pytest.raises(CheckpointCorruptError):
        Manifest.from_json(b"{not json", url="memory://x")
    assert gc.isenabled()  # a failed parse ends its pause too
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()


@pytest.mark.parametrize("at", [0, 8 * 2**20 - 30, 8 * 2**20 - 65, 8 * 2**20, 8 * 2**20 + 7])
def test_an_integer_too_long_is_refused_wherever_it_lies_in_a_large_record(at: int) -> None:
    """The scan for long digit runs reads a record 8 MiB at a time: a run across two of
    them counts too. (A 65-digit integer stands for the millions of digits that would take
    ``int()`` minutes.)"""
    from taskpoint.format.manifest import loads_record

    padding = b" " * at
    with pytest.raises(ValueError, match="digits"):
        loads_record(b'{"pad": "x",' + padding + b'"n": ' + b"9" * 65 + b"}")
    assert loads_record(b'{"pad": "x",' + padding + b'"n": ' + b"9" * 64 + b"}") == {
        "pad": "x", "n": int("9" * 64)
    }
