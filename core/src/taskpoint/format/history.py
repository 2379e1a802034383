"""The run history: what each attempt did and what each save cost, kept beside the checkpoints.

Records are small JSON objects under an action's ``attempts/`` folder, and one for the
action (a public contract, see the README's layout section); store format 1 readers ignore
the names they do not know::

    attempts/<n:06d>              the claim: {"format", "started", "pid", "host"}
    attempts/<n:06d>.resume.json  {"format", "at", "checkpoint", "restore_s", "size", "step"}
    attempts/<n:06d>.end.json     {"format", "ended", "outcome", "error", "step",
                                   "preemption_save", "traceback", "noted_by",
                                   "blocked_s", "saves"}
    attempts/<n:06d>.interval.json  {"format", "at", "every", "interval_s", "rule",
                                   "save_cost_s", "mtbf_s", "failures", "observed_s",
                                   "prior_s"}
    status.json                   {"format", "state", "attempts", "finished"}

``outcome`` is ``"succeeded"``, ``"failed"``, ``"preempted"`` or ``"crashed"`` (the attempt's
process died: a signal or an exit without an outcome). ``step`` is a training step as
reported with :func:`taskpoint.report_step` (``null`` when none was): in an end record the
step the attempt reached, in a resume record the step of the checkpoint it loaded; the
difference between one attempt's end and the next one's resume is the work the failure
cost. The interval record (optional) says how often the attempt saved by time: the
interval last chosen (``every`` is the seconds asked for, or ``"auto"``) and what it was chosen
from (see :class:`taskpoint.IntervalChoice`); it is rewritten when the choice changes.
``preemption_save`` (``"committed"`` or ``"missed"``) says, for an attempt that
received a preemption signal, whether a save made after the signal committed.
``traceback`` (optional) is the error's traceback, at most :data:`TRACEBACK_CHARS` characters
(the middle of a longer one is left out). ``blocked_s`` and ``saves`` (optional) total the
attempt's saves committed by the time the record was written: how many, and the seconds
training waited inside them (each save's ``blocked_s`` as :class:`SaveStats` reports it to
``on_commit`` listeners), so the run's cost stays known after retention deletes those
manifests. An attempt whose process ended without an end
record (killed by SIGKILL or out of memory, or lost with its node) is recorded by the
attempt that claims a number after it: ``outcome`` ``"crashed"``, ``ended`` ``null`` (the
time of death is not known) and ``noted_by``, the attempt that noticed. What a save cost is recorded in its
manifest's ``stats`` object and handed to :meth:`taskpoint.Checkpoint.on_commit` listeners as
a :class:`SaveStats`. An :class:`Attempt` is one :class:`taskpoint.Checkpoint`'s attempt:
its number, claimed from the store when it starts or at its first save unless its runner
gave one, the numbers of its saves, and the records it writes.

Records are informational: writing one is best effort (a failure is logged, never raised, so
it cannot hide the task's own outcome), and a garbage record reads as unknown fields.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from taskpoint.errors import CheckpointError, CheckpointStoreError
from taskpoint.format.manifest import (
    CHECKPOINTS,
    FORMAT_VERSION,
    Manifest,
    check_format,
    loads_record,
    parse_manifest_name,
)
from taskpoint.store.store import Store

__all__ = [
    "ATTEMPTS",
    "OUTCOMES",
    "STATUS",
    "TRACEBACK_CHARS",
    "Attempt",
    "AttemptRecord",
    "PreemptionSave",
    "SaveStats",
    "attempt_numbers",
    "claim_attempt",
    "finite_number",
    "log_resume",
    "note_unended",
    "process_started",
    "read_attempts",
    "read_status",
    "record_end",
    "record_finished",
    "record_interval",
    "record_resume",
    "resume_line",
    "steps_lost",
    "trim_traceback",
]

log = logging.getLogger(__name__)

ATTEMPTS = "attempts"
"""The folder, under a checkpoint's URL, that holds the attempt records."""
STATUS = "status.json"
"""The object, under a checkpoint's URL, that records how the action finished."""

Outcome = Literal["succeeded", "failed", "preempted", "crashed"]
OUTCOMES: tuple[Outcome, ...] = ("succeeded", "failed", "preempted", "crashed")
PreemptionSave = Literal["committed", "missed"]

