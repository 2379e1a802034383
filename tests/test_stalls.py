"""A save whose network goes silent (issue #33, section 4): a real link cut, not a mock.

A writer process (``tp_stall_writer.py``) runs in its own network namespace, joined to this
one by a link capped at :data:`RATE_MBIT` (``tests/_netns.py``), and saves to a SeaweedFS
server listening on the link's host address. The test cuts the link (its end on the
bridge goes down; neighbour entries pinned, so packets vanish with no error, as on a
routed network) while the writer saves, under a small retry budget (:data:`POLICY`): a cut
longer than the budget fails the save with ``CheckpointStoreError`` within the budget,
before or midway through a multipart upload, leaving the checkpoint committed before it
loadable; a cut shorter than the budget is carried through, with a WARNING for the stalled
try. Needs root and iproute2: skipped (saying why) without them, and failing under
``CI=true`` when they are there but the namespaces cannot be made.
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
from typing import Any

import _netns
import _servers
import pytest
import taskpoint

pytestmark = [pytest.mark.slow, pytest.mark.netns]

WRITER = Path(__file__).parent / "tp_stall_writer.py"
RATE_MBIT = 20.0
"""The node's link, each way: 2.5 MB/s, so that a save of several MB is still under way
when the link is cut."""
MiB = 2**20
POLICY = taskpoint.RetryPolicy(attempts=4, initial=0.5, maximum=1.0, stall_timeout=3.0)
"""The writer's retry policy: a small budget, so that each test takes seconds."""
BUDGET_S = POLICY.budget()
"""4 tries of 3 s without progress, waits of 0.5, 1 and 1 s between them: 14.5 s."""
SHORT_CUT_S = 6.5
"""A cut shorter than the budget: two tries stall in it."""
MARGIN_S = 10.0
"""What a loaded machine may add to the budget: process start-up is not in it."""
LONG_CUT_S = 45.0
"""How long a cut "longer than the budget" lasts at most: the link comes back then (or as
soon as the writer has its answer), so that a writer that would hang ends the test."""
HANG_S = 240.0
"""Bounds every wait for the writer: only a hang reaches it."""


@pytest.fixture(scope="module")
def nodes() -> Iterator[_netns.Nodes]:
    reason = _netns.why_unavailable()
    if reason is not None:
        pytest.skip(f"simulated nodes need network namespaces: {reason}")
    try:
        made = _netns.Nodes(1, rate_mbit=RATE_MBIT)
    except _netns.NetnsUnavailable as exc:
        _servers.required(
            f"cannot create network namespaces with shaped links here: {exc}",
            "root with iproute2 must be able to",
        )
    with made:
        yield made


@pytest.fixture(scope="module")
def server(
    nodes: _netns.Nodes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_servers.SeaweedS3]:
    """SeaweedFS on the link's host address, which the node reaches through its link."""
    weed = _servers.SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), host=nodes.host)
    try:
        weed.start()
    except _servers.ServerUnavailable as exc:
        _servers.unavailable("seaweedfs", str(exc))()
        raise  # unreachable: the line above fails or skips
    try:
        weed.create_bucket("stalls")
        yield weed
    finally:
        weed.stop()


