"""Multi-writer commits and restores with each node on its own network link (issue #26).

Issue #20's target, "2 ranks x 250 MB commit <= 1.3x one rank", describes nodes that each
have their own network link. On one machine the writers share its CPUs and loopback, so
``bench_parts.py`` measures the machine. Here each writer is a simulated node: its own
network namespace, joined to the root namespace by a link capped at ``--rate-mbit`` each
way (``tests/_netns.py``: a veth pair per node on a bridge, ``tc`` token-bucket filters),
with a SeaweedFS S3 server listening on the bridge's address. Links, not CPUs, are then
the bottleneck, so N nodes writing N x ``--size-mb`` should take about as long as one
node writing its ``--size-mb``. For 1, 2 and 4 nodes (``--writers``) it reports:

* ``parts``: ``Checkpoint.save_part_sync`` with a ``StoreCoordinator`` (coordination
  through the store, as with no shared disk): commit wall time (the go to the last node
  done) against one node's ``save_sync`` of its share alone (target <= 1.3); then every
  node's ``load_sync(part=rank)`` at once against one node's ``load_sync()`` alone (<= 1.3);
* ``dcp``: ``dcp.save`` through ``TaskpointStorageWriter`` (shards as DTensors, a gloo
  process group across the nodes' links) and ``dcp.load`` through
  ``TaskpointStorageReader``, against the same on one node;
* ``hf``: ``TaskpointTrainerCallback`` on nodes without a shared disk (FSDP-sharded files
  in each node's own ``output_dir``; ``on_save`` to the commit), then
  ``restore_last_checkpoint``, against the same on one node. Its restore brings each
  node the shared files and its own rank's files (the shards' ``.metadata`` shows which
  rank reads which shard file), so each link carries about one node's share.

Each node is a process started with ``ip netns exec`` (imports and data made before the
clock starts; each step starts on a go file); each round writes a fresh location. Besides
each ratio it prints the seconds, how much of its rate the busiest link carried, the CPU
time per GiB the nodes and the server spent, and how busy this machine's CPUs were (all
processes, from /proc/stat). The links are the bottleneck only while the CPUs can carry
what every link carries at once: a step whose links at full rate would need more than
80% of the CPUs (at the CPU time per byte measured) says CPU-BOUND, and its ratio measures
the CPUs again. On 2 CPUs, uploads cost about 30 CPU-s per GiB (SeaweedFS two thirds of
it), so 2 CPUs carry about 65 MiB/s: 4 links at 100 Mbit/s ask for 48. ``file://`` is not
measured: a local store goes through no link.

Needs Linux, root and iproute2 (``ip``, ``tc``); says why and exits 0 (skipped) without
them, and removes the namespaces on every exit (SIGINT, SIGTERM, SIGHUP, an error; after a
SIGKILL the next run removes them). The full run (about 30 minutes on an idle 2-CPU
machine; its SeaweedFS keeps up to 15 GB in /tmp until it stops; on 4 or more CPUs
``--rate-mbit 200``):

    flock /tmp/taskpoint-bench.lock uv run python bench/bench_netns.py \\
        --size-mb 250 --rate-mbit 100 --writers 1,2,4

A quick one: ``--size-mb 50 --repeat 1``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
import _netns
import taskpoint
from _common import Weed, make_data, note, process_stat, report

NODE = Path(__file__).with_name("_netns_node.py")
HANG_S = 900.0
"""Bounds every wait for a node: only a hang reaches it."""
MODES = ("parts", "dcp", "hf")
_PORTS = itertools.count(29511)
"""Node 0's rendezvous port, a new one for each run (no wait for the last one's to close)."""


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _tree_cpu(roots: list[int]) -> dict[int, float]:
    """CPU seconds (user + system, every thread) so far of each process descending from
    ``roots`` (the roots included), by process id."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = process_stat(int(entry.name))
        except OSError:
            continue
    ours = set(roots)
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in stats.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    return {pid: stats[pid][1] for pid in ours if pid in stats}


