"""Entry point of a process-isolated attempt: ``python -m taskpoint._child SPEC OUTCOME``.

Kept apart from ``_isolation`` so that running it as ``__main__`` does not create a second
copy of the classes the outcome is pickled with.
"""

from __future__ import annotations

import sys

from taskpoint._isolation import child_main

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2]))
