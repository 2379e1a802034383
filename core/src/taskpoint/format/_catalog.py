"""The committed checkpoints at one location: listing, reading, verifying, pruning.

Shared by the save path (:mod:`taskpoint.checkpoint._save`, which references what committed
format-2 trees hold and prunes after each commit), the load path (:mod:`taskpoint.checkpoint._load`)
and :class:`taskpoint.Checkpoint`'s own queries. A :class:`Catalog` remembers what it has
learnt: each manifest is read from the store once, and a checkpoint known intact (this
process committed or restored it, or verified it) is never read through again.
"""

from __future__ import annotations

from taskpoint.errors import CheckpointCorruptError, CheckpointFormatError
from taskpoint.format import _tree_restore, retention
from taskpoint.format._digest import Digest, HashingReader, Progress
from taskpoint.format.manifest import CHECKPOINTS, Manifest, parse_manifest_name
from taskpoint.store.store import Store

__all__ = ["Catalog"]


class Catalog:
    """The committed checkpoints under ``checkpoints/`` of ``store``.

    Args:
        store: the checkpoint location.
        progress: called with the number of payload bytes read while verifying.
    """

    def __init__(self, store: Store, progress: Progress | None = None) -> None:
        self.store = store
        self.progress = progress
        self.intact: set[tuple[str, str]] = set()
        """``(manifest key, checksum)`` of the checkpoints known intact."""
        self._manifests: dict[str, Manifest] = {}  # committed manifests read, by name

    def names(self) -> list[str]:
        """The committed manifests' names, oldest first.

        Raises:
            CheckpointStoreError: the store failed.
        """
        names = self.store.list(CHECKPOINTS)
        return sorted(
            (n for n in names if parse_manifest_name(n) is not None),
            key=lambda n: parse_manifest_name(n) or (0, 0),
        )

    def read(self, name: str) -> Manifest:
        """The manifest called ``name``, read from the store now.

        Raises:
            FileNotFoundError: it is gone (pruned since it was listed).
            CheckpointCorruptError: it cannot be parsed.
            CheckpointFormatError: a newer taskpoint wrote it.
            CheckpointStoreError: the store failed.
        """
        key = f"{CHECKPOINTS}/{name}"
        return Manifest.from_json(
            self.store.read_bytes(key), url=self.store.url_of(key), name=name
        )

    def newest_first(self) -> list[Manifest]:
        """The committed manifests that parse, newest first, without verifying payloads.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a manifest comes from a newer format.
        """
        result = []
        for name in reversed(self.names()):
            try:
                result.append(self.read(name))
            except (CheckpointCorruptError, FileNotFoundError):
                continue
        return result

    def read_committed(self, strict: bool = False) -> list[Manifest]:
        """The committed manifests, listed now, oldest first; each read from the store once.

        With ``strict``, a manifest that cannot be read raises instead of being left out.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointCorruptError: with ``strict``, a manifest cannot be parsed.
            CheckpointFormatError: with ``strict``, a manifest comes from a newer format.
        """
        names = self.names()
        listed = set(names)
        for name in list(self._manifests):
            if name not in listed:
                del self._manifests[name]
        for name in names:
            if name in self._manifests:
                continue
            try:
                self._manifests[name] = self.read(name)
            except FileNotFoundError:
                continue  # pruned since the listing: it references nothing any more
            except (CheckpointCorruptError, CheckpointFormatError):
                if strict:
                    raise
        return [self._manifests[n] for n in names if n in self._manifests]

    def remember(self, manifest: Manifest) -> None:
        """Record ``manifest`` as committed and intact (this process committed it)."""
        self._manifests[manifest.key] = manifest
        self.intact.add((manifest.key, manifest.checksum))

    def verify(self, manifest: Manifest) -> bool:
        """Whether ``manifest``'s payload exists and matches its size and checksum.

        Reads the payload through without writing it anywhere.

        Raises:
            CheckpointStoreError: the store failed.
        """
        if manifest.is_tree:
            return _tree_restore.verify_tree(self.store, manifest)
        try:
            with self.store.open_read(f"{CHECKPOINTS}/{manifest.payload}") as raw:
                reader = HashingReader(raw, self.progress, Digest.matching(manifest.checksum))
                reader.drain()
        except FileNotFoundError:
            return False
        return reader.digest.size == manifest.size and reader.digest.checksum == manifest.checksum

    def is_intact(self, name: str) -> bool:
        """Whether the manifest called ``name`` reads and its payload is intact.

        Raises:
            CheckpointStoreError: the store failed.
        """
        try:
            manifest = self.read(name)
        except (CheckpointCorruptError, CheckpointFormatError, FileNotFoundError):
            return False
        known = (manifest.key, manifest.checksum)
        if known in self.intact:
            return True
        if not self.verify(manifest):
            return False
        self.intact.add(known)
        return True

    def prune(self, keep: int) -> int:
        """Keep the newest ``keep`` intact checkpoints (see
        :func:`taskpoint.format.retention.prune_manifests`); how many manifests were deleted.

        Raises:
            CheckpointStoreError: the store failed.
        """
        return retention.prune_manifests(self.store, keep, self.is_intact)

    def collect(self) -> retention.Collected:
        """Delete content objects no committed checkpoint references (see
        :func:`taskpoint.format.retention.collect`).

        Raises:
            CheckpointStoreError: the store failed.
        """
        return retention.collect(
            self.store, lambda: self.read_committed(strict=True),
            concurrency=self.store.transfer.concurrency,
        )