class Run:
    """One mode on ``world`` nodes: their processes, and the timing of each step."""

    def __init__(self, nodes: _netns.Nodes, server: Weed, scratch: Path, mode: str,
                 world: int, data: list[Path], rounds: int) -> None:
        self.nodes, self.server, self.mode, self.world = nodes, server, mode, world
        self.root = Path(tempfile.mkdtemp(prefix=f"{mode}-{world}-", dir=scratch))
        self.sync = self.root / "sync"
        self.sync.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": _netns.NODE_IFNAME,
               "MASTER_ADDR": nodes.address(0), "MASTER_PORT": str(next(_PORTS)),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "NO_PROXY": nodes.host, "no_proxy": nodes.host}
        self.logs: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(world):
            spec = {"mode": mode, "rank": rank, "world": world,
                    "base": f"s3://bench/{self.root.name}", "options": server.options,
                    "data": str(data[rank]), "work": str(self.root / f"node{rank}"),
                    "sync": str(self.sync), "rounds": rounds}
            path = self.root / f"spec-{rank}.json"
            path.write_text(json.dumps(spec))
            log = self.root / f"node{rank}.log"
            self.logs.append(log)
            with log.open("wb") as out:
                self.procs.append(nodes.popen(
                    rank, [sys.executable, str(NODE), str(path)], stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "GROUP_RANK": str(rank)},
                ))

    def _failed(self, what: str) -> RuntimeError:
        tails = "\n".join(f"--- node {r} ---\n{log.read_text(errors='replace')[-3000:]}"
                          for r, log in enumerate(self.logs))
        return RuntimeError(f"{self.mode} on {self.world} node(s): {what}\n{tails}")

    def step(self, name: str, download: bool) -> dict[str, float]:
        """Release every node into step ``name``; its wall seconds, link and CPU use."""
        deadline = time.monotonic() + HANG_S
        for rank, proc in enumerate(self.procs):
            while not (self.sync / f"ready-{name}-{rank}").exists():
                if proc.poll() is not None:
                    raise self._failed(f"node {rank} exited ({proc.returncode}) before {name}")
                if time.monotonic() > deadline:
                    raise self._failed(f"node {rank} never got ready for {name}")
                time.sleep(0.01)
        links = [self.nodes.link_bytes(r) for r in range(self.world)]
        roots = [p.pid for p in self.procs]
        ours, serving = _tree_cpu(roots), _tree_cpu([self.server.process.pid])
        cpu = _cpu_jiffies()
        go = time.time()
        (self.sync / f"go-{name}").touch()
        ends = []
        for rank, proc in enumerate(self.procs):
            done = self.sync / f"done-{name}-{rank}.json"
            while not done.exists():
                if proc.poll() is not None:
                    raise self._failed(f"node {rank} exited ({proc.returncode}) during {name}")
                if time.monotonic() > deadline:
                    raise self._failed(f"node {rank} never finished {name}")
                time.sleep(0.01)
            record = json.loads(done.read_text())
            if "error" in record:
                raise self._failed(f"node {rank} failed {name}: {record['error']}")
            ends.append(record["end"])
        wall = max(ends) - go
        busy, total = (b - a for a, b in zip(cpu, _cpu_jiffies(), strict=True))
        used = sum(t - ours.get(pid, 0.0) for pid, t in _tree_cpu(roots).items())
        served = sum(t - serving.get(pid, 0.0)
                     for pid, t in _tree_cpu([self.server.process.pid]).items())
        carried = [after[1 if download else 0] - before[1 if download else 0]
                   for before, after in zip(links, (self.nodes.link_bytes(r) for r in range(self.world)), strict=True)]
        rate = self.nodes.rate_mbit * 1e6 / 8
        return {"wall": wall, "link": max(carried) / (rate * wall), "cpu": busy / max(total, 1),
                "bytes": float(max(carried)), "nodes": used, "server": served,
                "total": float(sum(carried))}

    def finish(self) -> None:
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                raise self._failed(f"node {rank} did not exit") from None
            if code != 0:
                raise self._failed(f"node {rank} exited with {code}")
        shutil.rmtree(self.root, ignore_errors=True)


