"""Restore time against the number of entries of a format-2 tree (issues #24 and #26).

Run: uv run python bench/bench_many_files.py [--files 20000,50000,100000,200000]
                                             [--stores file] [--size 64] [--repeat 1]
                                             [--s3-files 2000] [--s3-mb 1024]
                                             [--skip entries,s3] [--after-delete]

1. Entries: for each count, saves a fresh tree of that many small files (``--size`` bytes
   each, 500 to a folder, all packed into a few objects) and restores it into a new folder,
   then prints the save and restore seconds and the restore seconds per 10k entries. The
   last line compares the largest tree's seconds per 10k entries with the smallest's: a
   restore linear in its entries keeps that ratio near 1 (a quadratic one doubles it with
   every doubling of the tree).
2. Restore at scale: a tree of ``--s3-files`` files of random bytes, ``--s3-mb`` MB in all
   (512 KiB a file with the defaults, 100 to a folder), saved to a SeaweedFS server on
   loopback (moto where the ``weed`` binary cannot run; the output says which) and
   restored into a new folder, against a raw parallel ``fs.get`` (s3fs) of the same files
   uploaded as plain objects into a new folder: the raw get's seconds over taskpoint's
   (a throughput ratio, target >= 0.8).

Case 1 deletes nothing until every count is done: each source tree stays on disk, and
each restore goes to a folder of its own (740k files, 3 GB of disk with the defaults). On
ext4 without a journal (this VM's disk), the kernel skips inodes freed within the last 60
to 360 s when it allocates new ones, rescanning them for every file it creates: creating
20k files right after deleting 20k cost 5 to 8 times more per file than on a quiet disk,
so deleting the source tree of 200k files before restoring it measured the file system,
not the restore. ``--after-delete`` deletes each tree before restoring it (what earlier
runs did), to show that.

Timings are medians of ``--repeat`` restores (case 1 without a warm-up run: the save just
read every file, and a second restore of 200k files would double the run for no more
information; case 2 after one untimed run of each); the load average printed first says
how busy the machine was; nothing here is a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import time
from pathlib import Path

import fsspec
import numpy as np
import taskpoint
from _common import bench_store, note, raw_get_s, report, timed

PER_FOLDER = 500
S3_PER_FOLDER = 100


def make_tree(root: Path, files: int, size: int) -> Path:
    """``files`` files of ``size`` distinct bytes each, ``PER_FOLDER`` to a folder."""
    for i in range(files):
        folder = root / f"d{i // PER_FOLDER:04d}"
        if i % PER_FOLDER == 0:
            folder.mkdir(parents=True)
        (folder / f"f{i:07d}.txt").write_bytes(f"{i:0{size}d}".encode()[:size])
    return root


def case(url: str, options: dict[str, object], tmp: Path, files: int, size: int,
         repeat: int, after_delete: bool) -> float:
    """Save and restore a tree of ``files`` files; the restore's seconds per 10k entries."""
    tree = make_tree(tmp / f"tree-{files}", files, size)
    ckpt = taskpoint.Checkpoint(f"{url}/many-{files}", storage_options=options,
                                workdir=tmp / "work")
    started = time.perf_counter()
    ckpt.save_sync(tree)
    saved_s = time.perf_counter() - started
    if after_delete:
        shutil.rmtree(tree)
    entries = len(ckpt.committed()[0].entries or ())
    runs = itertools.count()

    def restore() -> None:
        into = tmp / f"restored-{files}-{next(runs)}"
        restored = taskpoint.Checkpoint(f"{url}/many-{files}", storage_options=options,
                                        workdir=tmp / "work").load_sync(into=into)
        assert restored == into

    restore_s = timed(restore, repeat, warmup=0)
    per_10k = restore_s / entries * 10_000
    note(f"{files:>7} files ({entries} entries): save {saved_s:6.2f} s, restore "
         f"{restore_s:6.2f} s, {per_10k:.3f} s per 10k entries")
    return per_10k  # the trees stay until every count is done (see the docstring)


def make_random_tree(root: Path, files: int, size_mb: int) -> Path:
    """``files`` files of random bytes, ``size_mb`` MB in all, ``S3_PER_FOLDER`` to a folder."""
    rng = np.random.default_rng(0)
    size = size_mb * 2**20 // files
    for i in range(files):
        folder = root / f"d{i // S3_PER_FOLDER:03d}"
        if i % S3_PER_FOLDER == 0:
            folder.mkdir(parents=True)
        (folder / f"f{i:05d}.bin").write_bytes(rng.bytes(size))
    return root


def s3_case(files: int, size_mb: int, repeat: int) -> None:
    """Restore at scale from SeaweedFS, against a raw parallel get of the same files."""
    with bench_store("s3", "tp-bench-scale-") as (url, options, tmp):
        fs, base = fsspec.core.url_to_fs(url, **options)
        data = make_random_tree(tmp / "tree", files, size_mb)
        raw = f"{base}/raw"
        fs.put(str(data), raw, recursive=True)
        taskpoint.Checkpoint(f"{url}/scale", storage_options=options,
                             workdir=tmp / "work").save_sync(data)
        raw_get = raw_get_s(fs, raw, tmp / "raw-got", repeat)
        into = tmp / "restored"

        def restore() -> None:
            restored = taskpoint.Checkpoint(f"{url}/scale", storage_options=options,
                                            workdir=tmp / "work").load_sync(into=into)
            assert restored == into

        restore_s = timed(restore, repeat, lambda: shutil.rmtree(into, ignore_errors=True))
        report(f"restore {files} files, {size_mb} MB from S3: raw parallel get / taskpoint",
               raw_get / restore_s, ">= 0.8")
        note(f"   (raw get {raw_get:.2f}s, taskpoint {restore_s:.2f}s; "
             f"{size_mb / restore_s:.0f} MB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="20000,50000,100000,200000")
    parser.add_argument("--stores", default="file")
    parser.add_argument("--size", type=int, default=64, help="bytes per file")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--s3-files", type=int, default=2000, help="files of case 2")
    parser.add_argument("--s3-mb", type=int, default=1024, help="MB of case 2's tree")
    parser.add_argument("--skip", default="", help="comma-separated: entries,s3")
    parser.add_argument("--after-delete", action="store_true",
                        help="delete case 1's tree before restoring it")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    counts = sorted(int(n) for n in args.files.split(","))
    print(f"{os.cpu_count()} CPUs; taskpoint {taskpoint.__version__}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if "entries" not in skip:
        for store in args.stores.split(","):
            with bench_store(store, "tp-bench-many-") as (url, options, tmp):
                per_10k = [case(url, options, tmp, n, args.size, args.repeat,
                                args.after_delete) for n in counts]
                report(f"{store}: restore s per 10k entries, {counts[-1]} / {counts[0]} files",
                       per_10k[-1] / per_10k[0], "<= 1.5")
    if "s3" not in skip:
        s3_case(args.s3_files, args.s3_mb, args.repeat)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
