"""A process killed at any instant of a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from taskpoint import Checkpoint

CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import taskpoint

    url, tree = sys.argv[1], Path(sys.argv[2])
    ckpt = taskpoint.Checkpoint(url)
    generation = 0
    while True:
        generation += 1
        for i in range(4):
            (tree / f"shard-{i}.bin").write_bytes(bytes([generation % 256]) * (2 * 1024 * 1024))
        (tree / "generation.txt").write_text(str(generation))
        ckpt.save_sync(tree)
        print(generation, flush=True)
    """
)


def _check_restored(url: str) -> int:
    restored = Checkpoint(url).load_sync()
    assert restored is not None
    generation = int((restored / "generation.txt").read_text())
    for i in range(4):
        data = (restored / f"shard-{i}.bin").read_bytes()
        assert data == bytes([generation % 256]) * len(data) and len(data) == 2 * 1024 * 1024
    return generation


@pytest.mark.parametrize("store", ["file"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path: Path, store: str) -> None:
    url = f"file://{tmp_path / 'store'}"
    tree = tmp_path / "tree"
    tree.mkdir()
    rng = random.Random(1234)
    last_seen = 0
    for _ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(tree)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        child.stdout.readline()  # at least one commit happened
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        generation = _check_restored(url)
        assert generation >= 1
        last_seen = max(last_seen, generation)
    assert last_seen >= 1


def test_readers_never_see_a_half_written_checkpoint(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    tree = tmp_path / "tree"
    tree.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(tree)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
        deadline = time.monotonic() + 3
        loads = 0
        while time.monotonic() < deadline:
            _check_restored(url)
            loads += 1
        assert loads > 3
    finally:
        child.kill()
        child.wait()
