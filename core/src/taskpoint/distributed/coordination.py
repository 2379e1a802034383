"""How the writers of one checkpoint talk: a small protocol, and a store-backed implementation.

A checkpoint written by several processes (:meth:`taskpoint.Checkpoint.save_part_sync`)
needs only three things from the processes' group: each one's rank, the world size, and an
all-gather of small JSON values with a timeout, and a broadcast from rank 0 (derived from
the all-gather unless an implementation has a better one).
:class:`Coordinator` is that protocol. Under ``torch.distributed``,
``taskpoint.distributed.torch_coordination.TorchCoordinator`` (re-exported by ``taskpoint_pytorch``)
implements it on the process group, and ``TorchrunCoordinator`` through torchrun's store
before a process group exists, both importing torch only when built; where neither is
available (Ray tasks, MPI, ``srun``), :class:`StoreCoordinator` implements it through the
store itself, so ``import taskpoint`` never imports a training framework.

Example (each of 4 processes, started by any launcher)::

    import taskpoint

    coord = taskpoint.StoreCoordinator(
        "s3://bucket/jobs/train-42", rank=rank, world_size=4, session=job_id, timeout=300,
    )
    ckpt = taskpoint.Checkpoint("s3://bucket/jobs/train-42")
    ckpt.save_part_sync(f"out/rank-{rank}", coordinator=coord)

:class:`StoreCoordinator` writes, for round ``n`` of a session, one record per rank at
``coordination/<session>/<n:06d>/<rank:06d>.json`` (``{"format", "rank", "world_size",
"value"}``) and lists that folder afresh (never trusting a cached listing) until every
rank's record is there. A broadcast's round holds rank 0's record alone, and the other
ranks wait for that one only, so a rank that died delays no one. Records are JSON, never
pickles, so a shared store cannot make a reader run code. Once every rank has entered an
all-gather's round, rank 0 removes the rounds before it (every rank has read them by then).
"""

from __future__ import annotations

import abc
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from taskpoint.errors import CheckpointCoordinationError, CheckpointError
from taskpoint.format.manifest import FORMAT_VERSION, loads_record
from taskpoint.store.store import RetryPolicy, Store, check_location

__all__ = ["COORDINATION", "Coordinator", "StoreCoordinator"]

log = logging.getLogger(__name__)

COORDINATION = "coordination"
"""The folder, under a :class:`StoreCoordinator`'s URL, that holds its sessions."""
_RECORD_RE = re.compile(r"^(\d{6,})\.json$")
_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Coordinator(abc.ABC):
    """The group of processes that write one checkpoint together.

    Implementations supply :attr:`rank`, :attr:`world_size` and :meth:`all_gather`; every
    rank must make the same calls in the same order. Values are small JSON values (dicts
    with str keys, lists, str, int, float, bool, None).
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank, from 0 to ``world_size - 1``."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """How many processes write the checkpoint."""

    @abc.abstractmethod
    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's ``value``, in rank order.

        Args:
            value: this rank's JSON value.
            timeout: seconds to wait for the other ranks; ``None``: the coordinator's own.

        Raises:
            CheckpointCoordinationError: a rank did not arrive within the timeout (naming
                it, where the implementation can tell), or the ranks disagree about the
                world size.
        """

    def close(self) -> None:
        """Release what the coordinator holds (a process group, a connection); idempotent.

        The coordinator must not gather afterwards. This base implementation holds nothing.
        """
        return None

    def broadcast(self, value: Any, *, timeout: float | None = None) -> Any:
        """Rank 0's ``value`` on every rank (the others' ``value`` is ignored).

        This base implementation is an :meth:`all_gather`, which waits for every rank;
        an implementation that can should wait for rank 0 alone (as
        :class:`StoreCoordinator` does), so a vanished rank does not keep rank 0's value
        from the others.

        Raises:
            CheckpointCoordinationError: rank 0 (or, in this base implementation, any
                rank) did not arrive within the timeout.
        """
        return self.all_gather(value if self.rank == 0 else None, timeout=timeout)[0]


class RankedCoordinator(Coordinator):
    """A :class:`Coordinator` whose rank and world size are fixed when it is built: the
    base of taskpoint's own implementations, which set ``_rank`` and ``_world``."""

    _rank: int
    _world: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    """``(rank, world_size)`` if they are ints with ``0 <= rank < world_size``.

    Raises:
        ValueError: either is not an int, ``world_size`` is below 1 or ``rank`` outside it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int of at least 1; got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int from 0 to world_size - 1 = {world_size - 1}; got {rank!r}")
    return rank, world_size


def check_timeout(timeout: object) -> float:
    """``timeout`` as a float if it is a positive number of seconds.

    Raises:
        ValueError: it is not a positive int or float.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    return float(timeout)


