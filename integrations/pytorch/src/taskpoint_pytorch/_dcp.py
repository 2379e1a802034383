"""``torch.distributed.checkpoint`` (DCP) through a taskpoint checkpoint: each ``dcp.save``
is one commit of every rank's shards (:class:`TaskpointStorageWriter`), and ``dcp.load``
reads the newest on any number of ranks, each fetching only the shard files its plan reads
(:class:`TaskpointStorageReader`)::

    import taskpoint
    import torch.distributed.checkpoint as dcp
    from taskpoint_pytorch import TaskpointStorageReader, TaskpointStorageWriter

    ckpt = taskpoint.Checkpoint("s3://bucket/jobs/train-42")
    dcp.save(state, storage_writer=TaskpointStorageWriter(ckpt))
    ...
    dcp.load(state, storage_reader=TaskpointStorageReader(ckpt))
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint import CheckpointCoordinationError
from taskpoint.integration import (
    check_agreement,
    rank_and_size,
    remove_scratch_folder,
    scratch_folder,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

__all__ = ["TaskpointStorageReader", "TaskpointStorageWriter", "need_checkpoint"]

log = logging.getLogger(__name__)

DCP_FOLDER = "dcp"
"""The name of the tree a DCP checkpoint is committed as (and restored to)."""
_METADATA = ".metadata"
_PART = "__taskpoint_part__"
"""The name of the extra write result that carries a rank's uploaded part (its record)
to the coordinator."""


@dataclass(frozen=True)
class _Hello:
    """What each rank's local plan tells the coordinator, beside the inner plan's data."""

    url: str
    world_size: int
    inner: Any


def need_checkpoint(checkpoint: object, user: str) -> taskpoint.Checkpoint:
    """``checkpoint``, checked to be the :class:`taskpoint.Checkpoint` that ``user`` (for
    the message) needs: every rank's part of a DCP save is one commit of it.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(checkpoint, taskpoint.Checkpoint):
        raise TypeError(
            f"{user} keeps every rank's torch.distributed.checkpoint shards as one taskpoint "
            f"checkpoint, so it needs a taskpoint.Checkpoint; got {type(checkpoint).__name__}"
        )
    return checkpoint


class _AtCheckpoint:
    """What the writer and the reader share: the checkpoint (checked), its URL as DCP's
    ``checkpoint_id``, and a local staging folder per save or load."""

    def __init__(self, checkpoint: object, staging: str | os.PathLike[str] | None) -> None:
        super().__init__()
        self._checkpoint = need_checkpoint(checkpoint, type(self).__name__)
        self._staging = None if staging is None else Path(os.fspath(staging))
        self._folder: Path | None = None
        self._held: list[taskpoint.PartsCommit] = []  # leases the cleanup aborts
        self._cleanup: weakref.finalize[Any, Any] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._checkpoint.url!r})"

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint location's URL."""
        return self._checkpoint.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked for a bare checkpoint_id: pass the writer or reader

    def _new_folder(self) -> Path:
        """A fresh scratch folder for this save's or load's files (under ``staging``), now
        :attr:`_folder`: :meth:`_drop_folder` (or garbage collection) removes it and aborts
        the leases then in :attr:`_held`; a process killed first leaves it to the next
        process's sweep (:func:`taskpoint.integration.scratch_folder`)."""
        if self._staging is not None:
            self._staging.mkdir(parents=True, exist_ok=True)
        self._folder = scratch_folder(self._staging)
        self._held = []
        self._cleanup = weakref.finalize(self, _release, self._folder, self._held)
        return self._folder

    def _drop_folder(self) -> None:
        """Release the folder (and what its cleanup holds) now."""
        if self._cleanup is not None:
            self._cleanup()  # a finalizer runs once: calling it again does nothing
        self._folder = None


class _StagingWriter(FileSystemWriter):
    """The ``FileSystemWriter`` staging one save's files; the ``.metadata`` it writes names
    the checkpoint's URL (``storage_meta.checkpoint_id``), not the local staging folder."""

    def __init__(self, path: Path, url: str, *, thread_count: int) -> None:
        super().__init__(path, sync_files=False, thread_count=thread_count, overwrite=True)
        self._url = url

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        return None if meta is None else dataclasses.replace(meta, checkpoint_id=self._url)


