"""The checkpoint-argument check every adapter makes (``taskpoint._types``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import taskpoint
from taskpoint._types import check_checkpoint_like


def test_a_checkpoint_passes_and_anything_else_is_named(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(tmp_path / "store")
    assert check_checkpoint_like(ckpt, "Adapter") is ckpt
    with pytest.raises(TypeError, match=r"^Adapter takes a checkpoint .*CheckpointLike.*got str$"):
        check_checkpoint_like("file:///tmp/x", "Adapter")
    with pytest.raises(TypeError, match=r"got NoneType \(taskpoint.ctx\(\).checkpoint is None"):
        check_checkpoint_like(None, "Adapter")
