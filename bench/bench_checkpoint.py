"""Checkpoint save/restore benchmark: taskpoint against raw transfers and the reference.

Run: uv run python bench/bench_checkpoint.py [--sizes 10,200,1000] [--stores file,s3]
                                            [--out bench/results.json]

``s3`` is a SeaweedFS server on loopback (``weed server -s3``, from the dev dependencies),
started by the bench in its own process.

For each store, size (MB of fp32 weights) and shape (one file, or a directory of 8 shards)
it times, in one process and on the same bytes:

- raw: ``fs.put`` / ``fs.get`` of the file or tree;
- reference: the spec's approach, stdlib ``tarfile`` "w:gz" to a temp file + ``put_file``
  (get + extract to restore); files are uploaded as-is;
- taskpoint blocking save and load;
- taskpoint background save: the part that blocks the caller;
- a synthetic training loop (a NumPy matmul per step) saving every few steps in the
  background, against the same loop without saves;
- peak extra RSS (MB above the baseline) during taskpoint's save and restore.

It prints a table of ratios and writes every timing as JSON. Timings are medians of
``--repeat`` runs (the reference, being slow, runs once). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The synthetic loop stands for a training step that keeps one core busy (as the host thread
# of a GPU loop does); set before NumPy loads, or BLAS spreads each matmul over every core and
# any other work on a 2-core machine, the upload included, lands in the step time.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import taskpoint  # noqa: E402
from _common import FreshSaves, make_data, peak_rss, timed  # noqa: E402


@contextlib.contextmanager
def _s3_server() -> Iterator[Any]:
    """SeaweedFS's S3 gateway with the bucket ``bench``, in its own process (so that its
    memory is not counted as ours): the test suite's server, ``tests/_servers.SeaweedS3``.

    A real store, unlike moto, which answers each ranged GET by copying the whole object
    (restores measured moto more than taskpoint)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import _servers

    workdir = Path(tempfile.mkdtemp(prefix="tp-bench-seaweedfs-"))
    server = _servers.SeaweedS3(workdir)
    try:
        server.start()
        server.create_bucket("bench")
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _store(kind: str, tmp: Path, s3: Any) -> tuple[str, dict[str, Any]]:
    if kind == "file":
        return f"file://{tmp / 'store'}", {}
    assert s3 is not None
    return f"s3://bench/{tmp.name}", s3.storage_options()


def _loop_step_time(ckpt: taskpoint.Checkpoint | None, data: Path, steps: int) -> float:
    """Median step time of a matmul loop; saves ``data`` in the background every 5 steps."""
    a = np.random.default_rng(1).standard_normal((384, 384), dtype=np.float32)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        for _ in range(8):
            a = np.tanh(a @ a * 1e-3)
        times.append(time.perf_counter() - started)
        if ckpt is not None and step % 5 == 0:
            ckpt.save_sync(data, background=True)
    if ckpt is not None:
        ckpt.wait()
    return statistics.median(times)


