"""Collecting format-2 content objects that no committed checkpoint needs, safely.

Retention (``keep=``, :meth:`taskpoint.Checkpoint.prune`) deletes manifests. The content
objects under ``objects/`` are shared between checkpoints of a run, so one can be deleted
only when no committed manifest references it *and* no save that could still reference it
is in flight. The protocol (restic's, on the two guarantees every store gives taskpoint:
:meth:`~taskpoint.store.store.Store.create_exclusive` is atomic and LIST is strongly consistent):

A **save** (:class:`Lease`)
    1. creates ``leases/<attempt:06d>-<seq:09d>-<token>.json`` (refreshed every
       :data:`LEASE_REFRESH_S` by a heartbeat thread while the save runs);
    2. waits while ``gc.lock`` exists and is not stale (:data:`LOCK_STALE_S`);
    3. only then lists the committed manifests and decides which content the store
       already holds, uploads the rest, and commits its manifest;
    4. before committing, checks that its lease is still fresh (refreshed less than
       :data:`LEASE_STALE_S` / 2 ago); else the save fails rather than commit references
       a collector may have judged free;
    5. removes its lease.

A **collection** (:func:`collect`)
    1. creates ``gc.lock`` exclusively (or skips this round: another is collecting);
    2. lists ``leases/``; if any lease is fresh, releases the lock and skips the round
       (stale ones, left by killed saves, are removed);
    3. lists and reads every committed manifest; if any cannot be read, it skips the
       round (it cannot know what that one references);
    4. deletes every object no manifest references, stopping once half of
       :data:`LOCK_STALE_S` has passed (so its lock is never taken for stale while it
       deletes), and removes the lock.

Why no object a committed or in-flight checkpoint needs is ever deleted. Take a save S
and a collection C. If S's lease exists when C lists leases (C.2), C deletes nothing.
Otherwise S created its lease after C.2, so after C.1: S's check of ``gc.lock`` (S.2)
comes after C took it and S waits until C released it, i.e. until C's deletions are over;
everything S lists (S.3) and uploads happens after C, and C deleted only objects it had
listed, which S's uploads (even of the same name) come after. A manifest S reuses content
from was listed by S after C ended, and was committed by a save S' holding a lease: the
same argument applied to S' shows C never deleted what S' referenced. A *zombie* save, one
whose process stalled past :data:`LEASE_STALE_S` (a frozen VM, SIGSTOP) and so lost its
lease, is caught by S.4: it fails instead of committing. What is left is the window between
S.4 and the manifest's PUT, a few milliseconds against a five-minute staleness; a store
offering no fencing cannot close it (restic accepts the same). Clocks: staleness compares
the writer's and the collector's wall clocks, so skew must stay well below
:data:`LOCK_STALE_S` (NTP keeps it to milliseconds). A record whose writer ran on this
host is stale as soon as its process is gone, so a killed save or collection blocks nothing.

Loads take no lease: a reader whose manifest was pruned meanwhile sees the missing objects,
finds the manifest gone from the listing, and loads the newer checkpoint instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

from taskpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointStoreError
from taskpoint.format.manifest import (
    CHECKPOINTS,
    FORMAT_VERSION,
    Manifest,
    loads_record,
    parse_manifest_name,
    parse_payload_name,
)
from taskpoint.store.store import Store

__all__ = ["GC_LOCK", "LEASES", "OBJECTS", "Collected", "Lease", "collect", "prune_manifests"]

log = logging.getLogger(__name__)

OBJECTS = "objects"
"""The folder, under a checkpoint's URL, holding format-2 content objects."""
LEASES = "leases"
"""The folder holding one lease per save in flight."""
GC_LOCK = "gc.lock"
"""The object a collection holds while it runs."""
LEASE_REFRESH_S = 30.0
"""Seconds between a running save's lease refreshes."""
LEASE_STALE_S = 300.0
"""Seconds without refresh after which a lease, or the collection lock, is abandoned."""
LOCK_STALE_S = 60.0
"""Seconds after which a collection lock is abandoned; a collection stops deleting after
half of it, so a killed collection holds saves up for a minute at most (none at all when
it ran on the same host: a lock or lease whose process is gone there is stale at once)."""
LOCK_POLL_S = 0.2
"""Seconds between a save's looks at ``gc.lock`` while a collection runs."""


