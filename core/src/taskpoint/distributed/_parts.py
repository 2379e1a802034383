"""Multi-writer saves: every rank uploads its own folder, rank 0 commits them as one tree.

The protocol (:func:`save_part`), run by every rank of a
:class:`~taskpoint.distributed.coordination.Coordinator` with its own local folder; each
step ends in a collective that carries every rank's error, so a failure on one rank fails
the save on every rank at that step, and a rank that never arrives fails it on every other
rank when the coordinator's timeout runs out:

1. **Agree.** Every rank sends the checkpoint URL, its rank and world size, and whether its
   folder can be saved. Ranks that disagree all raise
   :class:`~taskpoint.CheckpointCoordinationError` naming the values, before any upload.
2. **Number.** Rank 0 claims the attempt and save number and broadcasts them.
3. **Upload.** Each rank takes a save lease (:class:`taskpoint.format.retention.Lease`, held until
   the commit is known), stores its tree as format-2 content objects (reusing what the
   run's committed checkpoints hold) and sends its entries and objects (metadata only:
   paths, hashes, object names; never file content) to the others.
4. **Commit.** Rank 0 merges the parts (:func:`merge_parts`: a path two ranks wrote with
   different content is an error naming both), checks that every object they reference is
   in the store with its size, writes the manifest (the one commit), and broadcasts the
   outcome. Until that write nothing can load the checkpoint; a rank killed before it
   leaves at most unreferenced objects, which a later collection frees. A rank that
   vanishes after rank 0 gathered its part does not stop the commit, and the others still
   hear the outcome: the broadcast waits for rank 0 alone where the coordinator can (a
   :class:`~taskpoint.StoreCoordinator`). A rank that cannot hear it (rank 0 vanished,
   or the coordinator's broadcast waits for every rank) looks for the manifest with a
   fresh listing of the store and raises, saying whether the checkpoint was committed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taskpoint import preemption
from taskpoint.distributed.coordination import Coordinator, check_agreement
from taskpoint.errors import CheckpointCoordinationError, CheckpointError, _save_failures
from taskpoint.format import _tree_save, archive, retention
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Progress
from taskpoint.format.history import SaveStats
from taskpoint.format.manifest import (
    CHECKPOINTS,
    TREE_FORMAT,
    Codec,
    Entry,
    Manifest,
    manifest_name,
    parse_entries,
    tree_checksum,
)
from taskpoint.progress import current_step

__all__ = ["Part", "PartsCommit", "check_part", "merge_parts", "save_part", "upload_part"]

log = logging.getLogger(__name__)


Part = tuple[tuple[Entry, ...], dict[str, int]]
"""One rank's contribution: its entries and the objects they use, with stored sizes."""


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _raise_first(own: BaseException | None, errors: list[str | None], what: str) -> None:
    """Raise this rank's own error, else one naming every rank that failed."""
    if own is not None:
        raise own
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        listed = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise CheckpointCoordinationError(
            f"cannot {what}: {listed}; nothing was committed", ranks=[r for r, _ in failed]
        )


def _same(a: Entry, b: Entry) -> bool:
    if a.type != b.type:
        return False
    if a.type == "file":
        return a.size == b.size and a.hash == b.hash
    return a.target == b.target


def _what(entry: Entry) -> str:
    if entry.type == "file":
        return f"a file of {entry.size} bytes, {entry.hash}"
    if entry.target is not None:
        return f"a {entry.type} to {entry.target!r}"
    return f"a {entry.type}"


def merge_parts(
    parts: list[Part],
) -> tuple[tuple[Entry, ...], dict[str, int], dict[str, tuple[str, ...]]]:
    """The union of every rank's tree: its entries, objects and each rank's paths.

    Each rank's entries keep their order (parents first) and a path met again is kept
    once, so the union lists parents before children too.

    Raises:
        CheckpointCoordinationError: two ranks wrote one path with different content (a
            file with other bytes, a file where the other has a directory...); names both.
    """
    seen: dict[str, tuple[int, Entry]] = {}
    entries: list[Entry] = []
    objects: dict[str, int] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for rank, (part_entries, part_objects) in enumerate(parts):
        objects.update(part_objects)
        for entry in part_entries:
            first = seen.get(entry.path)
            if first is None:
                seen[entry.path] = (rank, entry)
                entries.append(entry)
            elif not _same(first[1], entry):
                raise CheckpointCoordinationError(
                    f"ranks {first[0]} and {rank} both wrote {entry.path!r} with different "
                    f"content (rank {first[0]}: {_what(first[1])}; rank {rank}: "
                    f"{_what(entry)}); give each rank its own file names",
                    ranks=[first[0], rank],
                )
        paths[str(rank)] = tuple(e.path for e in part_entries)
    return tuple(entries), objects, paths


