"""Checkpoints on real object-store servers (S3, Azure Blob, GCS) under real network faults.

S3 runs twice: on moto and on SeaweedFS. The servers run on loopback (see
``tests/_servers.py``); faults are injected by a proxy
between the client libraries and the server, or by killing the server process. The
behaviour tests shared with file:// and memory:// live in ``test_checkpoint.py`` and the
others, through the ``store_url`` fixture.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _servers
import pytest
from taskpoint import Checkpoint, CheckpointStoreError, RetryPolicy
from taskpoint.format import _tree_save
from taskpoint.store import _s3sign, transfer

BUCKET = "taskpoint-tests"
MiB = 2**20
FAST = RetryPolicy(attempts=4, initial=0.05, maximum=0.2)
TIMEOUT = 2  # seconds a client waits for a response in these tests

SERVER_KINDS = [
    kind
    for kind in ("s3", "seaweedfs", "azure", "gcs")
    if kind in (os.environ.get("TASKPOINT_TEST_STORES") or ",".join(_servers.SERVERS)).split(",")
]


def fast_client(kind: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    """Client options that leave retrying to taskpoint and give up on silence quickly."""
    if kind == "s3":
        return {
            "config_kwargs": {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": timeout,
            }
        }
    if kind == "azure":
        return {"read_timeout": timeout, "connection_timeout": 5}
    return {"requests_timeout": timeout}


@pytest.fixture(params=SERVER_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Each object-store server kind (``s3`` is moto, ``seaweedfs`` SeaweedFS)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def server(store_kind: str, request: pytest.FixtureRequest) -> _servers.ObjectServer:
    """The session's server of each object-store kind."""
    return request.getfixturevalue(_servers.SERVER_FIXTURES[store_kind])  # type: ignore[no-any-return]


@pytest.fixture
def kind(server: _servers.ObjectServer) -> str:
    """The client library's flavour: ``s3`` (moto and SeaweedFS alike), ``azure`` or ``gcs``."""
    return {"s3": "s3", "az": "azure", "gs": "gcs"}[server.scheme]


@pytest.fixture
def proxy(server: _servers.ObjectServer) -> Iterator[_servers.FaultProxy]:
    with _servers.FaultProxy(server, hang=15) as p:
        yield p


@pytest.fixture
def url(server: _servers.ObjectServer) -> str:
    return server.url(BUCKET, uuid.uuid4().hex)


def through(proxy: _servers.FaultProxy, kind: str, url: str, **options: Any) -> Checkpoint:
    options.setdefault("retry", FAST)
    return Checkpoint(url, storage_options=proxy.storage_options(**fast_client(kind)), **options)


def direct(server: _servers.ObjectServer, url: str) -> Checkpoint:
    return Checkpoint(url, storage_options=server.storage_options(), retry=FAST)


def uploads(kind: str) -> dict[str, Any]:
    """A proxy match for payload uploads (GCS names small objects in the body, not the URL)."""
    if kind == "gcs":
        return {"path": "/upload/storage/"}
    return {"path": ".payload", "method": "PUT"}


def downloads(kind: str) -> dict[str, Any]:
    return {"path": ".payload", "method": "GET"}


def read(path: Path | None) -> bytes:
    assert path is not None, "expected a checkpoint, got None"
    return path.read_bytes()


# -- transient faults ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["500", "503", "throttle", "reset", "timeout"])
def test_transient_faults_on_upload_and_download_are_retried(
    proxy: _servers.FaultProxy, kind: str, url: str, fault: str
) -> None:
    # Two faults in a row where a retry costs little; gcsfs waits 1-2 s before each retry.
    times = 1 if fault == "timeout" or kind == "gcs" else 2
    ckpt = through(proxy, kind, url)
    ckpt.save_sync(b"before")
    proxy.inject(fault, times=times, **uploads(kind))
    ckpt.save_sync(b"survives the fault")
    assert [k for k, _, _ in proxy.injected] == [fault] * times

    proxy.inject(fault, times=times, **downloads(kind))
    assert read(through(proxy, kind, url).load_sync()) == b"survives the fault"
    assert [k for k, _, _ in proxy.injected] == [fault] * times * 2