_CLAIM_RE = re.compile(r"^\d{6,}$")
_RESUME = ".resume.json"
_END = ".end.json"
_INTERVAL = ".interval.json"
_MAX_CLAIM_TRIES = 1000
TRACEBACK_CHARS = 16_000
"""The most characters of a traceback an end record keeps."""
_TRACEBACK_HEAD = 2_000


@dataclass(frozen=True)
class SaveStats:
    """What one committed save cost.

    Attributes:
        url: the committed manifest's URL.
        attempt: the attempt that committed it.
        seq: its save number within the attempt.
        kind: ``"bytes"``, ``"file"`` or ``"directory"``.
        size: stored payload bytes.
        uploaded: bytes this save sent to the store.
        reused: bytes the store already held and this save did not send.
        save_s: seconds from the save call to the commit.
        upload_s: seconds spent writing the payload and the manifest.
        blocked_s: seconds the caller of ``save``/``save_sync`` waited: the whole save when
            blocking, the snapshot when ``background=True``.
        background: whether the save ran in the background.
        coalesced: how many background saves asked for since the previous commit were
            replaced by a newer one (this one, or one it replaced) while they waited behind
            an upload, and so never uploaded (see :class:`taskpoint.Checkpoint`'s
            ``when_busy``).
    """

    url: str
    attempt: int
    seq: int
    kind: str
    size: int
    uploaded: int
    reused: int
    save_s: float
    upload_s: float
    blocked_s: float
    background: bool
    coalesced: int = 0

    def to_record(self) -> dict[str, Any]:
        """The manifest's ``stats`` object (``coalesced`` only when some were)."""
        record: dict[str, Any] = {
            "save_s": round(self.save_s, 6),
            "upload_s": round(self.upload_s, 6),
            "uploaded": self.uploaded,
            "reused": self.reused,
            "blocked_s": round(self.blocked_s, 6),
            "background": self.background,
        }
        if self.coalesced:
            record["coalesced"] = self.coalesced
        return record


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt as its records describe it; fields its records lack are ``None``.

    Attributes:
        attempt: the attempt number.
        started: Unix time (seconds) of its claim.
        process_started: Unix time (seconds) the claiming process started (``None`` where
            the platform does not say, and in records of older versions): the end, at the
            latest, of an attempt before it that died without an end record.
        pid: the process id that claimed it.
        host: the host name that claimed it.
        ended: Unix time (seconds) it ended.
        outcome: how it ended (see :data:`OUTCOMES`).
        error: the error that ended it, as text.
        resumed_from: the manifest key of the checkpoint it loaded.
        resumed_at: Unix time (seconds) the load finished.
        restore_s: seconds the load kept the attempt waiting (the restore, or what of it a
            prefetch had not done when the load asked for it).
        restored_size: stored bytes of the checkpoint it loaded.
        step: the training step it had reached when it ended (the last one reported
            with :func:`taskpoint.report_step`).
        resumed_step: the step of the checkpoint it loaded.
        preemption_save: for an attempt that received a preemption signal, whether a
            save made after the signal committed (``"committed"``) or not (``"missed"``).
        traceback: the traceback of the error that ended it (at most
            :data:`TRACEBACK_CHARS` characters).
        noted_by: for an attempt whose process died without writing its end record, the
            attempt that found it so and wrote the record in its place.
        interval: the save interval it last chose by time, as its interval record holds it
            (:meth:`taskpoint.IntervalChoice.to_record`); ``None`` when it saved by steps only.
        blocked_s: seconds training waited inside the attempt's committed saves, as its end
            record totals them (``None`` in records of older versions and of died attempts).
        saves: how many saves the attempt committed, as its end record counts them.
        unreadable: ``(record key, error)`` for each of its records the store could not
            read (its fields read as unknown).
    """

    attempt: int
    started: float | None = None
    process_started: float | None = None
    pid: int | None = None
    host: str | None = None
    ended: float | None = None
    outcome: str | None = None
    error: str | None = None
    resumed_from: str | None = None
    resumed_at: float | None = None
    restore_s: float | None = None
    restored_size: int | None = None
    step: int | None = None
    resumed_step: int | None = None
    preemption_save: str | None = None
    traceback: str | None = None
    noted_by: int | None = None
    interval: dict[str, Any] | None = None
    blocked_s: float | None = None
    saves: int | None = None
    unreadable: tuple[tuple[str, str], ...] = ()

    @property
    def died(self) -> bool:
        """Whether its process died without recording its end (a later attempt did)."""
        return self.noted_by is not None


def _claim_key(attempt: int) -> str:
    return f"{ATTEMPTS}/{attempt:06d}"


def _record(**fields: Any) -> bytes:
    return json.dumps({"format": FORMAT_VERSION, **fields}).encode()


def attempt_numbers(store: Store) -> list[int]:
    """The claimed attempt numbers, ascending.

    Raises:
        CheckpointStoreError: the store failed.
    """
    return sorted(int(name) for name in store.list(ATTEMPTS) if _CLAIM_RE.match(name))


def process_started() -> float | None:
    """Unix time (seconds) this process started, from Linux's ``/proc``; ``None``
    elsewhere or where it cannot be read. Its interpreter start, imports and restore come
    after it: a claim records it so that the attempt before, if it died unrecorded, is
    known to have ended by then rather than at this claim."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])  # starttime, field 22
        with open("/proc/uptime", "rb") as uptime:
            since_boot = float(uptime.read().split()[0])
        return time.time() - max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def claim_attempt(store: Store, first: int) -> int:
    """Claim the lowest free attempt number from ``first`` on, atomically.

    Two processes claiming at once never get the same number: the claim is an exclusive
    create (see :meth:`Store.create_exclusive`).

    Raises:
        CheckpointStoreError: the store failed, or no number could be claimed.
    """
    attempt = first
    for _ in range(_MAX_CLAIM_TRIES):
        record = _record(
            started=time.time(), process_started=process_started(), pid=os.getpid(),
            host=socket.gethostname(),
        )
        if store.create_exclusive(_claim_key(attempt), record):
            return attempt
        attempt += 1
    raise CheckpointStoreError(
        f"could not claim an attempt number at {store.url} after {_MAX_CLAIM_TRIES} tries",
        url=store.url,
    )


