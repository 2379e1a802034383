"""``taskpoint.checkpoint.mirror.unshare``: a file a snapshot still links is made a file of its own
before it is written again, so the snapshot keeps what it linked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from taskpoint.checkpoint.mirror import unshare


@pytest.mark.parametrize("copy", [True, False])
def test_a_linked_file_gets_its_own_and_the_link_keeps_the_content(
    tmp_path: Path, copy: bool
) -> None:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    last = folder / "last.ckpt"
    last.write_bytes(b"step 3")
    snapshot = tmp_path / "snapshot.ckpt"
    os.link(last, snapshot)

    assert unshare(folder, copy=copy) == 1
    if copy:  # same content, another file
        assert last.read_bytes() == b"step 3" and last.stat().st_nlink == 1
    else:  # removed: the framework writes it anew
        assert not last.exists()
    last.write_bytes(b"step 6")  # in place, as torch.save does
    assert snapshot.read_bytes() == b"step 3"
    assert unshare(folder, copy=copy) == 0  # nothing linked any more


def test_unlinked_files_links_and_missing_paths_are_left_alone(tmp_path: Path) -> None:
    alone = tmp_path / "alone.ckpt"
    alone.write_bytes(b"x")
    (tmp_path / "link.ckpt").symlink_to(alone)
    assert unshare(tmp_path / "link.ckpt", copy=False) == 0
    assert unshare(alone, copy=False) == 0 and alone.exists()
    assert unshare(tmp_path / "missing.ckpt", copy=False) == 0
