"""Child process for the killed-process test: ``cases.train_all`` against ``file://ROOT``,
dying right after training NAME on chunk ROUND and before saving it.

Usage: python _child_train.py ROOT ROUND NAME HOW

HOW ``sigkill`` sends the process SIGKILL; ``exit137`` calls ``os._exit(137)``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cases


def main(root: str, chunk: str, name: str, how: str) -> None:
    def maybe_die(i: int, trained: str) -> None:
        if (i, trained) != (int(chunk), name):
            return
        sys.stdout.flush()
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)

    cases.train_all(root, maybe_die)
    raise SystemExit("finished without being killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