def check_wait(value: object, name: str) -> float | None:
    """``value`` as a float if it is a number of seconds of at least 0, or ``None`` (no
    limit): how long an adapter waits for an upload (its ``preempt_timeout``, say).

    Raises:
        ValueError: it is neither ``None`` nor an int or float of at least 0 (a bool, a
            negative number, NaN), naming ``name`` and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 or None; got {value!r}")
    return float(value)


def _odd_ones(values: Sequence[Hashable]) -> list[int]:
    """The ranks whose value differs from the one most ranks hold (rank 0's on a tie)."""
    tally = Counter(values)
    agreed = max(tally, key=lambda v: (tally[v], v == values[0]))
    return [rank for rank, value in enumerate(values) if value != agreed]


def check_agreement(
    urls: Sequence[str | None],
    worlds: Sequence[int | None],
    *,
    undone: str,
    ranks: Sequence[int | None] | None = None,
) -> None:
    """Raise unless every rank named the same checkpoint and the same world size.

    Called on every rank with what each rank sent (in rank order, as a gather returns it),
    so every rank raises the same error naming the same ranks.

    Args:
        urls: each rank's checkpoint URL (``None`` where it has none).
        worlds: each rank's world size; each must equal ``len(worlds)``, the ranks that
            took part.
        undone: what was not done, closing the message (``"Nothing was uploaded"``).
        ranks: each rank's own idea of its rank, if the ranks sent it; each must equal its
            place in the list.

    Raises:
        CheckpointCoordinationError: the URLs differ (naming the ranks whose URL differs
            from the one most ranks named, rank 0's on a tie), or a world size or rank is
            wrong (naming the ranks that sent it).
    """
    if len(set(urls)) > 1:
        listed = ", ".join(f"rank {r}: {u!r}" for r, u in enumerate(urls))
        raise CheckpointCoordinationError(
            f"ranks disagree about the checkpoint location ({listed}); every rank must name "
            f"the same checkpoint URL. {undone}",
            ranks=_odd_ones(urls),
        )
    size = len(worlds)
    claimed = list(range(size)) if ranks is None else list(ranks)
    wrong = [r for r in range(size) if worlds[r] != size or claimed[r] != r]
    if wrong:
        listed = ", ".join(
            f"rank {r}: world size {w!r}" + ("" if claimed[r] == r else f" as rank {claimed[r]!r}")
            for r, w in enumerate(worlds)
        )
        raise CheckpointCoordinationError(
            f"ranks disagree about the world size ({listed}; {size} ranks took part); every "
            f"rank must be started with the same world size and its own rank. {undone}",
            ranks=wrong,
        )


class StoreCoordinator(RankedCoordinator):
    """A :class:`Coordinator` that meets through a store: for jobs without a process group.

    Args:
        url: where the ranks meet (any location every rank can read and write; the
            checkpoint's own URL does). Its ``coordination/`` folder is used.
        rank: this process's rank.
        world_size: how many processes take part.
        session: a name unique to this incarnation of the group (a job id with its restart
            count, say): every rank of the group passes the same one, and a restarted group
            a new one, so it never reads an earlier incarnation's records.
        timeout: default seconds an :meth:`all_gather` waits for the other ranks. A save
            gathers after its upload, so this bounds how much longer the slowest rank's
            upload may take than the fastest's.
        poll: seconds between listings while waiting.
        storage_options: passed to the fsspec filesystem.
        retry: how store calls retry transient failures.

    Raises:
        ValueError: a bad ``rank``, ``world_size``, ``timeout``, ``poll`` or ``session``.
        TypeError: ``url`` is not a string or path.
    """

    def __init__(
        self,
        url: str,
        *,
        rank: int,
        world_size: int,
        session: str,
        timeout: float = 600.0,
        poll: float = 0.1,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        url = check_location("url", url)
        self._rank, self._world = check_rank(rank, world_size)
        self._timeout = check_timeout(timeout)
        self._poll = check_timeout(poll)
        if not isinstance(session, str) or not _SESSION_RE.fullmatch(session):
            raise ValueError(
                "session must be 1 to 128 letters, digits, '.', '_' or '-' (not starting "
                f"with a punctuation mark); got {session!r}"
            )
        self._session = session
        self._store = Store(url, storage_options, retry)
        self._round = 0
        self._removed = 0

    def __repr__(self) -> str:
        return (
            f"StoreCoordinator({self._store.url!r}, rank={self._rank}, "
            f"world_size={self._world}, session={self._session!r})"
        )

    def _folder(self, number: int) -> str:
        return f"{COORDINATION}/{self._session}/{number:06d}"

    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        limit = self._timeout if timeout is None else check_timeout(timeout)
        number = self._next_round()
        self._write(number, value)
        values = self._wait(number, {self._rank: value}, range(self._world), limit)
        if self._rank == 0:
            self._remove_before(number)
        return [values[r] for r in range(self._world)]

    def broadcast(self, value: Any, *, timeout: float | None = None) -> Any:
        """Rank 0's ``value`` on every rank, waiting for rank 0 alone.

        Rank 0 writes its record and returns at once; every other rank writes nothing and
        waits only for rank 0's record, so a rank that died meanwhile delays no one (an
        all-gather would wait for it, time out, and lose rank 0's value too).

        Raises:
            CheckpointCoordinationError: rank 0's record did not arrive within the timeout.
            TypeError: on rank 0, ``value`` is not a JSON value.
        """
        limit = self._timeout if timeout is None else check_timeout(timeout)
        number = self._next_round()
        if self._rank == 0:
            self._write(number, value)
            return value
        return self._wait(number, {}, (0,), limit)[0]

    def _next_round(self) -> int:
        number = self._round
        self._round += 1
        return number

    def _write(self, number: int, value: Any) -> None:
        """Store this rank's record of round ``number``."""
        try:
            record = json.dumps(
                {"format": FORMAT_VERSION, "rank": self._rank, "world_size": self._world,
                 "value": value},
                allow_nan=False,
            ).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"StoreCoordinator gathers JSON values only: {exc}") from exc
        self._store.write_atomic(f"{self._folder(number)}/{self._rank:06d}.json", record)

    def _wait(
        self, number: int, values: dict[int, Any], needed: Iterable[int], limit: float
    ) -> dict[int, Any]:
        """``values`` completed with the records of the ``needed`` ranks in round ``number``,
        listing its folder afresh (:meth:`Store.list`, never a cached listing) until they
        are all there.

        Raises:
            CheckpointCoordinationError: they were not all there after ``limit`` seconds.
        """
        folder = self._folder(number)
        wanted = set(needed)
        deadline = time.monotonic() + limit
        while True:
            for name in self._store.list(folder):
                match = _RECORD_RE.fullmatch(name)
                if match is None or int(match.group(1)) in values:
                    continue
                self._take(folder, name, values)
            missing = sorted(wanted - values.keys())
            if not missing:
                return values
            if time.monotonic() >= deadline:
                who = (
                    "rank 0 never broadcast its value" if wanted == {0}
                    else f"rank(s) {missing} of {self._world} never arrived"
                )
                raise CheckpointCoordinationError(
                    f"rank {self._rank} waited {limit:g}s at {self._store.url_of(folder)} "
                    f"and {who} (they failed, hang, or use another session or URL)",
                    ranks=missing,
                )
            time.sleep(self._poll)

    def _remove_before(self, number: int) -> None:
        """Rank 0, once every rank has entered round ``number``: remove the earlier rounds'
        records, which every rank has read by then (a broadcast's round is complete when
        its root has written it, so it goes with the next all-gather's)."""
        for earlier in range(self._removed, number):
            try:
                self._store.remove_tree(self._folder(earlier))
            except CheckpointError as exc:  # a leftover only costs a few bytes
                log.debug("could not remove %s: %s", self._folder(earlier), exc)
        self._removed = max(self._removed, number)

    def _take(self, folder: str, name: str, values: dict[int, Any]) -> None:
        key = f"{folder}/{name}"
        try:
            raw = loads_record(self._store.read_bytes(key))
        except FileNotFoundError:
            return
        except ValueError as exc:
            raise CheckpointCoordinationError(
                f"coordination record {self._store.url_of(key)} is not valid JSON: {exc}"
            ) from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("rank"), int):
            raise CheckpointCoordinationError(
                f"coordination record {self._store.url_of(key)} is not a rank's record"
            )
        rank, world = raw["rank"], raw.get("world_size")
        if world != self._world or not 0 <= rank < self._world:
            raise CheckpointCoordinationError(
                f"ranks disagree about the world size: rank {rank} says {world!r} and rank "
                f"{self._rank} says {self._world} (at {self._store.url_of(folder)}); every "
                "rank must be started with the same world size",
                ranks=sorted({rank, self._rank}),
            )
        values[rank] = raw.get("value")
