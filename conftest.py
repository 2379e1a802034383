"""Fixtures shared by the core tests and every adapter's tests.

``store_url`` runs a test against each store kind: ``file``, ``memory`` and four real
object-store servers on loopback ports (``s3``: moto; ``seaweedfs``: SeaweedFS, a second
S3 server that keeps its data on disk; ``azure``: Azurite; ``gcs``: a GCS emulator; see
``tests/_servers.py``). Each server starts once per session, when a test first needs it,
and the backends find it the usual way, through the environment (``AWS_*``,
``AZURE_STORAGE_CONNECTION_STRING``, ``STORAGE_EMULATOR_HOST``), which a test's server
fixture sets for that test alone. Both S3 kinds use ``s3://`` URLs; a test runs against one
of them at a time.

``TASKPOINT_TEST_STORES`` (comma-separated kinds: ``file``, ``memory``, ``s3``,
``seaweedfs``, ``azure``, ``gcs``) narrows the list for a quick local run, e.g.
``TASKPOINT_TEST_STORES=file,memory`` or ``TASKPOINT_TEST_STORES=seaweedfs``. With ``CI=true`` a server that cannot start
fails the run; elsewhere its tests are skipped with the reason. Azurite, the one server that
is not a Python dependency, is installed with npm into ``.ci/node`` the first time a test
needs it (once, whatever the number of workers); without npm the Azure tests say how to get
it.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set before any storage backend is imported. Nothing may reach a cloud metadata service
# (they are not on loopback): point Google's at a closed loopback port and turn AWS's off.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")
os.environ.setdefault("NO_GCE_CHECK", "true")
# gcsfs >= 2025.10 probes each bucket's layout over gRPC, which emulators do not serve
# (and waits 60 s for an answer); the JSON API is all taskpoint needs.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
import _servers
from hypothesis import HealthCheck, settings

# Hypothesis (tests/test_properties.py). "ci", the default, tries the same examples on every
# run (derandomize, no example database), so a run cannot fail on a draw the last one never
# made; deadlines are off because saves and loads touch the disk and times vary on shared
# runners. "explore" (HYPOTHESIS_PROFILE=explore) draws fresh examples and keeps failing ones
# in .hypothesis/ for a local hunt.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

STORE_KINDS = ("file", "memory", "s3", "seaweedfs", "azure", "gcs")
TEST_BUCKET = "taskpoint-tests"


def _selected_stores() -> list[str]:
    raw = os.environ.get("TASKPOINT_TEST_STORES", "").strip()
    if not raw:
        return list(STORE_KINDS)
    kinds = [k.strip() for k in raw.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(STORE_KINDS))
    if unknown:
        raise pytest.UsageError(
            f"TASKPOINT_TEST_STORES names unknown stores {unknown}; known: {', '.join(STORE_KINDS)}"
        )
    return kinds


def _object_server(kind: str, factory: pytest.TempPathFactory) -> Iterator[_servers.ObjectServer]:
    try:
        server = _servers.start_server(kind, factory.mktemp(f"{kind}-server"))
    except _servers.ServerUnavailable as exc:
        _servers.unavailable(kind, str(exc))()
        raise  # unreachable: the line above fails or skips
    try:
        server.create_bucket(TEST_BUCKET)
        yield server
    finally:
        server.stop()


def _clear_backend_instances() -> None:
    """Forget the cached fsspec instances of the object-store backends: each one read its
    endpoint and credentials from the environment when it was made."""
    import fsspec

    for protocol in ("s3", "gs", "az", "abfs"):
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError):
            continue
        cls.clear_instance_cache()


def _activate(server: _servers.ObjectServer) -> Iterator[_servers.ObjectServer]:
    """Point the backends at ``server`` for one test: its environment variables are set
    (child processes inherit them) and no backend instance made for another server is
    reused. ``s3`` and ``seaweedfs`` share the ``AWS_*`` variables, so without this a test
    of one could reach the other, and a child process the other server than its parent."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.environment().items():
            patch.setenv(name, value)
        _clear_backend_instances()
        try:
            yield server
        finally:
            _clear_backend_instances()