def test_connection_reset_mid_part_upload_is_retried(
    proxy: _servers.FaultProxy, kind: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection dies part-way through a part's body, three times in a row."""
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    data = os.urandom(11 * MiB)
    ckpt = through(proxy, kind, url, retry=RetryPolicy(attempts=6, initial=0.05, maximum=0.2))
    times = 1 if kind == "gcs" else 3  # gcsfs waits 1-2 s before retrying a reset itself
    proxy.inject("reset-body", times=times, min_body=MiB, after=512 * 1024, **uploads(kind))
    ckpt.save_sync(data)
    assert len(proxy.injected) == times
    assert read(direct(proxy.server, url).load_sync()) == data


# -- persistent faults --------------------------------------------------------------------

# gcsfs retries 5xx on its own for about 30 s before giving up, so GCS shows a persistent
# fault with a server that never answers (gcsfs leaves timeouts to its caller).
PERSISTENT = {"s3": "503", "azure": "503", "gcs": "timeout"}
CAUSE = {"503": r"503|ServiceUnavailable|ServerBusy|unable to", "timeout": r"[Tt]ime"}


def test_persistent_fault_raises_store_error_naming_url_and_cause(
    proxy: _servers.FaultProxy, kind: str, url: str
) -> None:
    fault = PERSISTENT[kind]
    ckpt = through(proxy, kind, url, retry=RetryPolicy(attempts=2, initial=0.05))
    ckpt.save_sync(b"committed")

    proxy.inject(fault, times=10_000, **uploads(kind))
    with pytest.raises(CheckpointStoreError, match=CAUSE[fault]) as saving:
        ckpt.save_sync(b"never committed")
    assert url in str(saving.value) and saving.value.url.startswith(url)

    proxy.clear()
    proxy.inject(fault, times=10_000, **downloads(kind))
    with pytest.raises(CheckpointStoreError, match=CAUSE[fault]) as loading:
        through(proxy, kind, url, retry=RetryPolicy(attempts=2, initial=0.05)).load_sync()
    assert url in str(loading.value)

    proxy.clear()
    assert read(through(proxy, kind, url).load_sync()) == b"committed"


# A store that takes the request and never answers (as behind a silent network): the
# clients' own timeouts do not cover the wait for "100 Continue" or for a full socket
# buffer, so only taskpoint's stall timeout ends it. The proxy hangs far longer than the
# budget allows, and the clients keep their default settings.
SILENT = RetryPolicy(attempts=2, initial=0.1, maximum=0.1, stall_timeout=1.0)
SILENT_MARGIN_S = 8.0


@pytest.mark.parametrize("size", [1024, 11 * MiB], ids=["one-put", "multipart"])
def test_a_store_that_never_answers_fails_within_the_retry_budget(
    server: _servers.ObjectServer, kind: str, url: str, size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    allowed = SILENT.budget() + SILENT_MARGIN_S
    with _servers.FaultProxy(server, hang=60) as proxy:
        ckpt = Checkpoint(url, storage_options=proxy.storage_options(), retry=SILENT)
        ckpt.save_sync(b"committed")

        proxy.inject("timeout", times=10_000, **uploads(kind))
        started = time.monotonic()
        with pytest.raises(CheckpointStoreError, match=r"after 2 tries over .* s") as saving:
            ckpt.save_sync(os.urandom(size))
        assert time.monotonic() - started < allowed, saving.value
        assert "no bytes moved for 1 s" in str(saving.value)

        proxy.clear()
        proxy.inject("timeout", times=10_000, **downloads(kind))
        started = time.monotonic()
        with pytest.raises(CheckpointStoreError, match="no bytes moved"):
            Checkpoint(url, storage_options=proxy.storage_options(), retry=SILENT).load_sync()
        assert time.monotonic() - started < allowed

        proxy.clear()
        assert read(ckpt.load_sync()) == b"committed"


def test_an_unreachable_store_is_an_error_not_no_checkpoint(
    server: _servers.ObjectServer, kind: str, url: str
) -> None:
    if kind == "gcs":
        pytest.skip(
            "gcsfs retries a refused connection for ~30 s on its own; GCS shows a "
            "persistent fault with test_persistent_fault_raises_store_error_naming_url_and_cause"
        )
    dead = f"http://127.0.0.1:{_servers.free_port()}"
    options = server.storage_options(dead, **fast_client(kind))
    ckpt = Checkpoint(url, storage_options=options, retry=RetryPolicy(attempts=2, initial=0.01))
    with pytest.raises(CheckpointStoreError, match=url):
        ckpt.load_sync()


# -- configuration errors -----------------------------------------------------------------


def test_missing_bucket_is_one_clear_error_and_is_not_created(
    server: _servers.ObjectServer, kind: str
) -> None:
    missing = f"absent-{uuid.uuid4().hex[:12]}"
    url = server.url(missing, "job")
    with pytest.raises(CheckpointStoreError, match=f"bucket '{missing}' does not exist"):
        Checkpoint(url, storage_options=server.storage_options(), retry=FAST).load_sync()
    with pytest.raises(CheckpointStoreError, match=f"bucket '{missing}' does not exist"):
        Checkpoint(url, storage_options=server.storage_options(), retry=FAST).save_sync(b"x")
    assert not server.filesystem().exists(missing)


def wrong_credentials(server: _servers.ObjectServer, tmp_path: Path) -> dict[str, Any]:
    if server.scheme == "s3":
        return server.storage_options(key="AKIAWRONGWRONGWRONG0", secret="not-the-secret")
    if server.scheme == "az":
        other_key = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3Jvbmc="
        return {"connection_string": _servers.Azurite.connection_string(server, key=other_key)}  # type: ignore[arg-type]
    # The emulator checks no credentials: a credentials file that is not there.
    return server.storage_options(token=str(tmp_path / "missing-service-account.json"))


def test_wrong_credentials_are_one_clear_error(
    server: _servers.ObjectServer, url: str, tmp_path: Path
) -> None:
    options = wrong_credentials(server, tmp_path)
    ckpt = Checkpoint(url, storage_options=options, retry=FAST)  # constructing does no I/O
    with pytest.raises(CheckpointStoreError, match=url) as loading:
        ckpt.load_sync()
    with pytest.raises(CheckpointStoreError, match=url):
        Checkpoint(url, storage_options=options, retry=FAST).save_sync(b"x")
    if server.scheme != "gs":
        assert "credentials" in str(loading.value)


# -- multipart uploads --------------------------------------------------------------------


def part_requests(kind: str, proxy: _servers.FaultProxy) -> list[str]:
    marker = {"s3": "partNumber=", "azure": "comp=block&", "gcs": "upload_id="}[kind]
    return [target for method, target in proxy.requests if method in ("PUT", "POST") and marker in target]


def test_large_objects_upload_in_parts_and_round_trip(
    proxy: _servers.FaultProxy, kind: str, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(16 * MiB))
    tree = tmp_path / "run"
    (tree / "shards").mkdir(parents=True)
    (tree / "shards" / "a.bin").write_bytes(os.urandom(12 * MiB))
    ckpt = through(proxy, kind, url, keep=2, store_format=1)

    ckpt.save_sync(big)
    assert len(part_requests(kind, proxy)) >= 3, proxy.requests
    assert read(direct(proxy.server, url).load_sync()) == big.read_bytes()

    proxy.requests.clear()
    ckpt.save_sync(tree)  # format 1: one tar archive, uploaded in parts
    assert len(part_requests(kind, proxy)) >= 2, proxy.requests
    restored = direct(proxy.server, url).load_sync()
    assert restored is not None
    assert (restored / "shards" / "a.bin").read_bytes() == (tree / "shards" / "a.bin").read_bytes()

    # Format 2: the large file is cut into content-defined chunks, which go up packed, in
    # order, into objects of about PACK_SIZE (8 MiB): 12 MiB makes at least two.
    proxy.requests.clear()
    through(proxy, kind, url, keep=1).save_sync(tree)  # keep=1: its own commit, no re-reads
    objects = {
        t.split("?")[0].rsplit("/", 1)[-1]
        for m, t in proxy.requests if m in ("PUT", "POST") and "objects" in t
    }
    if kind != "gcs":  # GCS names small objects in the request body, not the URL
        assert len(objects) >= 12 * MiB // _tree_save.PACK_SIZE, proxy.requests
    (manifest,) = direct(proxy.server, url).committed()
    (entry,) = [e for e in manifest.entries or () if e.path == "shards/a.bin"]
    assert len(entry.blobs) >= 6  # chunks of about 512 KiB
    assert len({blob.object for blob in entry.blobs}) >= 12 * MiB // _tree_save.PACK_SIZE
    restored = direct(proxy.server, url).load_sync()
    assert restored is not None
    assert (restored / "shards" / "a.bin").read_bytes() == (tree / "shards" / "a.bin").read_bytes()


@pytest.mark.parametrize("store_kind", [k for k in SERVER_KINDS if k in ("s3", "seaweedfs")])
@pytest.mark.parametrize(
    ("config", "extra", "header"),
    [
        ({}, {}, "x-amz-checksum-crc32"),  # botocore's default, computed off the event loop
        ({"request_checksum_calculation": "when_required"}, {}, None),  # stores that refuse it
        ({}, {"ChecksumAlgorithm": "SHA256"}, "x-amz-checksum-sha256"),  # the user's choice
    ],
    ids=["default", "when_required", "sha256"],
)
def test_uploads_carry_the_checksum_the_client_is_configured_for(
    proxy: _servers.FaultProxy, kind: str, url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], extra: dict[str, Any],
    header: str | None,
) -> None:
    """Every part and single PUT carries exactly the checksum botocore's settings call for
    (SeaweedFS checks it, so a wrong CRC32 fails the save); never one a client configured
    not to send checksums did not ask for, and never two."""
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(11 * MiB))
    options = proxy.storage_options(config_kwargs=config, s3_additional_kwargs=extra)
    ckpt = Checkpoint(url, storage_options=options, retry=FAST, store_format=1)
    ckpt.save_sync(big)
    ckpt.save_sync(b"one small PUT")
    puts = [h for m, t, h in proxy.headers if m == "PUT" and ".payload" in t]
    assert len(puts) >= 4, proxy.requests  # 3 parts and a single PUT
    for headers in puts:
        sent = sorted(name for name in headers if name.startswith("x-amz-checksum-"))
        assert sent == ([header] if header else []), headers
    assert read(direct(proxy.server, url).load_sync()) == b"one small PUT"


