"""One writer of a multi-writer checkpoint, as its own process (for tests/test_parts.py).

Usage: python tp_part_writer.py SPEC_JSON

The spec: ``{"url", "meet", "rank", "world_size", "session", "timeout", "folder",
"files": {relative path: text}, "delay": seconds, "out": path}``. It builds ``folder``
from ``files``, waits ``delay`` seconds, calls ``Checkpoint(url).save_part_sync`` with a
:class:`taskpoint.StoreCoordinator` meeting at ``meet``, and writes ``{"ok": true}`` or
``{"error": "<type>: <message>", "ranks": [...]}`` to ``out``, with how long it took.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import taskpoint


def main() -> None:
    spec = json.loads(sys.argv[1])
    folder = Path(spec["folder"])
    for rel, text in spec["files"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    time.sleep(spec.get("delay", 0))
    coord = taskpoint.StoreCoordinator(
        spec["meet"], rank=spec["rank"], world_size=spec["world_size"],
        session=spec["session"], timeout=spec["timeout"], poll=0.05,
    )
    started = time.monotonic()
    result: dict[str, object]
    try:
        taskpoint.Checkpoint(spec["url"]).save_part_sync(folder, coordinator=coord)
        result = {"ok": True}
    except taskpoint.CheckpointError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "ranks": getattr(exc, "ranks", None)}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - started
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