def bench_case(store_kind: str, size_mb: int, shape: str, repeat: int, s3: Any) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    try:
        data = make_data(tmp, size_mb, shape)
        url, options = _store(store_kind, tmp, s3)
        fs, base = fsspec.core.url_to_fs(url, **options)
        if store_kind == "file":
            fs.makedirs(base, exist_ok=True)
        row: dict[str, Any] = {"store": store_kind, "size_mb": size_mb, "shape": shape}

        raw_dst = f"{base}/raw"

        def raw_clean() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(raw_dst, recursive=True)

        if shape == "file":
            row["raw_save"] = timed(lambda: fs.put_file(str(data), raw_dst), repeat, raw_clean)
        else:
            row["raw_save"] = timed(lambda: fs.put(str(data), raw_dst, recursive=True), repeat, raw_clean)
        got = tmp / "raw-got"
        row["raw_load"] = timed(
            lambda: fs.get(raw_dst, str(got), recursive=shape != "file"), repeat,
            lambda: shutil.rmtree(got, ignore_errors=True) if got.is_dir() else got.unlink(missing_ok=True),
        )

        ref_obj = f"{base}/reference.{'bin' if shape == 'file' else 'tar.gz'}"

        def ref_save() -> None:
            if shape == "file":
                fs.put_file(str(data), ref_obj)
                return
            archive = tmp / "reference.tar.gz"
            with tarfile.open(archive, "w:gz") as tar:
                tar.add(data, arcname=".")
            fs.put_file(str(archive), ref_obj)
            archive.unlink()

        def ref_load() -> None:
            local = tmp / "ref-download"
            fs.get_file(ref_obj, str(local))
            if shape != "file":
                with tarfile.open(local, "r:gz") as tar:
                    tar.extractall(tmp / "ref-out", filter="data")
                shutil.rmtree(tmp / "ref-out")
            local.unlink()

        row["ref_save"] = timed(ref_save, 1, warmup=0)  # slow: once
        row["ref_load"] = timed(ref_load, 1, warmup=0)

        # Each save to a new run's URL: format 2 uploads nothing for a tree its run already
        # holds, so saving again to one URL would time a check, not a save.
        saves = FreshSaves(url, options, data, tmp / "restores", name="tp")
        with peak_rss() as save_rss:
            row["tp_save"] = timed(saves.save, repeat)
        row["tp_save_rss_mb"] = save_rss["extra_mb"]
        with peak_rss() as load_rss:
            row["tp_load"] = timed(saves.load, repeat)
        row["tp_load_rss_mb"] = load_rss["extra_mb"]

        background = FreshSaves(url, options, data, tmp / "restores", name="bg")
        row["tp_background_blocked"] = timed(lambda: background.save(background=True), repeat,
                                             background.wait)
        background.wait()
        # The loop saves one run again and again: its first save uploads the data, the
        # later ones find it stored (a training run's saves change at least the weights).
        ckpt = taskpoint.Checkpoint(f"{url}/loop", storage_options=options,
                                    workdir=tmp / "restores")
        if size_mb <= 200:
            row["loop_step"] = _loop_step_time(None, data, 40)
            row["loop_step_saving"] = _loop_step_time(ckpt, data, 40)
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ratios(row: dict[str, Any]) -> dict[str, float]:
    r = {
        "save_vs_reference": row["ref_save"] / row["tp_save"],
        "save_vs_raw": row["tp_save"] / row["raw_save"],
        "load_vs_reference": row["ref_load"] / row["tp_load"],
        "load_vs_raw": row["tp_load"] / row["raw_load"],
        "raw_throughput_save": row["raw_save"] / row["tp_save"],
        "raw_throughput_load": row["raw_load"] / row["tp_load"],
        "background_blocked": row["tp_background_blocked"] / row["tp_save"],
    }
    if "loop_step" in row:
        r["loop_step_slowdown"] = row["loop_step_saving"] / row["loop_step"]
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,200,1000", help="MB per case, comma-separated")
    parser.add_argument("--shapes", default="file,dir")
    parser.add_argument("--stores", default="file,s3")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench/results.json")
    args = parser.parse_args()
    stores = args.stores.split(",")
    unknown = sorted(set(stores) - {"file", "s3"})
    if unknown:
        parser.error(f"--stores takes file and s3; got {', '.join(unknown)}")
    rows = []
    header = (
        f"{'store':<5} {'MB':>5} {'shape':<5} | {'save/ref':>8} {'save:raw':>8} | "
        f"{'load/ref':>8} {'load:raw':>8} | {'bg block':>8} {'loop':>6} | {'rss save':>8} {'rss load':>8}"
    )
    print("ratios: X/ref = reference time / taskpoint time (higher is better); "
          "X:raw = taskpoint time / raw time (lower is better); bg block = blocked / "
          "blocking save; loop = step time while uploading / without; rss in MB")
    print(header)
    print("-" * len(header))
    with contextlib.ExitStack() as servers:
        s3 = servers.enter_context(_s3_server()) if "s3" in stores else None
        for store in stores:
            for size in (int(s) for s in args.sizes.split(",")):
                for shape in args.shapes.split(","):
                    row = bench_case(store, size, shape, args.repeat, s3)
                    row["ratios"] = _ratios(row)
                    rows.append(row)
                    r = row["ratios"]
                    loop = f"{r['loop_step_slowdown']:.2f}" if "loop_step_slowdown" in r else "-"
                    print(
                        f"{store:<5} {size:>5} {shape:<5} | {r['save_vs_reference']:>8.1f} "
                        f"{r['save_vs_raw']:>8.2f} | {r['load_vs_reference']:>8.1f} "
                        f"{r['load_vs_raw']:>8.2f} | {r['background_blocked']:>8.2f} {loop:>6} | "
                        f"{row['tp_save_rss_mb']:>8.0f} {row['tp_load_rss_mb']:>8.0f}",
                        flush=True,
                    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