@pytest.mark.parametrize("store_kind", [k for k in SERVER_KINDS if k in ("s3", "seaweedfs")])
def test_an_upload_signs_its_payload_hash_without_reading_the_body_twice(
    proxy: _servers.FaultProxy, kind: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over http botocore signs every body's SHA-256. taskpoint computes it on the worker
    thread that computes the part's CRC32, not the event loop: the body is read once, to be
    sent, where botocore read it a second time on the loop to hash it; and it is read on
    the loop, chunk by chunk, not through aiohttp's thread pool. SeaweedFS checks the hash
    against the bytes, so a wrong one fails the save."""
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    taken = [0]  # bytes read from request bodies
    off_loop = [0]  # reads made where no event loop runs: aiohttp's thread pool
    real_read, real_readinto = transfer._Body.read, transfer._Body.readinto

    def counted_read(self: Any, size: int | None = -1) -> bytes:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            off_loop[0] += 1
        out = real_read(self, size)
        taken[0] += len(out)
        return out

    def counted_readinto(self: Any, buffer: Any) -> int:
        count = real_readinto(self, buffer)
        taken[0] += count or 0
        return count

    monkeypatch.setattr(transfer._Body, "read", counted_read)
    monkeypatch.setattr(transfer._Body, "readinto", counted_readinto)
    data = os.urandom(11 * MiB)
    ckpt = Checkpoint(url, storage_options=proxy.storage_options(), retry=FAST, store_format=1)
    ckpt.save_sync(data)
    puts = [h for m, _t, h in proxy.headers if m == "PUT"]
    assert len(puts) >= 3, proxy.requests  # the parts, the manifest
    for headers in puts:
        assert len(headers["x-amz-content-sha256"]) == 64, headers  # hex: the payload signed
    sent = sum(int(h["content-length"]) for h in puts)  # the records' PUTs among them
    assert len(data) <= taken[0] <= sent, "a body read again to hash it on the event loop"
    assert off_loop[0] == 0, "bodies read through aiohttp's thread pool, a round trip per chunk"
    assert read(direct(proxy.server, url).load_sync()) == data

    if kind == "seaweedfs":  # it checks the signed hash against the body
        wrong, real_digests = "0" * 64, _s3sign.digests
        monkeypatch.setattr(
            _s3sign, "digests",
            lambda data, *, crc32, sha256: (
                real_digests(data, crc32=crc32, sha256=False)[0], wrong if sha256 else None
            ),
        )
        with pytest.raises(CheckpointStoreError):
            Checkpoint(url, storage_options=proxy.storage_options(), retry=FAST).save_sync(
                b"signed with a hash of other bytes"
            )


def test_the_digests_are_s3s_crc32_and_sigv4s_sha256_of_the_bytes() -> None:
    data = os.urandom(3 * MiB + 7)
    view = memoryview(bytearray(data))[5:]
    for body in (data, view):
        crc, sha = _s3sign.digests(body, crc32=True, sha256=True)
        assert crc == base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        assert sha == hashlib.sha256(body).hexdigest()
    assert _s3sign.digests(data, crc32=False, sha256=False) == (None, None)


class _Ticks:
    def __init__(self) -> None:
        self.count = 0

    def tick(self) -> None:
        self.count += 1


def test_a_request_body_reads_its_bytes_in_place_and_behaves_as_a_stream() -> None:
    """aiohttp sends a ``BytesIO`` from its loop; the body is one over ``data`` itself.
    Each read ticks the progress and copies out only what it returns; seeks and views
    behave as a ``BytesIO``'s, and releasing a view taken of it leaves the body whole."""
    buffer = bytearray(b"0123456789")
    ticks = _Ticks()
    body = transfer._Body(memoryview(buffer)[2:], ticks)  # type: ignore[arg-type]
    assert isinstance(body, io.BytesIO)
    with body.getbuffer() as view:  # aiohttp sizes a BytesIO so, and releases the view
        assert len(view) == 8
    assert body.read(3) == b"234" and body.tell() == 3
    buffer[5] = ord("x")  # read in place: no copy was taken at the start
    assert body.read() == b"x6789" and body.read() == b""
    assert ticks.count == 3
    assert body.seek(-2, io.SEEK_END) == 6 and body.read(10) == b"89"
    assert body.seek(1) == 1 and body.seek(2, io.SEEK_CUR) == 3
    out = bytearray(4)
    assert body.readinto(out) == 4 and out == b"x678"
    assert body.getvalue() == b"234x6789"
    with pytest.raises(ValueError, match="negative seek"):
        body.seek(-1)
    with pytest.raises(ValueError, match="whence"):
        body.seek(0, 3)
    with pytest.raises(io.UnsupportedOperation, match="read-only"):
        body.write(b"no")
    assert bytes(buffer[2:]) == b"234x6789"


def orphans(server: _servers.ObjectServer, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    if isinstance(server, _servers.S3Server):
        return server.multipart_uploads(BUCKET, prefix)
    if isinstance(server, _servers.Azurite):
        return server.uncommitted_blobs(BUCKET, prefix)
    return []  # GCS resumable sessions cannot be listed; they expire after a week


def test_interrupted_upload_leaves_no_checkpoint_and_no_orphan_after_next_save(
    proxy: _servers.FaultProxy, kind: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    # GCS's fault is a silence, which only taskpoint's stall timeout ends (gcsfs retries
    # it unseen): a 5 s one, not the default 30 s, ends each of the two tries.
    stall = 5.0 if kind == "gcs" else None
    ckpt = through(proxy, kind, url, retry=RetryPolicy(attempts=2, initial=0.05, stall_timeout=stall))
    ckpt.save_sync(b"small and committed")

    # After the first part, part uploads die part-way (GCS: go unanswered, as gcsfs would
    # retry resets for half a minute), and so does every clean-up call the client makes.
    fault = "timeout" if kind == "gcs" else "reset-body"
    proxy.inject(fault, times=10_000, skip=1, min_body=MiB, after=256 * 1024, **uploads(kind))
    if kind != "gcs":  # (GCS sessions cannot be listed; gcsfs retries resets for 30 s)
        proxy.inject("reset", times=10_000, method="DELETE")
    with pytest.raises(CheckpointStoreError):
        ckpt.save_sync(os.urandom(12 * MiB))
    proxy.clear()

    reader = direct(proxy.server, url)
    assert [m.size for m in reader.committed()] == [len(b"small and committed")]
    assert read(reader.load_sync()) == b"small and committed"
    if kind != "gcs":
        assert orphans(proxy.server, url), "the interrupted upload should have left parts behind"

    data = os.urandom(11 * MiB)
    ckpt.save_sync(data)
    assert read(direct(proxy.server, url).load_sync()) == data
    assert orphans(proxy.server, url) == []


# -- zombies ------------------------------------------------------------------------------


def test_held_zombie_upload_never_overwrites_the_newer_attempt(
    proxy: _servers.FaultProxy, kind: str, url: str
) -> None:
    """Attempt 0 loses the network mid-save; attempt 1 starts and commits; then 0 returns."""
    zombie = Checkpoint(url, storage_options=proxy.storage_options(), retry=FAST)
    zombie.save_sync(b"zombie-0")
    hold = proxy.inject("hold", after=0, **uploads(kind))
    errors: list[BaseException] = []

    def late_save() -> None:
        try:
            zombie.save_sync(b"zombie-1")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=late_save)
    thread.start()
    assert hold.hit.wait(30), "the zombie's upload never reached the proxy"

    newer = direct(proxy.server, url)
    assert read(newer.load_sync()) == b"zombie-0"
    newer.save_sync(b"newer-0")
    assert newer.attempt == 1 and zombie.attempt == 0

    proxy.release()
    thread.join(60)
    assert not errors, errors
    assert read(direct(proxy.server, url).load_sync()) == b"newer-0"
    newer.save_sync(b"newer-1")
    zombie.save_sync(b"zombie-2")
    assert read(direct(proxy.server, url).load_sync()) == b"newer-1"
    assert direct(proxy.server, url).committed()[0].attempt == 1


# -- the server killed mid-upload ---------------------------------------------------------


@pytest.fixture
def own_server(store_kind: str, tmp_path: Path) -> Iterator[_servers.ObjectServer]:
    """A server of this test's own whose data survives a kill: on disk (SeaweedFS,
    Azurite, the GCS emulator) or in moto's replayed record of requests."""
    try:
        server = _servers.start_server(store_kind, tmp_path / "server", persistent=True)
    except _servers.ServerUnavailable as exc:
        _servers.unavailable(store_kind, str(exc))()
        raise
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


def test_server_killed_mid_upload_then_restarted(
    own_server: _servers.ObjectServer, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(5 * MiB))
    url = own_server.url(BUCKET, "job")
    data = os.urandom(12 * MiB)
    with _servers.FaultProxy(own_server) as proxy:
        ckpt = Checkpoint(
            url,
            storage_options=proxy.storage_options(**fast_client(kind, timeout=20)),
            retry=RetryPolicy(attempts=15, initial=0.2, maximum=1.0),
        )
        ckpt.save_sync(b"previous")
        if isinstance(own_server, _servers.Azurite):
            own_server.wait_persisted("000000-000000000.manifest.json")
        hold = proxy.inject("hold", min_body=MiB, after=MiB, **uploads(kind))
        errors: list[BaseException] = []

        def save() -> None:
            try:
                ckpt.save_sync(data)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=save)
        thread.start()
        assert hold.hit.wait(60), "the upload never reached the proxy"
        proxy.down()  # until the server is back, the client finds nothing there
        own_server.kill()
        own_server.restart()

        # Before the upload is retried: the previous checkpoint is intact and loadable.
        reader = direct(own_server, url)
        assert [m.size for m in reader.committed()] == [len(b"previous")]
        assert read(reader.load_sync()) == b"previous"

        proxy.up()
        proxy.release()
        thread.join(120)
        assert not thread.is_alive() and not errors, errors

    assert read(direct(own_server, url).load_sync()) == data
    assert orphans(own_server, url.rsplit("/", 1)[0] + "/job") == []


def test_zombie_saving_concurrently_never_overwrites_the_newer_attempt(store_url: str) -> None:
    """Both attempts save at once, over and over; the newer one's state always wins."""
    zombie = Checkpoint(store_url, retry=FAST)
    zombie.save_sync(b"zombie-start")
    newer = Checkpoint(store_url, retry=FAST)
    newer.save_sync(b"newer-0")
    assert (zombie.attempt, newer.attempt) == (0, 1)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(ckpt: Checkpoint, name: str) -> None:
        try:
            barrier.wait(10)
            for i in range(1, 6):
                ckpt.save_sync(f"{name}-{i}".encode())
                newest = Checkpoint(store_url).load_sync()
                assert newest is not None and newest.read_bytes().startswith(b"newer-"), newest
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, n)) for c, n in ((zombie, "zombie"), (newer, "newer"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert read(Checkpoint(store_url).load_sync()) == b"newer-5"
    assert [m.attempt for m in Checkpoint(store_url).committed()] == [1]