def _check_agreement(hellos: list[Any], url: str, own: BaseException | None) -> None:
    def field(name: str) -> list[Any]:
        return [h.get(name) if isinstance(h, dict) else None for h in hellos]

    check_agreement(
        field("url"), field("world_size"), ranks=field("rank"), undone="Nothing was uploaded"
    )
    _raise_first(own, field("error"), "save the checkpoint's parts")


def check_part(root: Path) -> None:
    """Raise unless ``root`` is a directory that can be saved.

    Raises:
        NotADirectoryError: ``root`` is not a directory.
        CheckpointUnsafeError: it holds a special file or a link leaving it.
    """
    if not root.is_dir():
        raise NotADirectoryError(f"a checkpoint part must be a directory; {str(root)!r} is not one")
    archive.check_tree(root)


def upload_part(
    catalog: Catalog,
    root: Path,
    *,
    codec: Codec,
    progress: Progress | None = None,
    step: int | None = None,
    noticed: bool | None = None,
) -> dict[str, Any]:
    """Store the tree under ``root`` as content objects; the record the committer merges.

    Call it only once the committing rank holds its :class:`PartsCommit` (after a
    collective that follows :meth:`taskpoint.Checkpoint.begin_parts`): that commit's lease
    keeps a collection from freeing the content this part reuses or uploads.

    ``step`` and ``noticed`` are the training step and whether the preemption notice was
    set when the save was called; ``None``: as they are now (a save uploaded in the
    background is called earlier than it uploads).

    Returns:
        A JSON record: ``{"name", "entries", "objects", "size", "uploaded", "reused",
        "step", "preemption"}``.

    Raises:
        NotADirectoryError: ``root`` is not a directory.
        CheckpointUnsafeError: it holds a special file or a link leaving it.
        CheckpointStoreError: the store failed.
        CheckpointSaveError: a file could not be read, or taskpoint failed.
    """
    check_part(root)
    store = catalog.store
    known = _tree_save.BlobIndex.of(catalog.read_committed())
    with _save_failures(store.url, f"saving this rank's part {root}"):
        saved = _tree_save.save_tree(
            store, root, known, codec=codec, workers=store.transfer.concurrency,
            progress=progress,
        )
    return {
        "name": root.name, "entries": [e.to_record() for e in saved.entries],
        "objects": saved.objects, "size": saved.size, "uploaded": saved.uploaded,
        "reused": saved.reused, "step": current_step() if step is None else step,
        "preemption": preemption.requested() if noticed is None else noticed,
    }


