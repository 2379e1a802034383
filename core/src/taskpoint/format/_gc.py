"""Pausing Python's cyclic garbage collector while a tree's many objects are built.

A format-2 manifest of 200k files parses into about two million Python objects (the JSON's
dicts and lists, then entries, blobs and their tuples), and restoring it builds several
more per file. Each allocation counts towards the collector's thresholds, and its full
collections traverse every object built so far: a third of a 50k-file restore's CPU time
(``bench/bench_many_files.py``), gone with the collector paused. Nothing built there forms
reference cycles that need it: every object is freed by reference counting or kept.

The pause is process-wide, so it covers only stretches that build objects without waiting
on the network; what other threads left meanwhile is collected once it ends.

Example::

    with paused():
        manifest = Manifest.from_json(data, url=url)
"""

from __future__ import annotations

import gc
import threading
from types import TracebackType

__all__ = ["paused"]

_lock = threading.Lock()
_holders = 0
"""Pauses now open, in any thread: the collector runs again when the last one ends."""
_resume = False
"""Whether the collector was enabled when the first of them began."""


class paused:
    """Pause the cyclic garbage collector until :meth:`end` or the ``with`` block's exit.

    Pauses nest and may overlap across threads: the collector is re-enabled when the last
    one ends, and only if it was enabled when the first began (one that user code turned
    off stays off).
    """

    def __init__(self) -> None:
        global _holders, _resume
        with _lock:
            if _holders == 0:
                _resume = gc.isenabled()
                gc.disable()
            _holders += 1
        self._open = True

    def end(self) -> None:
        """End this pause (again: nothing)."""
        global _holders
        with _lock:
            if not self._open:
                return
            self._open = False
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()

    def __enter__(self) -> paused:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end()
