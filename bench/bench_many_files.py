"""Restore time against the number of entries of a format-2 tree (issue #24).

Run: uv run python bench/bench_many_files.py [--files 20000,50000,100000,200000]
                                             [--stores file] [--size 64] [--repeat 1]

For each count, saves a fresh tree of that many small files (``--size`` bytes each, 500 to
a folder, all packed into a few objects) and restores it into a new folder, then prints the
save and restore seconds and the restore seconds per 10k entries. The last line compares
the largest tree's seconds per 10k entries with the smallest's: a restore linear in its
entries keeps that ratio near 1 (a quadratic one doubles it with every doubling of the
tree). Timings are medians of ``--repeat`` restores (no warm-up run); the load average
printed first says how busy the machine was; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import taskpoint
from _common import bench_store, note, report, timed

PER_FOLDER = 500


def make_tree(root: Path, files: int, size: int) -> Path:
    """``files`` files of ``size`` distinct bytes each, ``PER_FOLDER`` to a folder."""
    for i in range(files):
        folder = root / f"d{i // PER_FOLDER:04d}"
        if i % PER_FOLDER == 0:
            folder.mkdir(parents=True)
        (folder / f"f{i:07d}.txt").write_bytes(f"{i:0{size}d}".encode()[:size])
    return root


def case(url: str, options: dict[str, object], tmp: Path, files: int, size: int,
         repeat: int) -> float:
    """Save and restore a tree of ``files`` files; the restore's seconds per 10k entries."""
    tree = make_tree(tmp / f"tree-{files}", files, size)
    ckpt = taskpoint.Checkpoint(f"{url}/many-{files}", storage_options=options,
                                workdir=tmp / "work")
    started = time.perf_counter()
    ckpt.save_sync(tree)
    saved_s = time.perf_counter() - started
    shutil.rmtree(tree)
    entries = len(ckpt.committed()[0].entries or ())
    into = tmp / "restored"

    def restore() -> None:
        restored = taskpoint.Checkpoint(f"{url}/many-{files}", storage_options=options,
                                        workdir=tmp / "work").load_sync(into=into)
        assert restored == into

    # No warm-up run: the save just read every file, and a second restore of 200k files
    # would double the run for no more information.
    restore_s = timed(restore, repeat, lambda: shutil.rmtree(into, ignore_errors=True),
                      warmup=0)
    per_10k = restore_s / entries * 10_000
    note(f"{files:>7} files ({entries} entries): save {saved_s:6.2f} s, restore "
         f"{restore_s:6.2f} s, {per_10k:.3f} s per 10k entries")
    shutil.rmtree(into, ignore_errors=True)
    shutil.rmtree(tmp / "work", ignore_errors=True)
    return per_10k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="20000,50000,100000,200000")
    parser.add_argument("--stores", default="file")
    parser.add_argument("--size", type=int, default=64, help="bytes per file")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.files.split(","))
    print(f"{os.cpu_count()} CPUs; taskpoint {taskpoint.__version__}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for store in args.stores.split(","):
        with bench_store(store, "tp-bench-many-") as (url, options, tmp):
            per_10k = [case(url, options, tmp, n, args.size, args.repeat) for n in counts]
            report(f"{store}: restore s per 10k entries, {counts[-1]} / {counts[0]} files",
                   per_10k[-1] / per_10k[0], "<= 1.5")


if __name__ == "__main__":
    main()