def newest_claim_since(store: Store, since: float, running_at: float) -> int | None:
    """The newest attempt, when its claim was made at ``since`` (Unix time) or later and it
    had not ended by ``running_at``, else ``None``; best effort (a store failure reads as
    none).

    For a process that follows another's claim instead of making its own (a job's other
    ranks follow its leading one): an attempt that ended before the process started belongs
    to an earlier life."""
    try:
        names = set(store.list(ATTEMPTS))
    except CheckpointError:
        return None
    taken = sorted(int(name) for name in names if _CLAIM_RE.match(name))
    if not taken:
        return None
    key = _claim_key(taken[-1])
    started = finite_number(_read(store, key, names)[0].get("started"))
    ended = finite_number(_read(store, f"{key}{_END}", names)[0].get("ended"))
    if started is None or started < since or (ended is not None and ended < running_at):
        return None
    return taken[-1]


def mark_attempt(store: Store, attempt: int) -> None:
    """Record that ``attempt`` (numbered by its runner) started; best effort."""
    record = _record(started=time.time(), pid=os.getpid(), host=socket.gethostname())
    _best_effort(store, _claim_key(attempt), record)


def record_resume(store: Store, attempt: int, manifest: Manifest, restore_s: float) -> None:
    """Record that ``attempt`` resumed from ``manifest``; best effort."""
    record = _record(
        at=time.time(), checkpoint=manifest.key, restore_s=round(restore_s, 6), size=manifest.size,
        step=manifest.step,
    )
    _best_effort(store, f"{_claim_key(attempt)}{_RESUME}", record)


def record_end(
    store: Store,
    attempt: int,
    outcome: Outcome,
    error: str | None = None,
    *,
    step: int | None = None,
    preemption_save: PreemptionSave | None = None,
    traceback: str | None = None,
    totals: tuple[float, int] | None = None,
) -> None:
    """Record how ``attempt`` ended, at which training ``step``, for a preempted one
    whether its preemption save committed, the ``traceback`` of its error (cut to
    :data:`TRACEBACK_CHARS` characters) and ``totals``, the seconds training waited inside
    its committed saves and how many there were (``blocked_s``, ``saves``); best effort.

    Raises:
        ValueError: ``outcome`` is not one of :data:`OUTCOMES`.
    """
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}; got {outcome!r}")
    fields: dict[str, Any] = {}
    if totals is not None:
        fields = {"blocked_s": round(totals[0], 6), "saves": totals[1]}
    record = _record(
        ended=time.time(), outcome=outcome, error=error, step=step,
        preemption_save=preemption_save,
        traceback=None if traceback is None else trim_traceback(traceback), **fields,
    )
    _best_effort(store, f"{_claim_key(attempt)}{_END}", record)


