"""A writer whose network link the test cuts, as its own process (for tests/test_stalls.py).

Usage: python tp_stall_writer.py SPEC_JSON

The spec: ``{"url", "retry": {"attempts", "initial", "maximum", "stall_timeout"},
"first": size, "second": size, "ready", "go", "restored", "out"}``. The writer saves
``first`` bytes (``random.Random(1).randbytes``) with ``Checkpoint(url).save_sync``, writes
the file ``ready``, waits for the file ``go``, then saves ``second`` bytes
(``random.Random(2)``) and writes the outcome to ``out`` (``{"ok": true}`` or ``{"error":
"<type>", "message": ...}``, with the save's ``seconds``). It then waits for the file
``restored`` (the link is back) and loads the latest checkpoint, adding to ``out`` which
save it holds (``"loaded": 1`` or ``2``, or an error). Each wait ends after
:data:`HANG_S` seconds, so no writer outlives a broken test.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import taskpoint

HANG_S = 240.0


def wait_for(path: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)


def payload(which: int, size: int) -> bytes:
    return random.Random(which).randbytes(size)


def publish(out: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``out`` whole: a reader never sees half of it."""
    part = out.with_suffix(".part")
    part.write_text(json.dumps(result))
    part.replace(out)


def main(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    checkpoint = taskpoint.Checkpoint(spec["url"], retry=taskpoint.RetryPolicy(**spec["retry"]))
    checkpoint.save_sync(payload(1, spec["first"]))
    Path(spec["ready"]).touch()
    wait_for(spec["go"])
    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        checkpoint.save_sync(payload(2, spec["second"]))
        result["ok"] = True
    except Exception as exc:
        result.update(ok=False, error=type(exc).__name__, message=str(exc))
    result["seconds"] = time.monotonic() - started
    publish(out, result)

    wait_for(spec["restored"])
    try:
        loaded = checkpoint.load_sync()
        assert loaded is not None
        data = loaded.read_bytes()
        result["loaded"] = next(
            (n for n, size in ((1, spec["first"]), (2, spec["second"]))
             if data == payload(n, size)),
            "neither",
        )
    except Exception as exc:
        result["loaded"] = f"{type(exc).__name__}: {exc}"
    publish(out, result)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