def _record(**fields: object) -> bytes:
    return json.dumps(
        {"format": FORMAT_VERSION, "at": time.time(), "pid": os.getpid(),
         "host": socket.gethostname(), **fields}
    ).encode()


def _read(store: Store, key: str) -> dict[str, object] | None:
    """A lease or lock record; ``None`` when it is gone.

    A record that cannot be parsed counts as written now: it may be a live writer's.
    """
    try:
        raw = loads_record(store.read_bytes(key))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"at": time.time()}
    return raw if isinstance(raw, dict) else {"at": time.time()}


def _alive_here(record: dict[str, object]) -> bool:
    """False only when the record's writer ran on this host and its process is gone."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _fresh(record: dict[str, object] | None, ttl: float | None = None) -> bool:
    """Whether a lease or lock may still be held: refreshed within ``ttl`` seconds (by
    default :data:`LEASE_STALE_S`) by a process not known to be dead."""
    if record is None:
        return False
    at = record.get("at")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        at = time.time()
    limit = LEASE_STALE_S if ttl is None else ttl
    return time.time() - float(at) < limit and _alive_here(record)


class Lease:
    """A save's claim that it may reference content objects; see the module docstring.

    Use as a context manager around everything from listing manifests to the commit.
    """

    def __init__(self, store: Store, attempt: int, seq: int) -> None:
        self._store = store
        self.key = f"{LEASES}/{attempt:06d}-{seq:09d}-{uuid.uuid4().hex[:8]}.json"
        self._stop = threading.Event()
        self._refreshed = 0.0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Lease:
        self._store.write_atomic(self.key, _record())
        self._refreshed = time.monotonic()
        self._thread = threading.Thread(
            target=self._heartbeat, name="taskpoint-lease", daemon=True
        )
        self._thread.start()
        try:
            self._wait_for_collection()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_for_collection(self) -> None:
        waited = False
        while _fresh(_read(self._store, GC_LOCK), LOCK_STALE_S):
            waited = True
            time.sleep(LOCK_POLL_S)
        if waited:
            log.debug("waited for the collection at %s to end", self._store.url)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_REFRESH_S):
            try:
                self._store.write_atomic(self.key, _record())
                self._refreshed = time.monotonic()
            except CheckpointError as exc:
                log.warning("could not refresh save lease %s: %s", self._store.url_of(self.key), exc)

    def check(self) -> None:
        """Raise unless the lease is still surely fresh, so committing is safe.

        Raises:
            CheckpointStoreError: the lease went unrefreshed for half its lifetime (the
                process stalled, or the store refused the refreshes).
        """
        idle = time.monotonic() - self._refreshed
        if idle >= LEASE_STALE_S / 2:
            raise CheckpointStoreError(
                f"save lease {self._store.url_of(self.key)} went unrefreshed for {idle:.0f}s "
                "(the process stalled or the store refused it); not committing this save, "
                "since a collection may have freed content it reuses. Save again.",
                url=self._store.url_of(self.key),
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._store.remove(self.key)
        except CheckpointError as error:  # stale in five minutes; never hide the save's own
            log.warning("could not remove save lease %s: %s", self._store.url_of(self.key), error)


@dataclass(frozen=True)
class Collected:
    """What one :func:`collect` round did.

    Attributes:
        objects: content objects deleted.
        bytes: their stored bytes.
        skipped: why nothing was collected (a save in flight, another collection, an
            unreadable manifest), or ``None`` when the round ran.
    """

    objects: int = 0
    bytes: int = 0
    skipped: str | None = None


def collect(
    store: Store, read_manifests: Callable[[], list[Manifest]], *, concurrency: int = 8
) -> Collected:
    """Delete the content objects no committed manifest references; see the module docstring.

    Args:
        store: the run's store.
        read_manifests: lists and reads every committed manifest, raising
            :class:`~taskpoint.CheckpointCorruptError` for one it cannot read.
        concurrency: deletes in flight at once.

    Raises:
        CheckpointStoreError: the store failed.
    """
    token = uuid.uuid4().hex
    if not store.create_exclusive(GC_LOCK, _record(token=token)):
        if _fresh(_read(store, GC_LOCK), LOCK_STALE_S):
            return Collected(skipped="another collection is running")
        store.remove(GC_LOCK)  # abandoned by a killed collection
        if not store.create_exclusive(GC_LOCK, _record(token=token)):
            return Collected(skipped="another collection is running")
    started = time.monotonic()
    try:
        live = 0
        for name in store.list(LEASES):
            key = f"{LEASES}/{name}"
            if _fresh(_read(store, key)):
                live += 1
            else:
                store.remove(key)
        if live:
            return Collected(skipped=f"{live} save(s) in flight")
        try:
            manifests = read_manifests()
        except (CheckpointCorruptError, CheckpointError) as exc:
            return Collected(skipped=f"a manifest cannot be read ({exc})")
        referenced: set[str] = set()
        for manifest in manifests:
            referenced.update(manifest.objects or ())
        doomed = {n: s for n, s in store.list_sizes(OBJECTS).items() if n not in referenced}
        deadline = started + LOCK_STALE_S / 2

        def delete(name: str) -> int:
            if time.monotonic() > deadline:  # the lock may pass for stale: stop
                return 0
            store.remove(f"{OBJECTS}/{name}")
            return 1

        with ThreadPoolExecutor(concurrency, thread_name_prefix="taskpoint-gc") as pool:
            deleted = sum(pool.map(delete, doomed))
        if deleted < len(doomed):
            log.warning("collection at %s ran out of time; the rest waits for the next", store.url)
        if doomed:
            log.info(
                "collected %d unreferenced objects (%d bytes) at %s",
                len(doomed), sum(doomed.values()), store.url,
            )
        return Collected(objects=deleted, bytes=sum(doomed.values()) if deleted == len(doomed) else 0)
    finally:
        _release(store, token)


def _release(store: Store, token: str) -> None:
    try:
        raw = loads_record(store.read_bytes(GC_LOCK))
    except (FileNotFoundError, ValueError):
        return
    if isinstance(raw, dict) and raw.get("token") == token:
        store.remove(GC_LOCK)


# -- pruning manifests ----------------------------------------------------------------


def prune_manifests(store: Store, keep: int, intact: Callable[[str], bool]) -> int:
    """Delete checkpoints older than the newest ``keep`` intact ones; how many manifests went.

    What counts is the checkpoints a load could return, never names alone: manifests are
    tried newest first with ``intact`` until ``keep`` intact ones are found, and only
    checkpoints older than the oldest of those are deleted. With fewer than ``keep`` intact
    checkpoints nothing is deleted; ``keep=0`` deletes every checkpoint. Manifests go before
    their payloads, so a reader never finds a manifest whose payload is gone for good;
    format-1 payloads without a manifest (interrupted saves) older than the cut go too.
    Format-2 content objects are :func:`collect`'s.

    Args:
        store: the checkpoint location.
        keep: how many intact checkpoints to keep; at least 0.
        intact: whether the manifest called ``name`` (under ``checkpoints/``) reads and
            its payload is intact.

    Raises:
        CheckpointStoreError: the store failed.
    """
    names = store.list(CHECKPOINTS)
    manifests = sorted(
        (order, name) for name in names if (order := parse_manifest_name(name)) is not None
    )
    cut = _retention_cut(manifests, keep, intact)
    if cut is None:
        return 0
    doomed = [name for order, name in manifests if order < cut]
    for name in doomed:
        store.remove(f"{CHECKPOINTS}/{name}")
    remaining = {order for order, _ in manifests if order >= cut}
    for name in names:
        order = parse_payload_name(name)
        if order is not None and order < cut and order not in remaining:
            store.remove(f"{CHECKPOINTS}/{name}")
    return len(doomed)


def _retention_cut(
    manifests: list[tuple[tuple[int, int], str]], keep: int, intact: Callable[[str], bool]
) -> tuple[int, int] | None:
    """The order of the oldest checkpoint kept; ``None`` when nothing may be deleted."""
    if keep == 0:
        return (sys.maxsize, sys.maxsize)
    found = 0
    for order, name in reversed(manifests):
        if intact(name):
            found += 1
            if found == keep:
                return order
    return None
