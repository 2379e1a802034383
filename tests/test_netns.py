"""Writers on simulated nodes, each with its own shaped network link (issue #26).

Two writer processes (``tp_part_writer.py``), each in its own network namespace joined to
this one by a link capped at :data:`RATE_MBIT` (``tests/_netns.py``), commit one checkpoint
to a SeaweedFS server listening on the links' host address, through a
:class:`taskpoint.StoreCoordinator`. Needs root and iproute2: skipped (saying why) without
them, and failing under ``CI=true`` when they are there but the namespaces cannot be made.
``bench/bench_netns.py`` measures the same set-up.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import _netns
import _servers
import pytest
import taskpoint

pytestmark = [pytest.mark.slow, pytest.mark.netns]

WRITER = Path(__file__).parent / "tp_part_writer.py"
RATE_MBIT = 20.0
"""Each node's link, each way: :data:`PAYLOAD` takes about 3.4 s to cross it."""
PAYLOAD = 8 * 1024 * 1024
HANG_S = 240.0
"""Bounds every wait for a writer: only a hang reaches it, however loaded the machine."""


@pytest.fixture
def nodes() -> Iterator[_netns.Nodes]:
    reason = _netns.why_unavailable()
    if reason is not None:
        pytest.skip(f"simulated nodes need network namespaces: {reason}")
    try:
        made = _netns.Nodes(2, rate_mbit=RATE_MBIT)
    except _netns.NetnsUnavailable as exc:
        _servers.required(
            f"cannot create network namespaces with shaped links here: {exc}",
            "root with iproute2 must be able to",
        )
    with made:
        yield made


@pytest.fixture
def server(nodes: _netns.Nodes, tmp_path: Path) -> Iterator[_servers.SeaweedS3]:
    """SeaweedFS on the links' host address, so that every node reaches it."""
    weed = _servers.SeaweedS3(tmp_path / "seaweedfs", host=nodes.host)
    try:
        weed.start()
    except _servers.ServerUnavailable as exc:
        _servers.unavailable("seaweedfs", str(exc))()
        raise  # unreachable: the line above fails or skips
    try:
        weed.create_bucket("nodes")
        yield weed
    finally:
        weed.stop()


def test_two_writers_on_their_own_links_commit_one_checkpoint(
    nodes: _netns.Nodes, server: _servers.SeaweedS3, tmp_path: Path
) -> None:
    url = "s3://nodes/run"
    session = uuid.uuid4().hex[:12]
    env = {**os.environ, **server.environment()}
    writers = []
    for rank in range(2):
        spec = {
            "url": url, "meet": url, "rank": rank, "world_size": 2, "session": session,
            "timeout": HANG_S, "folder": str(tmp_path / f"node{rank}" / "out"),
            "files": {f"rank-{rank}.txt": f"node {rank}\n"},
            "random": {f"weights-{rank}.bin": [rank, PAYLOAD]},
            "ready": str(tmp_path / f"ready-{rank}"), "go": str(tmp_path / "go"),
            "out": str(tmp_path / f"out-{rank}.json"),
        }
        writers.append(nodes.popen(rank, [sys.executable, str(WRITER), json.dumps(spec)], env=env))
    deadline = time.monotonic() + HANG_S
    for rank, writer in enumerate(writers):
        while not (tmp_path / f"ready-{rank}").exists():
            assert writer.poll() is None, f"writer {rank} exited before its save"
            assert time.monotonic() < deadline, f"writer {rank} never started"
            time.sleep(0.05)
    before = [nodes.link_bytes(rank) for rank in range(2)]
    (tmp_path / "go").touch()
    for writer in writers:
        assert writer.wait(timeout=HANG_S) == 0
    results = [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in range(2)]
    assert all(r.get("ok") for r in results), results

    for rank in range(2):
        # each node's upload crossed its own shaped link: its bytes, no faster than the rate
        sent = nodes.link_bytes(rank)[0] - before[rank][0]
        assert sent >= PAYLOAD, (rank, sent)
        assert results[rank]["seconds"] >= 0.9 * PAYLOAD * 8 / (RATE_MBIT * 1e6), results

    checkpoint = taskpoint.Checkpoint(url, storage_options=server.storage_options())
    tree = checkpoint.load_sync()
    assert tree is not None
    assert sorted(p.name for p in tree.iterdir()) == [
        "rank-0.txt", "rank-1.txt", "weights-0.bin", "weights-1.bin",
    ]
    for rank in range(2):
        assert (tree / f"weights-{rank}.bin").read_bytes() == random.Random(rank).randbytes(PAYLOAD)
    part = checkpoint.load_sync(part=1)
    assert part is not None
    assert sorted(p.name for p in part.iterdir()) == ["rank-1.txt", "weights-1.bin"]