class Writer:
    """One run of ``tp_stall_writer.py`` in the node: a first save, then a second on ``go``."""

    def __init__(
        self, nodes: _netns.Nodes, server: _servers.SeaweedS3, folder: Path, second: int,
        policy: taskpoint.RetryPolicy = POLICY,
    ) -> None:
        self.url = f"s3://stalls/{uuid.uuid4().hex[:12]}"
        self.folder = folder
        self.first, self.second = 64 * 1024, second
        spec = {
            "url": self.url, "first": self.first, "second": second,
            "retry": {
                "attempts": policy.attempts, "initial": policy.initial,
                "maximum": policy.maximum, "stall_timeout": policy.stall_timeout,
            },
            "ready": str(folder / "ready"), "go": str(folder / "go"),
            "restored": str(folder / "restored"), "out": str(folder / "out.json"),
        }
        env = {**os.environ, **server.environment(), "TASKPOINT_PART_SIZE": str(5 * MiB)}
        self.log = folder / "writer.log"
        with open(self.log, "wb") as log:
            self.process = nodes.popen(
                0, [sys.executable, str(WRITER), json.dumps(spec)], env=env, stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + HANG_S
        while not (folder / "ready").exists():
            assert self.process.poll() is None, f"the writer died: {self.log.read_text()}"
            assert time.monotonic() < deadline, "the writer never made its first save"
            time.sleep(0.05)

    def go(self) -> float:
        """Start the second save; when it was started (``time.monotonic``)."""
        (self.folder / "go").touch()
        return time.monotonic()

    def result(self, *, until: float, key: str = "seconds") -> dict[str, Any] | None:
        """The writer's outcome once it holds ``key``; ``None`` if it does not by ``until``."""
        out = self.folder / "out.json"
        while True:
            if out.exists():
                result: dict[str, Any] = json.loads(out.read_text())
                if key in result:
                    return result
            assert self.process.poll() is None, f"the writer died: {self.log.read_text()}"
            if time.monotonic() >= until:
                return None
            time.sleep(0.05)

    def loaded_after_restore(self) -> dict[str, Any]:
        """Tell the writer the link is back; its outcome with what it then loaded."""
        (self.folder / "restored").touch()
        result = self.result(until=time.monotonic() + HANG_S, key="loaded")
        assert result is not None, f"the writer never loaded: {self.log.read_text()}"
        assert self.process.wait(timeout=HANG_S) == 0, self.log.read_text()
        return result


def payload(which: int, size: int) -> bytes:
    return random.Random(which).randbytes(size)


def assert_first_save_still_loads(server: _servers.SeaweedS3, writer: Writer) -> None:
    """From this namespace, whose link to the server was never cut."""
    reader = taskpoint.Checkpoint(writer.url, storage_options=server.storage_options())
    loaded = reader.load_sync()
    assert loaded is not None
    assert loaded.read_bytes() == payload(1, writer.first)


def assert_failed_within_budget(result: dict[str, Any] | None, allowed: float) -> None:
    assert result is not None, (
        f"the save had not ended when the link came back ({LONG_CUT_S:.0f} s later); allowed: {allowed:.0f} s"
    )
    assert result["ok"] is False, result
    assert result["error"] == "CheckpointStoreError", result
    assert result["seconds"] <= allowed, result
    # It says what failed, how often and how long it tried, and why.
    assert "after 4 tries over" in result["message"], result
    assert "no bytes moved for 3 s" in result["message"], result


def test_a_save_into_a_cut_longer_than_the_budget_fails_within_it(
    nodes: _netns.Nodes, server: _servers.SeaweedS3, tmp_path: Path
) -> None:
    writer = Writer(nodes, server, tmp_path, second=6 * MiB)
    nodes.cut(0)
    try:
        started = writer.go()
        result = writer.result(until=started + LONG_CUT_S)
    finally:
        nodes.restore(0)
    assert_failed_within_budget(result, BUDGET_S + MARGIN_S)

    after = writer.loaded_after_restore()
    assert after["loaded"] == 1, after  # the writer's own client works again
    assert_first_save_still_loads(server, writer)


def test_a_cut_midway_through_a_multipart_upload_fails_within_the_budget(
    nodes: _netns.Nodes, server: _servers.SeaweedS3, tmp_path: Path
) -> None:
    writer = Writer(nodes, server, tmp_path, second=24 * MiB)  # 5 parts, ~10 s on the link
    sent_before = nodes.link_bytes(0)[0]
    started = writer.go()
    try:
        while nodes.link_bytes(0)[0] - sent_before < 4 * MiB:  # parts are under way
            assert time.monotonic() < started + HANG_S, "the upload never started"
            assert writer.result(until=0) is None, "the save ended before the cut"
            time.sleep(0.02)
        nodes.cut(0)
        cut_at = time.monotonic() - started
        result = writer.result(until=time.monotonic() + LONG_CUT_S)
    finally:
        nodes.restore(0)
    assert_failed_within_budget(result, cut_at + BUDGET_S + MARGIN_S)

    after = writer.loaded_after_restore()
    assert after["loaded"] == 1, after
    assert_first_save_still_loads(server, writer)


def test_a_cut_shorter_than_the_budget_is_carried_through(
    nodes: _netns.Nodes, server: _servers.SeaweedS3, tmp_path: Path
) -> None:
    # More tries than the other tests: on a loaded machine a try after the cut may stall
    # too, and this test is about the cut, not about the budget's edge.
    policy = taskpoint.RetryPolicy(attempts=6, initial=0.5, maximum=1.0, stall_timeout=3.0)
    assert policy.budget() / 2 > SHORT_CUT_S
    writer = Writer(nodes, server, tmp_path, second=12 * MiB, policy=policy)  # 3 parts
    nodes.cut(0)
    try:
        started = writer.go()
        time.sleep(SHORT_CUT_S)  # the first tries are given up, and retried
    finally:
        nodes.restore(0)
    result = writer.result(until=started + HANG_S)
    assert result is not None
    assert result["ok"] is True, result
    # The stalled try was reported, not waited out in silence.
    log = writer.log.read_text()
    assert "transient store error" in log and "no bytes moved" in log, log

    after = writer.loaded_after_restore()
    assert after["loaded"] == 2, after
