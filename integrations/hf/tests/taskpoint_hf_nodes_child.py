"""One node's training process for the two-node tests (``test_nodes.py``).

    torchrun --nnodes=2 --node_rank=K ... taskpoint_hf_nodes_child.py --store URL
        --results DIR [--reference] [--stop STEP] [--raise-at STEP] [--fail-restore]
        [--fsdp] [--slow-upload SECONDS] [--set KEY=VALUE ...]

Runs the tiny classifier with ``output_dir="out"``, relative to the node's own working
directory (so each node has its own disk), against the checkpoint ``URL``, and writes
``DIR/<run>-rank<R>.pt`` when it finishes. ``--reference`` instead runs it uninterrupted,
without a checkpoint (``output_dir="reference"``). Before training, each rank lists the
files in its ``output_dir`` (what the restore left there) into ``DIR/restored-rank<R>.json``. ``--stop`` makes the last rank die
(``os._exit(137)``) at that step; ``--raise-at`` makes it raise there, without waiting for
the upload in flight first. ``--slow-upload`` holds each rank's upload for ``SECONDS`` once
the store holds a committed checkpoint (``--store`` must be a ``file://`` URL). ``--fail-restore`` makes the restore fail on node 1 (its
store read raises). ``--fsdp`` trains on the node's GPU with FSDP2 and
``SHARDED_STATE_DICT`` (each rank writes its own model and optimizer shards), fully
deterministic. Any error is printed as ``rank R: error: ...`` before exiting non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback


class _ListRestored(TrainerCallback):
    """Lists the files in ``output_dir`` when training begins, before the first save."""

    def __init__(self, out: Path, listing: Path) -> None:
        self.out, self.listing = out, listing

    def on_train_begin(self, args: object, state: object, control: object, **kw: object) -> None:
        files = sorted(
            p.relative_to(self.out).as_posix() for p in self.out.rglob("*")
            if p.is_file() and not p.relative_to(self.out).parts[0].startswith(".taskpoint-")
        )
        self.listing.write_text(json.dumps(files), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--stop", type=int, default=None)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--slow-upload", type=float, default=None)
    parser.add_argument("--fail-restore", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    opts = parser.parse_args()

    torch.set_num_threads(1)
    import taskpoint
    import taskpoint_hf_testkit as kit

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    overrides = {k: (v == "true" if v in ("true", "false") else v)
                 for k, v in (item.split("=", 1) for item in opts.set)}
    if opts.fsdp:
        overrides.update(
            use_cpu=False, full_determinism=True, fsdp=True,
            fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
        )
    opts.results.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        if opts.reference:
            result = kit.run_classifier(None, Path("reference"), **overrides)
            torch.save(result.to_dict(), opts.results / f"reference-rank{rank}.pt")
            return 0
        if opts.slow_upload:
            store = opts.store.removeprefix("file://")
            marker = opts.results / f"slow-upload-rank{rank}"
            checkpoint = taskpoint.Checkpoint(
                opts.store, progress=kit.SlowUpload(store, marker, opts.slow_upload)
            )
        else:
            checkpoint = taskpoint.Checkpoint(opts.store)
        if opts.fail_restore and node == 1:
            def unreadable(**kwargs: object) -> None:
                raise OSError("simulated: node 1 cannot read the store")
            checkpoint.load_sync = unreadable  # type: ignore[method-assign]
        stop = kit.StopAt(opts.stop, how="exit") if opts.stop and rank == world - 1 else None
        if opts.raise_at and rank == world - 1:
            stop = kit.StopAt(opts.raise_at, how="raise", settle=False)
        listing = _ListRestored(Path("out"), opts.results / f"restored-rank{rank}.json")
        result = kit.run_classifier(
            checkpoint, Path("out"), stop=stop, callbacks=[listing], **overrides
        )
    except Exception as exc:
        traceback.print_exc()
        print(
            f"rank {rank}: error after {time.monotonic() - started:.1f}s: "
            f"{type(exc).__name__}: {exc}",
            flush=True,
        )
        return 1
    print(f"rank {rank}: resumed from {result.resumed_from}", flush=True)
    torch.save(result.to_dict(), opts.results / f"run-rank{rank}.pt")
    return 0


if __name__ == "__main__":
    code = main()
    import taskpoint_hf_testkit as kit

    kit.end_process_group()
    sys.exit(code)