def record_interval(store: Store, attempt: int, choice: dict[str, Any]) -> None:
    """Record the save interval ``attempt`` chose and its inputs (``choice``: JSON-ready
    fields, :meth:`taskpoint.IntervalChoice.to_record`), replacing the one recorded before;
    best effort."""
    _best_effort(store, f"{_claim_key(attempt)}{_INTERVAL}", _record(at=time.time(), **choice))


def trim_traceback(text: str) -> str:
    """``text`` cut to at most :data:`TRACEBACK_CHARS` characters: its start (where the
    traceback begins) and its end (the innermost frames and the error), with a line saying
    how much of the middle was left out."""
    if len(text) <= TRACEBACK_CHARS:
        return text
    tail = TRACEBACK_CHARS - _TRACEBACK_HEAD - 80
    cut = len(text) - _TRACEBACK_HEAD - tail
    return (
        f"{text[:_TRACEBACK_HEAD]}\n... ({cut} characters left out) ...\n{text[-tail:]}"
    )


DIED = "no end record: killed (SIGKILL, out of memory) or lost with its node"
"""The error text of an end record another attempt wrote for an attempt that died."""


def note_unended(store: Store, by: int, names: set[str] | None = None) -> list[int]:
    """Record, for each attempt before ``by`` whose process ended without an end record,
    that it died (``outcome`` ``"crashed"``, ``noted_by`` ``by``); best effort.

    An attempt whose claim names a live process on this host (another writer of the same
    action in this process or beside it) is left alone: it has not ended.

    Args:
        store: the action's location.
        by: the attempt that notes them.
        names: the ``attempts/`` folder's names, when the caller listed it just before (a
            claim does): not listed again. An attempt claimed since is left for the next.

    Returns:
        The attempts recorded as died.
    """
    if names is None:
        try:
            names = set(store.list(ATTEMPTS))
        except CheckpointError as exc:
            log.warning("could not list the run records at %s: %s", store.url, exc)
            return []
    unended = sorted(
        int(name) for name in names
        if _CLAIM_RE.match(name) and int(name) < by and f"{name}{_END}" not in names
    )
    noted = []
    for attempt in unended:
        claim = _read(store, _claim_key(attempt), names)[0]
        if _alive_here(claim):
            continue
        record = _record(
            ended=None, outcome="crashed", error=f"{DIED}; noted by attempt {by}",
            step=None, preemption_save=None, noted_by=by,
        )
        try:
            created = store.create_exclusive(f"{_claim_key(attempt)}{_END}", record)
        except CheckpointError as exc:
            log.warning("could not record attempt %d at %s as died: %s", attempt, store.url, exc)
            continue
        if created:
            noted.append(attempt)
    if noted:
        log.info(
            "%s: attempt%s %s ended without an end record (killed, or lost with its node); "
            "recorded as died", store.url, "s" if len(noted) > 1 else "",
            ", ".join(map(str, noted)),
        )
    return noted


def _alive_here(claim: dict[str, Any]) -> bool:
    """Whether ``claim`` names a process that still runs on this host."""
    pid = _integer(claim.get("pid"))
    if pid is None or pid <= 0 or claim.get("host") != socket.gethostname():
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return _zombie(pid) is not True


