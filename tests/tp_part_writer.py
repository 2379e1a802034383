"""One writer of a multi-writer checkpoint, as its own process (for tests/test_parts.py and
tests/test_netns.py).

Usage: python tp_part_writer.py SPEC_JSON

The spec: ``{"url", "meet", "rank", "world_size", "session", "timeout", "folder",
"files": {relative path: text}, "ready", "go", "out"}`` and optionally ``"random"``,
``"timeouts"``, ``"die_before_round"``, ``"die_after_round"`` and ``"await"``. It builds
``folder`` from ``files`` (and ``"random": {relative path: [seed, size]}``: ``size`` bytes
of ``random.Random(seed).randbytes``, incompressible) and its
:class:`taskpoint.StoreCoordinator` meeting at ``meet``, writes the file ``ready`` once
connected to the store, waits until the file ``go`` exists (so the test starts every
writer's save at once, however slowly each process started), calls
``Checkpoint(url).save_part_sync``, and writes ``{"ok": true}`` or ``{"error": "<type>:
<message>", "ranks": [...], "committed": ...}`` to ``out``, with the save's seconds.

The save's rounds are numbered from 0 (the protocol makes four: the greeting, the
numbers (a broadcast), the parts, the outcome (a broadcast)). ``"timeouts": {"<round>": seconds}`` gives a round its own
timeout (the others wait ``timeout``); ``"die_before_round"``/``"die_after_round"``: n
makes the process SIGKILL itself just before it enters round n, or just after round n
returned (every rank's value in hand); ``"await": {"<round>": [ranks]}``: before round n,
wait until those ranks have entered it (their records are in the store).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint.distributed.coordination import COORDINATION
from taskpoint.store.store import Store

HANG_S = 240.0
"""Bounds waits for another process's event; only a hang reaches it."""


class Scripted(taskpoint.Coordinator):
    """A :class:`taskpoint.StoreCoordinator` with per-round timeouts, waits and a death."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._inner = taskpoint.StoreCoordinator(
            spec["meet"], rank=spec["rank"], world_size=spec["world_size"],
            session=spec["session"], timeout=spec["timeout"], poll=0.05,
        )
        self._store = Store(spec["meet"])
        self._session = spec["session"]
        self._timeouts = {int(k): float(v) for k, v in spec.get("timeouts", {}).items()}
        self._awaits = {int(k): list(v) for k, v in spec.get("await", {}).items()}
        self._die_before = spec.get("die_before_round")
        self._die_after = spec.get("die_after_round")
        self._round = 0

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        number = self._enter()
        gathered = self._inner.all_gather(value, timeout=self._timeouts.get(number, timeout))
        self._leave(number)
        return gathered

    def broadcast(self, value: Any, *, timeout: float | None = None) -> Any:
        number = self._enter()
        sent = self._inner.broadcast(value, timeout=self._timeouts.get(number, timeout))
        self._leave(number)
        return sent

    def _enter(self) -> int:
        """Number the round this rank is entering; die or wait there as the spec says."""
        number = self._round
        self._round += 1
        if number == self._die_before:
            os.kill(os.getpid(), signal.SIGKILL)
        for other in self._awaits.get(number, []):
            key = f"{COORDINATION}/{self._session}/{number:06d}/{other:06d}.json"
            deadline = time.monotonic() + HANG_S
            while not self._store.exists(key):
                assert time.monotonic() < deadline, f"rank {other} never entered round {number}"
                time.sleep(0.05)
        return number

    def _leave(self, number: int) -> None:
        if number == self._die_after:
            os.kill(os.getpid(), signal.SIGKILL)

def main() -> None:
    spec = json.loads(sys.argv[1])
    folder = Path(spec["folder"])
    for rel, text in spec["files"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    for rel, (seed, size) in spec.get("random", {}).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(random.Random(seed).randbytes(size))
    coord = Scripted(spec)
    checkpoint = taskpoint.Checkpoint(spec["url"])
    checkpoint.committed()  # connected to the store before the test says go
    Path(spec["ready"]).touch()
    deadline = time.monotonic() + HANG_S
    while not Path(spec["go"]).exists():
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.02)
    started = time.monotonic()
    result: dict[str, object]
    try:
        checkpoint.save_part_sync(folder, coordinator=coord)
        result = {"ok": True}
    except taskpoint.CheckpointError as exc:
        result = {
            "error": f"{type(exc).__name__}: {exc}", "ranks": getattr(exc, "ranks", None),
            "committed": getattr(exc, "committed", None),
        }
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - started
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