class TaskpointStorageWriter(_AtCheckpoint, StorageWriter):
    """A DCP ``StorageWriter`` that commits each ``dcp.save`` as one taskpoint checkpoint.

    Every rank passes a writer for the same location: it stages its shards with DCP's
    ``FileSystemWriter`` and uploads them in ``write_data``; the coordinator adds DCP's
    ``.metadata`` in ``finish`` and commits every rank's part
    (:meth:`taskpoint.Checkpoint.begin_parts`). Nothing loads the checkpoint until
    every rank's shard files are in the store and the coordinator has committed it; a rank
    that fails or dies fails the save on every rank (DCP's collectives) and commits nothing.

    Args:
        checkpoint: the :class:`taskpoint.Checkpoint` to commit to.
        staging: local folder for each save's shard files before they upload (a temporary
            folder by default); they are removed once uploaded.
        thread_count: threads serialising this rank's shards (``FileSystemWriter``'s).

    Raises:
        TypeError: ``checkpoint`` is not a :class:`taskpoint.Checkpoint`.
    """

    def __init__(
        self,
        checkpoint: taskpoint.Checkpoint,
        *,
        staging: str | os.PathLike[str] | None = None,
        thread_count: int = 1,
    ) -> None:
        super().__init__(checkpoint, staging)
        self._thread_count = thread_count
        self.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (DCP calls this first, on every rank).

        ``checkpoint_id`` is ignored: the checkpoint's URL is where it goes.
        """
        self.close()
        staged = self._new_folder() / DCP_FOLDER
        staged.mkdir()
        self._inner: _StagingWriter | None = _StagingWriter(
            staged, self.checkpoint_id, thread_count=self._thread_count
        )

    def close(self) -> None:
        """Release what an unfinished save holds: on the coordinator, the save lease
        (while it is live, collections of unreferenced objects at the location skip), and
        the local staging folder.

        A save that commits releases them itself. When ``dcp.save`` raised because another
        rank failed, ``finish`` never ran here: call this (or drop the writer: the next
        ``reset`` and garbage collection release them too).
        """
        self._drop_folder()
        self._commit: taskpoint.PartsCommit | None = None
        self._inner = None

    def _ready(self) -> tuple[_StagingWriter, Path]:
        if self._inner is None or self._folder is None:
            self.reset()
        assert self._inner is not None and self._folder is not None
        return self._inner, self._folder

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        inner, _ = self._ready()
        inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        if is_coordinator:
            # Before any rank uploads (they do after the plan's scatter): the lease keeps
            # collections from freeing content the parts reuse until the commit.
            self._commit = self._checkpoint.begin_parts()
            self._held.append(self._commit)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        inner, _ = self._ready()
        plan = inner.prepare_local_plan(plan)
        hello = _Hello(self._checkpoint.url, rank_and_size()[1], plan.storage_data)
        return dataclasses.replace(plan, storage_data=hello)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        inner, _ = self._ready()
        hellos = [p.storage_data if isinstance(p.storage_data, _Hello) else None for p in plans]
        try:
            urls = [h.url if h else None for h in hellos]
            check_agreement(urls, [h.world_size if h else None for h in hellos],
                            undone="Nothing was uploaded")
            return inner.prepare_global_plan([
                dataclasses.replace(p, storage_data=h.inner if h else None)
                for p, h in zip(plans, hellos, strict=True)
            ])
        except BaseException:
            self.close()  # nothing will be uploaded: release the lease now
            raise

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        inner, folder = self._ready()
        results = inner.write_data(plan, planner).wait()
        part = folder / DCP_FOLDER
        record = self._checkpoint.upload_part(part)
        for path in part.iterdir():  # uploaded: free the local disk
            path.unlink()
        marker = WriteResult(index=MetadataIndex(fqn=_PART), size_in_bytes=0, storage_data=record)
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, marker])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: write DCP's metadata, upload it, commit every rank's part."""
        inner, folder = self._ready()
        # Every rank's write_data added its part's record: prepare_global_plan checked that
        # every rank plans with a TaskpointStorageWriter.
        records = [next(r.storage_data for r in rank if r.index.fqn == _PART) for rank in results]
        kept = [[r for r in rank if r.index.fqn != _PART] for rank in results]
        inner.finish(metadata, kept)
        meta_folder = folder / "metadata" / DCP_FOLDER
        meta_folder.mkdir(parents=True)
        os.replace(folder / DCP_FOLDER / _METADATA, meta_folder / _METADATA)
        meta = self._checkpoint.upload_part(meta_folder)
        first = records[0]
        assert self._commit is not None
        merged = {
            **first,
            "entries": [*first["entries"], *meta["entries"]],
            "objects": {**first["objects"], **meta["objects"]},
            **{k: first[k] + meta[k] for k in ("size", "uploaded", "reused")},
        }
        self._commit.commit([merged, *records[1:]])  # aborts (releases the lease) if it fails
        self.close()

    def storage_meta(self) -> StorageMeta | None:
        """This save's identity for DCP's metadata: the checkpoint's URL and a save id.

        DCP asks before ``set_up_storage_writer``; a writer that committed a save starts the
        next one here, so each save records its own id (readers check that every rank
        planned with the same save by it).
        """
        return self._ready()[0].storage_meta()


def _release(folder: Path, commits: list[taskpoint.PartsCommit]) -> None:
    for commit in commits:
        commit.abort()
    remove_scratch_folder(folder)