@pytest.fixture(scope="session")
def _s3_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.ObjectServer]:
    yield from _object_server("s3", tmp_path_factory)


@pytest.fixture(scope="session")
def _seaweed_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.ObjectServer]:
    yield from _object_server("seaweedfs", tmp_path_factory)


@pytest.fixture(scope="session")
def _azure_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.ObjectServer]:
    yield from _object_server("azure", tmp_path_factory)


@pytest.fixture(scope="session")
def _gcs_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.ObjectServer]:
    yield from _object_server("gcs", tmp_path_factory)


@pytest.fixture
def s3_server(_s3_process: _servers.ObjectServer) -> Iterator[_servers.ObjectServer]:
    """moto's S3 server (IAM auth on), with the bucket ``taskpoint-tests``; the backends
    reach it for this test."""
    yield from _activate(_s3_process)


@pytest.fixture
def seaweed_server(_seaweed_process: _servers.ObjectServer) -> Iterator[_servers.ObjectServer]:
    """SeaweedFS's S3 gateway (signatures checked), with the bucket ``taskpoint-tests``;
    the backends reach it for this test."""
    yield from _activate(_seaweed_process)


@pytest.fixture
def azure_server(_azure_process: _servers.ObjectServer) -> Iterator[_servers.ObjectServer]:
    """Azurite's Blob service, with the container ``taskpoint-tests``; the backends reach
    it for this test."""
    yield from _activate(_azure_process)


@pytest.fixture
def gcs_server(_gcs_process: _servers.ObjectServer) -> Iterator[_servers.ObjectServer]:
    """The GCS emulator, with the bucket ``taskpoint-tests``; the backends reach it for
    this test."""
    yield from _activate(_gcs_process)


@pytest.fixture(scope="session")
def uv() -> str:
    """The ``uv`` executable (``$UV``, else on PATH); without one, skip, or fail under CI."""
    found = os.environ.get("UV") or shutil.which("uv")
    if found and Path(found).is_file():
        return found
    _servers.required("uv is not installed (not on PATH, no UV variable)", "the tests that "
                      "build wheels and run the README's commands must run")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True)
def _fsspec_registry_restored() -> Iterator[None]:
    """Undo protocol re-registrations a test makes (``flyte.init()`` makes obstore fsspec's
    ``s3``/``gs``/``abfs``/``abfss`` handler for the whole process)."""
    from fsspec.registry import _registry

    saved = dict(_registry)
    yield
    _registry.clear()
    _registry.update(saved)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, in ``pyproject.toml``): one worker per core, at most 4,
    since each worker starts its own object-store servers and many tests start training
    processes of their own."""
    return max(1, min(os.cpu_count() or 1, 4))


def _narrowed_by_stores_marker(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``store_url`` cases a ``@pytest.mark.stores(...)`` test does not list:
    slow process-level tests run on the file store and one object store, not all six."""
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("stores")
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("store_url") if callspec is not None else None
        if marker is not None and kind is not None and kind not in marker.args:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Narrow ``@pytest.mark.stores`` tests to their stores. Skip ``@pytest.mark.gpu``
    tests, with the reason, where CUDA is missing; with ``TASKPOINT_REQUIRE_GPU=1`` (the
    GPU workflow) that is an error instead."""
    _narrowed_by_stores_marker(config, items)
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        if os.environ.get("TASKPOINT_REQUIRE_GPU") == "1":
            raise pytest.UsageError(
                "TASKPOINT_REQUIRE_GPU=1 but torch.cuda.is_available() is False: the gpu "
                "tests would be skipped"
            )
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=_selected_stores())
def store_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty checkpoint location on each store kind the suite runs against.

    Object-store locations need no ``storage_options``: the environment points the
    backend at the test server.
    """
    kind = request.param
    if kind == "file":
        yield f"file://{tmp_path_factory.mktemp('store')}"
    elif kind == "memory":
        url = f"memory://taskpoint-tests/{uuid.uuid4().hex}"
        yield url
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
    else:
        server: _servers.ObjectServer = request.getfixturevalue(_servers.SERVER_FIXTURES[kind])
        yield server.url(TEST_BUCKET, uuid.uuid4().hex)