def _zombie(pid: int) -> bool | None:
    """Whether ``pid`` is a zombie (ended, not yet reaped); ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return bool(fields) and fields[0] == b"Z"


def _best_effort(store: Store, key: str, data: bytes) -> None:
    try:
        store.write_atomic(key, data)
    except CheckpointError as exc:
        log.warning("could not write the run record %s: %s", store.url_of(key), exc)


def record_finished(store: Store, state: str, attempts: int) -> None:
    """Record that the action ended as ``state`` after ``attempts``; best effort."""
    record = _record(state=state, attempts=attempts, finished=time.time())
    try:
        store.write_atomic(STATUS, record)
    except CheckpointError as exc:
        log.warning("could not record %s as %s: %s", store.url, state, exc)


def read_status(store: Store) -> dict[str, Any] | None:
    """The record :func:`record_finished` wrote, or ``None`` while the action is unfinished.

    Raises:
        CheckpointStoreError: the store failed.
        CheckpointFormatError: a newer taskpoint wrote the record.
    """
    try:
        raw = loads_record(store.read_bytes(STATUS))
    except (FileNotFoundError, ValueError):
        return None
    check_format(raw, url=store.url_of(STATUS))
    return raw if isinstance(raw, dict) else None


class Attempt:
    """One checkpoint's attempt at its location: its number, its saves' numbers, its records.

    Args:
        store: the checkpoint location.
        number: the attempt number its runner gave; ``None`` claims the next free number
            from the store at the first save (:meth:`claim`), so two restarts never share
            one.
    """

    def __init__(self, store: Store, number: int | None = None) -> None:
        self.store = store
        self.number = number
        """The attempt number; ``None`` until claimed."""
        self._seq_base: int | None = None
        self._resumed: tuple[Manifest, float] | None = None  # recorded once claimed
        self._blocked_s = 0.0  # the totals of its commits, for its end record
        self._saves = 0
        self._claiming = threading.Lock()  # one claim at a time (see claim_soon)
        self._pid = os.getpid()  # a fork's child makes its own lock: a claim may hold this
        self._history: tuple[int, list[AttemptRecord]] | None = None  # (pid, the first read)

    def claim(self) -> int:
        """The attempt number, claimed from the store first if it has none yet.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a newer taskpoint wrote the newest attempt's claim.
        """
        with self._lock():
            if self.number is None:
                names = set(self.store.list(ATTEMPTS))
                taken = sorted(int(name) for name in names if _CLAIM_RE.match(name))
                if taken:
                    self._check_marker(taken[-1])
                number = claim_attempt(self.store, taken[-1] + 1 if taken else 0)
                self.number = number
                note_unended(self.store, number, names)
                if self._resumed is not None:
                    record_resume(self.store, number, *self._resumed)
            return self.number

    def _lock(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._claiming, self._pid = threading.Lock(), os.getpid()
        return self._claiming

    def claim_soon(self) -> None:
        """Start claiming the attempt number on a thread if it has none yet, so that a save
        about to need it (a background save taking its snapshot) finds it claimed. A
        failure is left to the next :meth:`claim`, which tries again and raises it."""
        if self.number is not None or self._lock().locked():
            return

        def run() -> None:
            try:
                self.claim()
            except Exception as exc:  # the save's own claim raises it
                log.debug("%s: claiming the attempt early failed: %s", self.store.url, exc)

        threading.Thread(target=run, name="taskpoint-claim", daemon=True).start()

    def history(self) -> list[AttemptRecord]:
        """The run's attempt records as this process first read them through this attempt
        (:func:`read_attempts`), read now the first time: the resume line and an automatic
        save interval share one read. Never on a thread of its own while a restore may
        still set the random states (a store client may draw on Python's global random
        numbers): an automatic interval reads it on one at its first save, after the
        restore.

        Raises:
            CheckpointStoreError: the store failed to list the records.
        """
        held = self._history if self.history_read() else None
        if held is None:
            held = self._history = (os.getpid(), read_attempts(self.store))
        return list(held[1])

    def history_read(self) -> bool:
        """Whether :meth:`history` answers without reading the store (this process read
        the records already)."""
        held = self._history
        return held is not None and held[0] == os.getpid()

    def _check_marker(self, attempt: int) -> None:
        """Refuse to add an attempt to an action a newer taskpoint has written to."""
        key = _claim_key(attempt)
        try:
            record = loads_record(self.store.read_bytes(key))
        except (FileNotFoundError, ValueError):
            return  # a marker is a name first; its content is informational
        check_format(record, url=self.store.url_of(key))

    def next_save(self, ticket: int) -> tuple[int, int]:
        """The attempt and save number of the save given ``ticket`` (the checkpoint's count
        of saves begun), claiming the attempt first if need be; with the save lock held.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a newer taskpoint wrote the newest attempt's claim.
        """
        attempt = self.claim()
        if self._seq_base is None:
            seqs = [
                order[1]
                for order in map(parse_manifest_name, self.store.list(CHECKPOINTS))
                if order is not None and order[0] == attempt
            ]
            self._seq_base = max(seqs, default=-1) + 1
        return attempt, self._seq_base + ticket

    def started(self) -> None:
        """Record that the attempt started: claim a number from the store first if its
        runner gave none, else write the claim record for the number it gave (best effort).
        Either way, earlier attempts that died without an end record are recorded as
        such (:func:`note_unended`).

        Raises:
            CheckpointStoreError: the store failed while claiming a number.
            CheckpointFormatError: a newer taskpoint wrote the newest attempt's claim.
        """
        if self.number is None:
            self.claim()
            return
        mark_attempt(self.store, self.number)
        note_unended(self.store, self.number)

    def committed(self, stats: SaveStats) -> None:
        """Count a save this attempt committed (``stats``) into its end record's totals; a
        commit of another attempt is not counted."""
        if stats.attempt == self.number:
            self._blocked_s += max(0.0, stats.blocked_s)
            self._saves += 1

    def ended(
        self,
        outcome: Outcome,
        error: str | None = None,
        *,
        step: int | None = None,
        preemption_save: PreemptionSave | None = None,
        traceback: str | None = None,
    ) -> None:
        """Record how the attempt ended, if it has a number, with the totals of the saves
        it committed (:meth:`committed`); best effort.

        Raises:
            ValueError: ``outcome`` is not one of :data:`OUTCOMES`.
        """
        if self.number is not None:
            record_end(
                self.store, self.number, outcome, error, step=step,
                preemption_save=preemption_save, traceback=traceback,
                totals=(self._blocked_s, self._saves),
            )

    def resumed(self, manifest: Manifest, restore_s: float) -> None:
        """Record that the attempt resumed from ``manifest``: now, or once it is claimed."""
        with self._lock():  # a claim on another thread records it when it is done
            if self.number is None:
                self._resumed = (manifest, restore_s)
                return
        record_resume(self.store, self.number, manifest, restore_s)


def steps_lost(failed: AttemptRecord, resumed_step: int | None) -> int | None:
    """Training steps between where ``failed`` ended and the step the next attempt resumed
    at (``resumed_step``; ``None``: it started over, at 0), or ``None`` when ``failed``
    reported no step."""
    if failed.step is None:
        return None
    return max(0, failed.step - (resumed_step or 0))


def resume_line(
    manifest: Manifest, attempt: int | None, earlier: list[AttemptRecord]
) -> str:
    """The line a resume logs: the step resumed at, and for the attempt before it, the
    step it failed at and the steps lost (each where known).

    Args:
        manifest: the checkpoint loaded.
        attempt: the loading attempt's number, ``None`` while unclaimed.
        earlier: the action's attempt records (:func:`read_attempts`).
    """
    at = "an unknown step" if manifest.step is None else f"step {manifest.step}"
    line = f"resuming at {at} from save {manifest.seq} of attempt {manifest.attempt}"
    before = [r for r in earlier if attempt is None or r.attempt < attempt]
    ended = [r for r in before if r.outcome is not None and r.outcome != "succeeded"]
    if ended:
        last = ended[-1]
        lost = steps_lost(last, manifest.step)
        line += f"; attempt {last.attempt} {'died' if last.died else last.outcome}"
        if last.step is not None:
            line += f" at step {last.step}: {lost} step{'' if lost == 1 else 's'} lost"
    return line


def log_resume(attempt: Attempt, manifest: Manifest) -> None:
    """Log :func:`resume_line` for ``attempt``'s load of ``manifest`` at INFO, from the
    records :meth:`Attempt.history` gives; best effort."""
    if not log.isEnabledFor(logging.INFO):
        return
    try:
        earlier = attempt.history()
    except CheckpointError:
        earlier = []
    log.info("%s: %s", attempt.store.url, resume_line(manifest, attempt.number, earlier))


def read_attempts(store: Store) -> list[AttemptRecord]:
    """Every attempt the records name, ascending; garbage or unreadable records read as
    unknown fields (an unreadable one is named in :attr:`AttemptRecord.unreadable`).

    The records are read concurrently (up to the store's transfer concurrency): a run that
    restarted hundreds of times has four records per attempt, and read one by one they
    took a round trip each.

    Raises:
        CheckpointStoreError: the store failed to list the records.
    """
    names = set(store.list(ATTEMPTS))
    numbers: set[int] = set()
    for name in names:
        stem = name.removesuffix(_RESUME).removesuffix(_END)
        if _CLAIM_RE.match(stem):
            numbers.add(int(stem))
    suffixes = ("", _RESUME, _END, _INTERVAL)
    read = _read_all(store, [f"{_claim_key(n)}{end}" for n in numbers for end in suffixes], names)
    records = []
    for attempt in sorted(numbers):
        key = _claim_key(attempt)
        claim, resume, end, interval = (read[f"{key}{suffix}"][0] for suffix in suffixes)
        unreadable = [
            (f"{key}{suffix}", why) for suffix in suffixes
            if (why := read[f"{key}{suffix}"][1]) is not None
        ]
        outcome = end.get("outcome")
        records.append(
            AttemptRecord(
                attempt=attempt,
                started=finite_number(claim.get("started")),
                process_started=finite_number(claim.get("process_started")),
                pid=_integer(claim.get("pid")),
                host=_text(claim.get("host")),
                ended=finite_number(end.get("ended")),
                outcome=outcome if outcome in OUTCOMES else None,
                error=_text(end.get("error")),
                resumed_from=_text(resume.get("checkpoint")),
                resumed_at=finite_number(resume.get("at")),
                restore_s=finite_number(resume.get("restore_s")),
                restored_size=_integer(resume.get("size")),
                step=_step(end.get("step")),
                resumed_step=_step(resume.get("step")),
                preemption_save=_text(end.get("preemption_save")),
                traceback=_text(end.get("traceback")),
                noted_by=_integer(end.get("noted_by")),
                interval=_interval(interval),
                blocked_s=_seconds(end.get("blocked_s")),
                saves=_step(end.get("saves")),
                unreadable=tuple(unreadable),
            )
        )
    return records


def _read_all(
    store: Store, keys: list[str], names: set[str]
) -> dict[str, tuple[dict[str, Any], str | None]]:
    """Each of ``keys`` read as :func:`_read` reads it, on up to the store's transfer
    concurrency of threads, or on this one where no thread can start (at interpreter exit)."""
    present = [key for key in keys if key.rpartition("/")[2] in names]
    read: dict[str, tuple[dict[str, Any], str | None]] = dict.fromkeys(keys, ({}, None))
    if not present:
        return read
    workers = min(len(present), store.transfer.concurrency)  # both at least 1
    with ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-records") as pool:
        futures = {}
        for key in present:
            try:
                futures[key] = pool.submit(_read, store, key, names)
            except RuntimeError:  # no new thread: the interpreter is exiting (an end
                read[key] = _read(store, key, names)  # record at exit), or none starts
        read.update((key, future.result()) for key, future in futures.items())
    return read


def _read(store: Store, key: str, names: set[str]) -> tuple[dict[str, Any], str | None]:
    """The record ``key``: ``(record, None)``, or ``({}, why)`` when the store could not
    read it; ``({}, None)`` for one not among ``names`` (the listing) or not a JSON object."""
    if key.rpartition("/")[2] not in names:
        return {}, None
    try:
        raw = loads_record(store.read_bytes(key))
    except (FileNotFoundError, ValueError):
        return {}, None
    except CheckpointStoreError as exc:  # one unreadable record (a folder, say), not the rest
        return {}, str(exc)
    return (raw if isinstance(raw, dict) else {}), None


def finite_number(value: object) -> float | None:
    """``value`` as a float when it is a finite JSON number, else ``None``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _interval(record: dict[str, Any]) -> dict[str, Any] | None:
    """An interval record's fields (without ``format``), or ``None`` for none or garbage
    (a record without a finite ``interval_s``)."""
    if finite_number(record.get("interval_s")) is None:
        return None
    return {k: v for k, v in record.items() if k != "format"}
def _seconds(value: object) -> float | None:
    number = finite_number(value)
    return number if number is not None and number >= 0 else None


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step(value: object) -> int | None:
    step = _integer(value)
    return step if step is not None and step >= 0 else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
