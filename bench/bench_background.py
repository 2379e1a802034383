"""A background save's time from call to commit, against a plain upload (issue #33, section 3).

Run: uv run python bench/bench_background.py [--size-mb 200] [--repeat 6] [--busy 0,3]

Each figure is a fresh Python process (as a restarted job's first saves are), holding
SIZE MB of fp32 state in a torch tensor, writing to one SeaweedFS S3 server on loopback:

- **plain**: ``torch.save`` to a local file, then a boto3 ``upload_file`` of it (the client
  made before the clock starts, as a job makes it once);
- **blocking**: ``torch.save``, then ``Checkpoint.save_sync(path)``;
- **background**: ``torch.save``, then ``Checkpoint.save_sync(path, background=True)`` and
  ``wait()``: from the call to the commit, the taskpoint upload process's start included.
  The time the call blocked is printed too;
- **linked**: the same with ``snapshot="link"``, as the PyTorch adapter and the folder
  mirrors save the files they wrote themselves: a hard link in place of the private copy
  (a file the caller may rewrite in place needs the copy, the default).

The ``Checkpoint`` is made and loaded from (it finds nothing) before the clock starts, as a
job loads its checkpoint before it trains and as plain's client is made first: the load
starts the upload process a background save uses (``Checkpoint.load_sync``), and makes the
S3 client; the save comes :data:`TRAINED_S` seconds later, as a job's first save comes after
some steps. ``--busy N`` runs the three with N busy-looping processes on the machine
as well (a loaded training node: data loaders, a tokenizer): a save that training waits on
runs at normal priority and keeps its pace, and background uploads do too unless
``TASKPOINT_UPLOAD_NICE`` says otherwise. Medians over ``--repeat`` processes. Target: a
background save commits within 1.2x a plain upload's time (quiet machine). Nothing here is
a test; run it alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import boto3_client, s3_server

MODES = ("plain", "blocking", "background", "linked")
TRAINED_S = 3.0
"""Seconds between the load and the first save (a job trains some steps first)."""


def _child(
    mode: str, size_mb: int, url: str, options: dict[str, Any], work: Path
) -> dict[str, float]:
    import taskpoint
    import torch

    state = {"weights": torch.rand(size_mb * 2**20 // 4, generator=torch.Generator().manual_seed(1))}
    path = work / "state.pt"
    if mode == "plain":
        client = boto3_client(options)
        start = time.perf_counter()
        torch.save(state, path)
        client.upload_file(str(path), "bench", f"{url.split('/', 3)[3]}/latest.pt")
        end = time.perf_counter()
        return {"commit_s": end - start, "blocked_s": end - start}
    checkpoint = taskpoint.Checkpoint.at(url, storage_options=options, workdir=work / "spool")
    if checkpoint.load_sync() is not None:  # a job loads before it trains, as plain makes its
        raise SystemExit(f"{url} is not empty")  # client: both before the clock
    time.sleep(TRAINED_S)  # the steps before the first save
    start = time.perf_counter()
    torch.save(state, path)
    if mode == "blocking":
        checkpoint.save_sync(path)
    else:
        checkpoint.save_sync(
            path, background=True, snapshot="link" if mode == "linked" else "copy"
        )
    returned = time.perf_counter()
    checkpoint.wait()
    end = time.perf_counter()
    checkpoint.close()
    return {"commit_s": end - start, "blocked_s": returned - start}


def _busy(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _run(mode: str, size_mb: int, url: str, options: dict[str, Any]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(size_mb), url, json.dumps(options)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--busy", default="0,3", help="busy processes per round, comma-separated")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, size, url, options = args.child
        work = Path(tempfile.mkdtemp(prefix="tp-bench-bg-"))
        try:
            print(json.dumps(_child(mode, int(size), url, json.loads(options), work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)  # the state and its copy: 400 MB a run
        return
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores)", flush=True)
    server = s3_server()
    try:
        for busy in (int(b) for b in args.busy.split(",")):
            stop = multiprocessing.Event()
            workers = [multiprocessing.Process(target=_busy, args=(stop,)) for _ in range(busy)]
            for worker in workers:
                worker.start()
            try:
                figures: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
                for round_ in range(args.repeat):
                    # interleaved, and each round starts one mode further on, so that
                    # neither drift nor a place in the round (after another's upload) favours one
                    for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
                        url = f"s3://bench/bg-{busy}-{round_}-{mode}"
                        figures[mode].append(_run(mode, args.size_mb, url, server.options))
            finally:
                stop.set()
                for worker in workers:
                    worker.join()
            med = {m: statistics.median(f["commit_s"] for f in figures[m]) for m in MODES}
            spread = {m: sorted(round(f["commit_s"], 2) for f in figures[m]) for m in MODES}
            blocked = {
                m: statistics.median(f["blocked_s"] for f in figures[m])
                for m in ("background", "linked")
            }
            print(f"{args.size_mb} MB, {busy} busy processes: call to commit, median of "
                  f"{args.repeat} fresh processes", flush=True)
            for mode in MODES:
                print(f"  {mode:10s} {med[mode]:6.2f} s  {spread[mode]}  "
                      f"{med[mode] / med['plain']:.2f}x plain", flush=True)
            for mode, value in blocked.items():
                print(f"  {mode} call blocked {value:.2f} s (median)", flush=True)
            for mode in ("background", "linked") if busy == 0 else ():
                ratio = med[mode] / med["plain"]
                verdict = "PASS" if ratio <= 1.2 else "MISS"
                print(f"  target {mode} <= 1.2x plain: {ratio:.2f}x {verdict}", flush=True)
    finally:
        server.stop()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