def measure(nodes: _netns.Nodes, server: Weed, scratch: Path, mode: str, world: int,
            data: list[Path], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median figures of ``mode``'s save and load steps on ``world`` nodes."""
    rounds = args.warmup + args.repeat
    run = Run(nodes, server, scratch, mode, world, data, rounds)
    got: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
    for i in range(rounds):
        for kind in ("save", "load"):
            figures = run.step(f"{kind}-{i}", download=kind == "load")
            if i >= args.warmup:
                got[kind].append(figures)
    run.finish()
    return {kind: {key: statistics.median(f[key] for f in runs) for key in runs[0]}
            for kind, runs in got.items()}


CPU_BOUND = 0.8
"""The share of this machine's CPUs past which the nodes' links at full rate would need
more CPU than is there (at the CPU time per byte measured): the figure measures the CPUs."""


def _line(what: str, f: dict[str, float], links: int, rate_mbit: float) -> str:
    """One step's figures; says CPU-BOUND when ``links`` links at ``rate_mbit`` would need
    more than :data:`CPU_BOUND` of this machine's CPUs."""
    cores = os.cpu_count() or 1
    gib = max(f["total"], 1) / 2**30
    per_gib = (f["nodes"] + f["server"]) / gib
    carry = cores / max(per_gib, 1e-9) * 1024  # MiB/s
    asked = links * rate_mbit * 1e6 / 8 / 2**20
    line = (f"{what} {f['wall']:.2f}s; busiest link carried {f['bytes'] / 2**20:.0f} MiB, "
            f"{f['link']:.0%} of its rate; CPU-s per GiB carried: nodes "
            f"{f['nodes'] / gib:.0f}, server {f['server'] / gib:.0f} (so {cores} CPUs carry "
            f"at most {carry:.0f} MiB/s); all CPUs {f['cpu']:.0%} busy")
    if asked > CPU_BOUND * carry:
        line += (f"; CPU-BOUND: {links} link(s) at full rate carry {asked:.0f} MiB/s, more "
                 f"than {CPU_BOUND:.0%} of what the CPUs carry (lower --rate-mbit)")
    elif f["cpu"] >= 0.95:
        line += "; CPUS SATURATED (by other processes too?): the figure may measure them"
    return line


def cases(nodes: _netns.Nodes, server: Weed, scratch: Path, args: argparse.Namespace,
          writers: list[int], modes: list[str]) -> None:
    size = args.size_mb
    print(f"making {max(writers)} x {size} MB of data", flush=True)
    data = []
    for rank in range(max(writers)):  # each node its own bytes, under its own names
        folder = Path(tempfile.mkdtemp(dir=scratch)) / "part"
        folder.mkdir()
        make_data(folder.parent, size, "tree", seed=rank).rename(folder / f"rank-{rank}")
        data.append(folder)
    alone: dict[str, dict[str, float]] | None = None
    if "parts" in modes:
        alone = measure(nodes, server, scratch, "alone", 1, data, args)
        note(_line(f"one node, {size} MB, save_sync:", alone["save"], 1, args.rate_mbit))
        note(_line(f"one node, {size} MB, load_sync:", alone["load"], 1, args.rate_mbit))
    for mode in modes:
        figures = {n: measure(nodes, server, scratch, mode, n, data, args) for n in writers}
        base = alone if mode == "parts" and alone is not None else figures.get(1)
        for n, got in figures.items():
            note(_line(f"{mode}: {n} node(s) x {size} MB, save:", got["save"], n, args.rate_mbit))
            note(_line(f"{mode}: {n} node(s) x {size} MB, load:", got["load"], n, args.rate_mbit))
        if base is None:
            note(f"{mode}: no 1-node figure to compare with (add 1 to --writers)")
            continue
        what = "save_sync alone" if mode == "parts" else "1 node alone"
        for n, got in figures.items():
            if n == 1 and mode != "parts":
                continue
            nodes_ = f"{n} node{'s' if n > 1 else ''}"
            report(f"{mode}: {nodes_} x {size} MB commit / {what}",
                   got["save"]["wall"] / base["save"]["wall"], "<= 1.3")
            restore = "its ranks' files" if mode == "hf" else "own part"
            report(f"{mode}: {nodes_} restore {restore} at once / 1 node alone",
                   got["load"]["wall"] / base["load"]["wall"], "<= 1.3")


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=250, help="each node's share (MiB)")
    parser.add_argument("--rate-mbit", type=float, default=100.0,
                        help="each node's link, each way (Mbit/s)")
    parser.add_argument("--writers", default="1,2,4", help="node counts to measure")
    parser.add_argument("--modes", default=",".join(MODES), help="of: parts, dcp, hf")
    parser.add_argument("--repeat", type=int, default=2, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_args()
    writers = sorted({int(n) for n in args.writers.split(",")})
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not writers or min(writers) < 1:
        parser.error(f"unknown modes {unknown}" if unknown else "--writers: counts from 1")
    reason = _netns.why_unavailable()
    if reason is not None:
        print(f"SKIPPED: simulated nodes need network namespaces: {reason}", flush=True)
        return 0
    # Every way out unwinds through the clean-up below. A signal this process was started
    # ignoring (nohup's SIGHUP, a background job's SIGINT) stays ignored.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                          else _interrupted)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"{os.cpu_count()} CPUs, load {' '.join(load)}; taskpoint {taskpoint.__version__}; "
          f"{max(writers)} nodes, each link {args.rate_mbit:g} Mbit/s each way; "
          f"{args.size_mb} MB per node", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="tp-bench-netns-"))
    try:
        try:
            nodes = _netns.Nodes(max(writers), args.rate_mbit)
        except _netns.NetnsUnavailable as exc:
            print(f"SKIPPED: cannot create network namespaces here: {exc}", flush=True)
            return 0
        with nodes:
            server = Weed(host=nodes.host, volumes=0)
            try:
                print(f"store s3:// (SeaweedFS on {nodes.host}, outside every node's link)",
                      flush=True)
                cases(nodes, server, scratch, args, writers, modes)
            finally:
                server.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open("/proc/loadavg") as fh:
        print(f"load at the end: {' '.join(fh.read().split()[:3])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
