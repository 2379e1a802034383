"""Child process for the killed-process tests: trains against a file:// checkpoint and dies.

Usage: python tp_torch_child.py URL OUT [--die-at STEP] [--kill-before-save N]
       [--kill-after-save N]

``--die-at`` ends the process with ``os._exit(137)`` before that global step;
``--kill-before-save``/``--kill-after-save`` SIGKILL it inside this process's N-th save,
before the upload starts or right after the commit. A run that finishes writes its
final state to OUT with ``torch.save``. Each run prints ``START <epoch> <step>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tp_torch_training as lib
from taskpoint import Checkpoint


class KillingCheckpoint(lib.DelegatingCheckpoint):
    """A CheckpointLike that SIGKILLs this process around its N-th save."""

    def __init__(self, inner: Checkpoint, before: int | None, after: int | None) -> None:
        super().__init__(inner)
        self.before = before
        self.after = after
        self.saves = 0

    def save_sync(self, data: Any) -> None:
        self.saves += 1
        if self.saves == self.before:
            os.kill(os.getpid(), signal.SIGKILL)
        super().save_sync(data)
        if self.saves == self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--kill-before-save", type=int)
    parser.add_argument("--kill-after-save", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def before_step(step: int) -> None:
        if step == args.die_at:
            os._exit(137)

    def on_resume(resume: Any) -> None:
        print("START", resume.epoch if resume else 0, resume.step if resume else 0, flush=True)

    checkpoint = KillingCheckpoint(
        Checkpoint(args.url), args.kill_before_save, args.kill_after_save
    )
    parts = lib.build()
    result = lib.run(parts, parts.state(), checkpoint, before_step=before_step, on_resume=on_resume)
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