class TaskpointStorageReader(_AtCheckpoint, StorageReader):
    """A DCP ``StorageReader`` that loads the newest committed taskpoint checkpoint.

    Each rank restores only what it reads: DCP's ``.metadata`` first (to plan), then the
    shard files its own load plan reads, whichever rank wrote them (on another world size
    or sharding a rank may need several ranks' files, on the same one usually only its
    own), and reads them with ``FileSystemReader``. Each rank logs, at INFO, how many files
    and bytes it fetched. The ranks check that they planned with the same save, and each
    that its shard files come from the save it planned with. The local files are removed
    once read (or by :meth:`reset`, or when the reader is dropped). ``.metadata`` is a
    pickle, which ``FileSystemReader`` unpickles: load only from stores whose writers you
    trust.

    Args:
        checkpoint: the :class:`taskpoint.Checkpoint` to load from.
        staging: local folder for each load's files (a temporary folder by default; the
            checkpoint's ``workdir`` is not used).

    Raises:
        TypeError: ``checkpoint`` is not a :class:`taskpoint.Checkpoint`.
    """

    def __init__(
        self,
        checkpoint: taskpoint.Checkpoint,
        *,
        staging: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(checkpoint, staging)
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load: remove the last one's local files and forget what it planned
        with. ``checkpoint_id`` is ignored (the checkpoint's URL is read)."""
        self._drop_folder()
        self._inner: FileSystemReader | None = None
        self._metadata: bytes | None = None
        self._save_id: str | None = None
        self._rank: int | None = None  # DCP's rank, once set up

    def _restore(self, paths: list[str], lacking: str) -> Path:
        """Restore ``paths`` of the newest checkpoint into this load's folder.

        Raises:
            FileNotFoundError: nothing has been committed.
            CheckpointCoordinationError: the newest checkpoint holds none of some of them;
                the message says that it ``lacking`` (what that means), and which.
        """
        folder = self._folder or self._new_folder()
        try:  # into the same folder each time: a .metadata there and unchanged is kept
            path = self._checkpoint.load_sync(into=folder / DCP_FOLDER, paths=paths)
        except CheckpointCoordinationError as exc:
            raise CheckpointCoordinationError(
                f"the newest checkpoint at {self._checkpoint.url} {lacking} ({exc})"
            ) from exc
        if path is None:
            raise FileNotFoundError(
                f"no checkpoint committed at {self._checkpoint.url}: nothing to load"
            )
        return path

    def _metadata_reader(self) -> FileSystemReader:
        """A ``FileSystemReader`` on the newest checkpoint's ``.metadata`` (restored once)."""
        if self._inner is None:
            path = self._restore(
                [_METADATA], "is not a torch.distributed.checkpoint save (no .metadata)"
            )
            self._metadata = (path / _METADATA).read_bytes()
            self._inner = FileSystemReader(path)
        return self._inner

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the newest checkpoint; restores its ``.metadata`` alone.

        Raises:
            FileNotFoundError: nothing has been committed, or ``rank`` was passed (a
                rank-local metadata file, which taskpoint DCP checkpoints never have).
            CheckpointCoordinationError: the newest checkpoint is not a DCP save.
        """
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("taskpoint DCP checkpoints have one global .metadata")
        metadata = self._metadata_reader().read_metadata()
        meta = getattr(metadata, "storage_meta", None)
        self._save_id = getattr(meta, "save_id", None)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._metadata_reader().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._rank = kwargs.get("rank", rank_and_size()[0])

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = self._metadata_reader().prepare_local_plan(plan)
        return dataclasses.replace(plan, storage_data=self._save_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        ids = [p.storage_data for p in plans]
        if len(set(ids)) > 1:
            listed = ", ".join(f"rank {r}: save {i}" for r, i in enumerate(ids))
            raise CheckpointCoordinationError(
                f"ranks restored different checkpoints from {self._checkpoint.url} ({listed}): "
                "one was committed while they loaded; load again",
                ranks=list(range(len(plans))),
            )
        plans = [dataclasses.replace(p, storage_data=None) for p in plans]
        return self._metadata_reader().prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Restore the shard files ``plan`` reads (and ``.metadata`` again, into the same
        folder) and read them.

        Raises:
            CheckpointCoordinationError: a checkpoint was committed since ``.metadata`` was
                read (the newest one's ``.metadata`` differs, or it lacks a file the plan
                reads): load again.
        """
        inner = self._metadata_reader()
        if self._rank is None:
            raise RuntimeError("read_data before set_up_storage_reader: call dcp.load")
        started = time.monotonic()
        url = self._checkpoint.url
        files = sorted({inner.storage_data[item.storage_index].relative_path for item in plan.items})
        try:
            path = self._restore(
                [_METADATA, *files], "lacks shard files this rank's load plan reads: a "
                "checkpoint was committed while loading; load again",
            )
            if (path / _METADATA).read_bytes() != self._metadata:
                raise CheckpointCoordinationError(
                    f"a checkpoint was committed at {url} while loading (its .metadata is not "
                    "the one this load planned with); load again"
                )
            log.info(
                "rank %s fetched .metadata and %d of the %d shard files (%d bytes of shards) "
                "of %s for its load plan in %.2fs",
                self._rank, len(files),
                len({info.relative_path for info in inner.storage_data.values()}),
                sum((path / f).stat().st_size for f in files), url, time.monotonic() - started,
            )
            done = inner.read_data(plan, planner)
            done.wait()
        finally:
            self.reset()
        return done
