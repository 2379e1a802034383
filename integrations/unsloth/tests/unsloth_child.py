"""A training process for the killed-process test.

    python unsloth_child.py --store URL --base DIR --work DIR [--stop STEP]

Trains the tiny LoRA run against the checkpoint ``URL`` (a new attempt per process) and
writes ``DIR/result.pt`` when it finishes. ``--stop`` makes the process die
(``os._exit(137)``) at that step, as a killed worker would.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--stop", type=int, default=None)
    opts = parser.parse_args()

    import taskpoint
    import torch
    import unsloth_testkit as kit  # first: it imports Unsloth before transformers

    torch.set_num_threads(1)
    stop = kit.StopAt(opts.stop, how="exit") if opts.stop is not None else None
    result = kit.run_unsloth_sft(
        taskpoint.Checkpoint(opts.store), opts.work / "out", opts.base, stop=stop
    )
    print(f"resumed from {result.resumed_from}", flush=True)
    torch.save(result.to_dict(), opts.work / "result.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
