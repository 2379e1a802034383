"""What an upload costs the machine: CPU seconds of a tree save against boto3's upload_file.

Run: flock /tmp/taskpoint-bench.lock uv run python bench/bench_upload_cpu.py [--size-mb 200]
                                                                          [--repeat 6]

On a node whose CPU is busy, an upload's own CPU is what it takes from training, and on a
small machine with the store beside it (this 2-core VM, SeaweedFS on loopback) it is also
what the upload waits for: client and server together keep both cores busy, so every
second of the client's CPU saved is about half a second of wall time.

In one process, on the same fresh bytes (fp32 normal samples: weights, incompressible), in
turn: boto3's ``upload_file`` of the file (the client made first), then
``Checkpoint.save_sync`` of the folder holding it (format 2: content-defined chunks, packed
into 8 MiB objects, uploaded by eight threads). For each it takes the wall time, this
process's CPU seconds (user + system, every thread) and the server's. A fresh file each
round, so nothing is reused. Prints medians over ``--repeat`` rounds (the first round's
warm-up aside) and the ratios. Nothing here is a test; run it alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import Weed, boto3_client, note, process_stat, report


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(run: Callable[[], object], server: int) -> tuple[float, float, float]:
    cpu, served, start = _cpu_s(), process_stat(server)[1], time.perf_counter()
    run()
    wall = time.perf_counter() - start
    return wall, _cpu_s() - cpu, process_stat(server)[1] - served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores)", flush=True)

    import taskpoint

    weed = Weed(volumes=0)
    try:
        options = weed.options
        client = boto3_client(options)
        checkpoint = taskpoint.Checkpoint(
            "s3://bench/upload-cpu", storage_options=options, keep=1,
            background_upload="thread",
        )
        checkpoint.load_sync()  # the client made and the store opened, as boto3's
        folder = Path(tempfile.mkdtemp(prefix="tp-bench-cpu-")) / "state"
        folder.mkdir()
        state = folder / "state.bin"
        rng = np.random.default_rng(0)
        rows: dict[str, list[tuple[float, float, float]]] = {"boto3": [], "taskpoint": []}
        for round_ in range(args.repeat + 1):
            state.write_bytes(
                rng.standard_normal(args.size_mb * 2**20 // 4, dtype=np.float32).tobytes()
            )
            boto = _measure(
                lambda: client.upload_file(str(state), "bench", "plain/state.bin"),
                weed.process.pid,
            )
            ours = _measure(lambda: checkpoint.save_sync(folder), weed.process.pid)
            if round_:  # the first is a warm-up: imports, connections, the server's files
                rows["boto3"].append(boto)
                rows["taskpoint"].append(ours)
        checkpoint.close()
    finally:
        weed.stop()

    medians = {
        side: [statistics.median(row[i] for row in figures) for i in range(3)]
        for side, figures in rows.items()
    }
    for side, (wall, cpu, served) in medians.items():
        note(f"{side:<9} {args.size_mb} MB: wall {wall:.2f} s, client CPU {cpu:.2f} s, "
             f"server CPU {served:.2f} s (median of {args.repeat})")
    (b_wall, b_cpu, b_served), (t_wall, t_cpu, t_served) = medians["boto3"], medians["taskpoint"]
    note(f"client CPU, taskpoint / boto3: {t_cpu / b_cpu:.2f}; "
         f"server CPU: {t_served / b_served:.2f}")
    report("wall time, taskpoint save_sync / boto3 upload_file", t_wall / b_wall, "<= 1.2")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