class PartsCommit:
    """The committing rank's side of one multi-writer save (see
    :meth:`taskpoint.Checkpoint.begin_parts`): holds a save lease until :meth:`commit` or
    :meth:`abort`.

    Attributes:
        attempt: the attempt the checkpoint is committed as.
        seq: its save number.
    """

    def __init__(
        self,
        catalog: Catalog,
        attempt: int,
        seq: int,
        *,
        called: float,
        committed: Callable[[SaveStats], None],
    ) -> None:
        self._catalog = catalog
        self.attempt = attempt
        self.seq = seq
        self._called = called
        self._committed = committed
        self._lease: retention.Lease | None = retention.Lease(catalog.store, attempt, seq)
        self._lease.__enter__()
        self._started = time.monotonic()

    def __repr__(self) -> str:
        return f"PartsCommit({self._catalog.store.url!r}, attempt={self.attempt}, seq={self.seq})"

    def __enter__(self) -> PartsCommit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    @property
    def key(self) -> str:
        """The manifest this commit writes, relative to the checkpoint's URL."""
        return f"{CHECKPOINTS}/{manifest_name(self.attempt, self.seq)}"

    def commit(self, records: list[Any]) -> SaveStats:
        """Merge every rank's :func:`upload_part` record (in rank order), check that their
        objects are stored, and write the manifest: the commit. Then prune.

        Raises:
            CheckpointCoordinationError: two ranks wrote one path with different content,
                or an object a part references is missing from the store.
            CheckpointCorruptError: a record is malformed.
            CheckpointStoreError: the store failed, or the lease lapsed.
            RuntimeError: this commit was already committed or aborted.
        """
        if self._lease is None:
            raise RuntimeError(f"{self!r} is already finished")
        try:
            stats = _commit(
                self._catalog, records, self.attempt, self.seq, self.key, self._lease,
                self._called, self._started,
            )
        finally:
            self.abort()
        self._committed(stats)
        return stats

    def abort(self) -> None:
        """Release the lease without committing (nothing if already finished)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.__exit__(None, None, None)


def save_part(
    check: Callable[[], None],
    begin: Callable[[], PartsCommit],
    upload: Callable[[], dict[str, Any]],
    coordinator: Coordinator,
    url: str,
    find: Callable[[str], str | None],
) -> SaveStats | None:
    """Run the protocol (see the module docstring) for this rank.

    Args:
        check: raises if this rank's folder cannot be saved (before anything is uploaded).
        begin: on rank 0, claims the numbers and takes the lease.
        upload: uploads this rank's folder (:func:`upload_part`).
        coordinator: the ranks writing this checkpoint.
        url: the checkpoint's URL, which every rank must name.
        find: the URL of the manifest at a key (relative to ``url``) if it is in the
            store, else ``None``: how a rank that missed the outcome learns it. It must
            ask the store afresh, never a cached listing.

    Returns:
        The commit's stats on rank 0; ``None`` on the other ranks.

    Raises:
        CheckpointCoordinationError: the ranks disagree, one failed (this rank raises its
            own error instead), a path conflicts, or a rank did not arrive in time. Its
            ``committed`` is the manifest's URL when the checkpoint was committed all the
            same (rank 0 vanished after committing, or, with a coordinator whose broadcast
            waits for every rank, another rank vanished after rank 0 had its part).
        CheckpointStoreError: the store failed.
    """
    rank = coordinator.rank
    own: BaseException | None = None
    try:
        check()
    except Exception as exc:
        own = exc
    hellos = coordinator.all_gather(
        {"url": url, "rank": rank, "world_size": coordinator.world_size,
         "error": _describe(own)}
    )
    _check_agreement(hellos, url, own)

    commit: PartsCommit | None = None
    numbers: dict[str, Any] = {}
    if rank == 0:
        try:
            commit = begin()
            numbers = {"key": commit.key}
        except Exception as exc:
            own, numbers = exc, {"error": _describe(exc)}
    with contextlib.ExitStack() as held:
        if commit is not None:
            held.enter_context(commit)
        numbers = coordinator.broadcast(numbers)
        _raise_first(own, [numbers.get("error")], "number the save")
        key = str(numbers["key"])

        record: dict[str, Any] = {}
        try:
            record = upload()
        except Exception as exc:
            own, record = exc, {"error": _describe(exc)}
        records = coordinator.all_gather(record)
        _raise_first(own, [r.get("error") for r in records], "upload every rank's part")

        # From here on rank 0 may commit: every error says whether it did.
        outcome: dict[str, Any] = {}
        stats: SaveStats | None = None
        if commit is not None:
            try:
                stats = commit.commit(records)
                outcome = {"committed": stats.url}
            except Exception as exc:
                own = exc
                ranks = exc.ranks if isinstance(exc, CheckpointCoordinationError) else [0]
                known, committed = _look(find, key)
                outcome = {
                    "error": _describe(exc), "ranks": ranks, "known": known,
                    "committed": committed,
                }
        try:
            outcome = coordinator.broadcast(outcome)
        except CheckpointCoordinationError as exc:
            if own is not None:
                raise own from exc
            known, committed = (True, stats.url) if stats is not None else _look(find, key)
            raise _unheard(exc, rank, f"{url.rstrip('/')}/{key}", known, committed) from exc
        if own is not None:
            raise own
        if outcome.get("error") is not None:
            committed = outcome.get("committed")
            if committed is not None:
                said = f"the checkpoint WAS committed ({committed}; it loads)"
            elif outcome.get("known"):
                said = "nothing was committed"
            else:
                said = "the store could not say whether its manifest was written"
            raise CheckpointCoordinationError(
                f"rank 0 failed committing {key} at {url} ({outcome['error']}), so rank "
                f"{rank} fails too; {said}",
                ranks=outcome.get("ranks") or [0], committed=committed,
            )
    return stats


def _look(find: Callable[[str], str | None], key: str) -> tuple[bool, str | None]:
    """``(True, find(key))``, or ``(False, None)`` if the store cannot tell."""
    try:
        return True, find(key)
    except CheckpointError as exc:
        log.warning("could not look for the manifest %s: %s", key, exc)
        return False, None


def _unheard(
    error: CheckpointCoordinationError,
    rank: int,
    manifest: str,
    known: bool,
    committed: str | None,
) -> CheckpointCoordinationError:
    """The error for a rank whose outcome round failed (a rank did not arrive there, after
    rank 0 had every part): what it knows of the commit, from rank 0 or the store
    (``known``: the store was read; ``committed``: the manifest's URL, if written)."""
    missing = error.ranks
    if committed is not None:
        vanished = (
            "rank 0 vanished after committing, before reporting it" if 0 in missing
            else f"rank(s) {missing or 'unknown'} vanished after their parts were gathered, "
            "before hearing the outcome"
        )
        return CheckpointCoordinationError(
            f"rank {rank}: the checkpoint WAS committed ({committed}; it loads), but "
            f"{vanished} ({error}); the commit stands, the job's ranks can no longer work "
            "together",
            ranks=missing, committed=committed,
        )
    if known and missing and 0 not in missing:  # rank 0 reported: it had given up
        return CheckpointCoordinationError(
            f"rank {rank}: rank(s) {missing} vanished after their parts were gathered, "
            f"before hearing the outcome ({error}); rank 0 did not commit {manifest}: "
            "nothing was committed",
            ranks=missing,
        )
    looked = (
        f"that manifest was not in the store when rank {rank} looked" if known
        else f"rank {rank} could not look for it in the store"
    )
    unheard = (
        "rank 0 never reported the outcome" if 0 in missing
        else f"rank(s) {missing or 'unknown'} did not hear the outcome"
    )
    return CheckpointCoordinationError(
        f"rank {rank}: {unheard}, and this rank does not know whether rank 0 committed "
        f"{manifest} ({error}); {looked}; a rank 0 still running may commit it yet",
        ranks=missing,
    )


def _name(name: object) -> str:
    """Rank 0's folder name, which the restored tree gets; ``parts`` if it cannot be one."""
    if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name:
        return name
    return "parts"


def _commit(
    catalog: Catalog,
    records: list[Any],
    attempt: int,
    seq: int,
    key: str,
    lease: retention.Lease,
    called: float,
    upload_started: float,
) -> SaveStats:
    """Rank 0: merge the parts, verify their objects are stored, write the manifest."""
    store = catalog.store
    parts: list[Part] = []
    for rank, record in enumerate(records):
        objects = {str(k): int(v) for k, v in record["objects"].items()}
        parts.append(
            (parse_entries(record["entries"], objects, url=f"rank {rank}'s part"), objects)
        )
    entries, objects, paths = merge_parts(parts)
    stored = store.list_sizes(retention.OBJECTS)
    for name, size in objects.items():
        if stored.get(name) != size:
            owners = [r for r, (_, part_objects) in enumerate(parts) if name in part_objects]
            raise CheckpointCoordinationError(
                f"object {store.url_of(f'{retention.OBJECTS}/{name}')} of rank(s) {owners}'s "
                f"part is {'missing' if name not in stored else 'of the wrong size'} in the "
                "store; not committing",
                ranks=owners,
            )
    size = sum(int(r["size"]) for r in records)
    uploaded = sum(int(r["uploaded"]) for r in records)
    reused = sum(int(r["reused"]) for r in records)
    now = time.monotonic()
    stats = SaveStats(
        url=store.url_of(key), attempt=attempt, seq=seq, kind="directory",
        size=sum(e.size for e in entries if e.type == "file"), uploaded=uploaded,
        reused=reused, save_s=now - called, upload_s=now - upload_started,
        blocked_s=now - called, background=False,
    )
    step = records[0].get("step")  # the committing rank's; ranks step together
    record = stats.to_record()
    record["writers"] = len(records)
    record["written"] = size
    manifest = Manifest(
        kind="directory", name=_name(records[0].get("name")), codec="none", size=stats.size,
        checksum=tree_checksum(entries), payload=None, attempt=attempt, seq=seq,
        created=time.time(), format=TREE_FORMAT, stats=record, entries=entries,
        objects=objects, parts=paths,
        step=step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None,
        preemption=any(r.get("preemption") is True for r in records),
    )
    lease.check()
    store.write_atomic(key, manifest.to_json())
    catalog.remember(manifest)
    log.info(
        "committed %d-part checkpoint %s (%d bytes, %d uploaded) in %.2fs",
        len(records), stats.url, stats.size, uploaded, stats.save_s,
    )
    return stats
