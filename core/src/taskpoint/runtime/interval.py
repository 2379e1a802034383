"""How often to save: every N seconds of training, or an interval chosen from the job's costs.

A framework counts saves in steps or epochs; what a failure costs is counted in time. A
:class:`SaveInterval` answers "is a save due now?" at each step boundary, by one of two
rules:

- a fixed time: ``SaveInterval(600)`` saves once 600 s of training have passed since the
  last save took its state (the work a failure can lose);
- ``SaveInterval("auto")``: the interval follows Young and Daly's first-order optimum,
  ``sqrt(2 x C x M)``, from the cost ``C`` of a save as training sees it (seconds the step
  waited on the save, plus the seconds the upload running beside training took from the
  steps it overlapped) and the run's mean time ``M`` between failures that lose work, read
  from the run's own history (:func:`mean_time_between_failures`). Until the run has
  failed, ``M`` leans on a prior (:data:`MTBF_PRIOR_S`, ``TASKPOINT_MTBF_PRIOR_S`` or the
  argument); from its first failure on, on the run's own rate alone. The result is kept
  within two bounds: while ``M`` rests on the prior, saves take at most ``max_overhead`` of
  training time (2% by default), so a guessed failure rate cannot make the job save
  often; and the interval never exceeds ``max_interval_s``, which wins where the two
  disagree (a failure that loses an hour costs more than a save). Once the run has failed,
  the overhead bound no longer holds: Young/Daly's interval is then the one that wastes
  least in saves and lost work together, and raising it to keep saves under 2% would lose
  more in recomputed steps than it saves (a job whose failures come every few minutes
  pays more than 2% either way).

Nor does an automatic interval fall below the time a background save takes from its call to
its commit (measured from the checkpoint's commits): a save asked for while the one before
still uploads only replaces the one queued behind it, so saving more often than uploads
commit adds snapshots and upload work but commits no sooner.

A run's first save is due at once, to measure what a save costs. A resumed run starts from
the cost its newest earlier attempt recorded (its interval record), so it does not upload
again the state it has just restored; its own saves' costs take over from there. A resumed
life reads the run's records on a thread, so its first save call does not wait for them;
no timed save is due until they are in.

Each new measurement (a committed save's cost, a failure in the history) recomputes the
interval; :attr:`SaveInterval.choice` says what was chosen and from what, and every change
is logged at INFO. A failure that a preemption save covered (a SIGTERM with its grace
period, the save committed) loses no work and does not count towards ``M``: with a
preemption warning, the interval only matters for the failures that come without one.

The clock is :func:`time.monotonic` unless given; under several ranks each rank holds a
:class:`SaveInterval` and the adapter passes its collective to :meth:`SaveInterval.due`
(``agree``), which hands rank 0's answer to every rank (one call), so every rank saves at
the same step.

Example (an adapter's loop; ``taskpoint_pytorch`` and ``taskpoint_sklearn`` do this for
``every_s=``)::

    interval = SaveInterval.for_checkpoint(checkpoint, "auto")
    for step in range(start, steps):
        train_step(step)
        interval.step_done()
        if interval.due():
            began = time.monotonic()
            checkpoint.save_sync(state, background=True)
            interval.saved(blocked_s=time.monotonic() - began, background=True)

:meth:`SaveInterval.for_checkpoint` reads the run's history from a
:class:`taskpoint.Checkpoint`'s store and listens to its commits, so a background upload
counts until it commits; the choice is recorded in the attempt's records and shown by
``taskpoint show``, and :meth:`IntervalChoice.metrics` gives it as ``taskpoint/*`` figures.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from taskpoint._env import seconds_from_env
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.checkpoint.mirror import PREFIX
from taskpoint.errors import CheckpointError
from taskpoint.format.history import AttemptRecord, SaveStats, finite_number

__all__ = [
    "ENV_MTBF_PRIOR",
    "MAX_INTERVAL_S",
    "MAX_OVERHEAD",
    "MTBF_PRIOR_S",
    "IntervalChoice",
    "SaveInterval",
    "SaveSchedule",
    "TimedSaves",
    "check_every",
    "mean_time_between_failures",
    "young_daly",
]

log = logging.getLogger(__name__)

MTBF_PRIOR_S = 4 * 3600.0
"""The mean time between failures (seconds) assumed for a run that has not failed yet: four
hours, between on-demand machines (days) and spot instances in a busy zone (an hour or
less). After ``T`` seconds of failure-free training the estimate is ``MTBF_PRIOR_S + T``;
after ``n >= 1`` failures in ``T`` seconds it is the run's own ``T / n``, the prior set
aside (a run that fails knows its failure rate better than a platform's figure does)."""
ENV_MTBF_PRIOR = "TASKPOINT_MTBF_PRIOR_S"
"""The environment variable that sets the prior, in seconds (a platform's figure: a spot
fleet's mean time to reclaim, a cluster's mean time between node losses)."""
MAX_OVERHEAD = 0.02
"""The largest share of training time that automatic saves may cost (2%)."""
MAX_INTERVAL_S = 3600.0
"""The longest automatic interval, in seconds (one hour)."""

_LOSSES = frozenset({"failed", "crashed", "died"})
_EWMA = 0.2  # weight of the newest sample in the running step-time and cost estimates
_RECORD_CHANGE = 0.1  # how far the interval moves before its record is rewritten
_MIN_OBSERVED_S = 1.0  # a history of failures that lasted no time still has a rate


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """Young and Daly's first-order optimal interval between saves, in seconds:
    ``sqrt(2 x cost_s x mtbf_s)``; 0 for a save that costs nothing.

    Raises:
        ValueError: either argument is negative or not finite.
    """
    for name, value in (("cost_s", cost_s), ("mtbf_s", mtbf_s)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0; got {value!r}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def _lost_work(record: AttemptRecord, current: int | None) -> bool:
    """Whether the attempt ended in a failure that lost work (the current one has not ended)."""
    if record.attempt == current:
        return False
    if record.outcome == "preempted":
        return record.preemption_save != "committed"
    return record.outcome is None or record.outcome in _LOSSES


def mean_time_between_failures(
    history: Sequence[AttemptRecord],
    *,
    prior_s: float = MTBF_PRIOR_S,
    now: float | None = None,
    current: int | None = None,
) -> tuple[float, int, float]:
    """The run's mean time between failures that lose work, from its attempt records.

    Each attempt counts its training time: from the end of its restore (its claim when it
    loaded nothing) to its end record; one without an end record (a process killed
    outright, a node lost) to the start of the next attempt's process (its claim where the
    record does not say), and the ``current`` one to ``now``. The interval trades saves against training lost, so the seconds that count
    are training's: a restore's or a restart's do not scale with the job's length. A failure loses work when the attempt failed, crashed or
    died, or was preempted without a committed preemption save.

    Before the first such failure the estimate is ``prior_s`` plus the seconds observed
    (the prior counts as one failure, so a long failure-free run drifts above it); from
    the first on, the seconds observed over the failures (the run's own rate, which a
    prior weighing as hours would hide for hundreds of failures at a rate of one a minute).

    Args:
        history: the run's attempt records (:func:`taskpoint.format.history.read_attempts`), in
            any order.
        prior_s: the prior mean time between failures, in seconds.
        now: Unix time for the ``current`` attempt's end (default: now).
        current: the attempt now running, if it is in ``history``.

    Returns:
        ``(mtbf_s, failures, observed_s)``: the estimate in seconds, the failures counted
        and the seconds of attempts observed.

    Raises:
        ValueError: ``prior_s`` is not a positive finite number.
    """
    if not (math.isfinite(prior_s) and prior_s > 0):
        raise ValueError(f"prior_s must be a positive number of seconds; got {prior_s!r}")
    now = time.time() if now is None else now
    records = sorted(history, key=lambda r: r.attempt)
    observed, failures = 0.0, 0
    for index, record in enumerate(records):
        if record.started is None:
            continue
        begin = record.started
        if record.resumed_at is not None and record.resumed_at > begin:
            begin = record.resumed_at  # training time: the restore before it risked no work
        end = record.ended
        if end is None and record.attempt == current:
            end = now
        if end is None:  # died unrecorded: by the next process's start, else its claim
            later = [r for r in records[index + 1 :] if r.started is not None]
            if later:
                after, end = later[0], later[0].started
                started = after.process_started
                if started is not None and end is not None and begin < started < end:
                    end = started
        if end is not None and end > begin:
            observed += end - begin
        failures += _lost_work(record, current)
    if failures == 0:
        return prior_s + observed, 0, observed
    return max(observed, _MIN_OBSERVED_S) / failures, failures, observed


def check_every(every: object, name: str = "every") -> float | Literal["auto"]:
    """``every`` as a save interval: a positive, finite number of seconds or ``"auto"``.

    Args:
        every: the value given.
        name: the argument's name, for the error (an adapter's ``every_s``).

    Raises:
        ValueError: anything else (a bool, a string other than ``"auto"``, 0, a negative or
            infinite number), naming ``name`` and the value.
    """
    if every == "auto":
        return "auto"
    if (
        isinstance(every, bool)
        or not isinstance(every, (int, float))
        or not math.isfinite(every)
        or every <= 0
    ):
        raise ValueError(f'{name} must be a positive number of seconds or "auto"; got {every!r}')
    return float(every)


def _prior_from(env: Mapping[str, str], default: float = MTBF_PRIOR_S) -> float:
    """The prior mean time between failures: ``TASKPOINT_MTBF_PRIOR_S`` when set, else
    ``default``.

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    return seconds_from_env(
        env, ENV_MTBF_PRIOR, default,
        "a positive number of seconds (e.g. 3600 for a spot fleet that loses a machine an hour)",
    )


@dataclass(frozen=True)
class IntervalChoice:
    """The interval a :class:`SaveInterval` uses now, and what it was chosen from.

    Attributes:
        interval_s: seconds of training between saves.
        rule: ``"fixed"``, ``"young-daly"``, ``"overhead"`` (raised to keep saves within
            ``max_overhead`` while the run has not failed), ``"upload"`` (raised to the
            time a background save takes to commit), ``"max-interval"`` (capped) or
            ``"first-save"`` (no save cost measured yet, nor recorded by an earlier
            attempt of the run: the first save is due at once).
        save_cost_s: the measured cost of one save as training sees it (``None``: none
            measured yet).
        mtbf_s: the mean time between failures used (``None`` for a fixed interval).
        failures: failures that lost work in the run's history.
        observed_s: seconds of the run's history the estimate saw.
        prior_s: the prior mean time between failures, seconds (``None`` for a fixed
            interval).
        upload_s: the measured time from a background save's call to its commit, seconds
            (``None``: none measured, or blocking saves).
    """

    interval_s: float
    rule: str
    save_cost_s: float | None = None
    mtbf_s: float | None = None
    failures: int = 0
    observed_s: float = 0.0
    prior_s: float | None = None
    upload_s: float | None = None

    def describe(self) -> str:
        """One line for logs and ``taskpoint show``."""
        if self.rule == "fixed":
            return f"every {self.interval_s:g} s (fixed)"
        cost = "unmeasured" if self.save_cost_s is None else f"{self.save_cost_s:.3g} s"
        mtbf = f"{self.mtbf_s:.0f} s" if self.mtbf_s is not None else "unknown"
        prior = "" if self.prior_s is None else f", prior {self.prior_s:.0f} s"
        upload = "" if self.upload_s is None else f", upload {self.upload_s:.3g} s"
        return (
            f"every {self.interval_s:.1f} s ({self.rule}: save cost {cost}{upload}, mean time "
            f"between failures {mtbf} from {self.failures} failure(s) in "
            f"{self.observed_s:.0f} s{prior})"
        )

    def to_record(self) -> dict[str, Any]:
        """The JSON-ready fields an attempt's interval record keeps (``every``: the
        seconds asked for, or ``"auto"``), as ``taskpoint show --json`` prints them."""
        return {
            "every": self.interval_s if self.rule == "fixed" else "auto",
            "interval_s": round(self.interval_s, 6),
            "rule": self.rule,
            "save_cost_s": None if self.save_cost_s is None else round(self.save_cost_s, 6),
            "mtbf_s": None if self.mtbf_s is None else round(self.mtbf_s, 3),
            "failures": self.failures,
            "observed_s": round(self.observed_s, 3),
            "prior_s": self.prior_s,
            "upload_s": None if self.upload_s is None else round(self.upload_s, 6),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> IntervalChoice | None:
        """The choice an interval record holds (:meth:`to_record`); ``None`` when the record
        lacks a finite ``interval_s`` or a ``rule`` (other fields it lacks read as
        unknown)."""
        interval, rule = finite_number(record.get("interval_s")), record.get("rule")
        if interval is None or not isinstance(rule, str):
            return None
        failures = record.get("failures")
        return cls(
            interval, rule, finite_number(record.get("save_cost_s")),
            finite_number(record.get("mtbf_s")),
            failures if isinstance(failures, int) and not isinstance(failures, bool) else 0,
            finite_number(record.get("observed_s")) or 0.0,
            finite_number(record.get("prior_s")),
            finite_number(record.get("upload_s")),
        )

    def metrics(self) -> dict[str, float]:
        """The choice as ``taskpoint/<name>`` metrics, beside a save's figures (an
        adapter's logger, a dashboard): ``interval_s`` always; ``save_cost_s``,
        ``mtbf_s`` and ``failures`` for an automatic interval, those known (a save's own
        ``taskpoint/upload_s`` figure already gives the upload time)."""
        out = {f"{PREFIX}interval_s": float(self.interval_s)}
        if self.rule != "fixed":
            out[f"{PREFIX}failures"] = float(self.failures)
            if self.save_cost_s is not None:
                out[f"{PREFIX}save_cost_s"] = float(self.save_cost_s)
            if self.mtbf_s is not None:
                out[f"{PREFIX}mtbf_s"] = float(self.mtbf_s)
        return out


class SaveInterval:
    """Decides at each step boundary whether a save is due, by training time.

    Thread-safe: a checkpoint's commit listener (:meth:`committed`) may run in an upload
    thread while training calls the other methods.

    Args:
        every: seconds of training between saves (a positive number), or ``"auto"``.
        history: the run's attempt records, for ``"auto"`` (updated with
            :meth:`failures_seen`).
        current: the running attempt's number, when ``history`` includes it.
        mtbf_prior_s: the prior mean time between failures, seconds (``None``:
            ``TASKPOINT_MTBF_PRIOR_S``, else :data:`MTBF_PRIOR_S`).
        max_overhead: the largest share of training time automatic saves may cost while
            the run has not failed, in (0, 1).
        max_interval_s: the longest automatic interval, seconds.
        clock: seconds, monotonic (:func:`time.monotonic`); tests pass a fake one.
        since: the clock's reading when training started (or resumed), from which the
            first interval counts; ``None``: now.

    Raises:
        ValueError: an argument is out of range, or ``TASKPOINT_MTBF_PRIOR_S`` is unusable.
    """

    def __init__(
        self,
        every: float | Literal["auto"],
        *,
        history: Sequence[AttemptRecord] = (),
        current: int | None = None,
        mtbf_prior_s: float | None = None,
        max_overhead: float = MAX_OVERHEAD,
        max_interval_s: float = MAX_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        since: float | None = None,
    ) -> None:
        check_every(every)
        if not (isinstance(max_overhead, (int, float)) and 0 < max_overhead < 1):
            raise ValueError(f"max_overhead must be a fraction in (0, 1); got {max_overhead!r}")
        if not (isinstance(max_interval_s, (int, float)) and 0 < max_interval_s < math.inf):
            raise ValueError(
                f"max_interval_s must be a positive number of seconds; got {max_interval_s!r}"
            )
        self._auto = every == "auto"
        self._fixed = 0.0 if every == "auto" else float(every)
        self._prior = _prior_from(os.environ) if mtbf_prior_s is None else mtbf_prior_s
        if isinstance(self._prior, bool) or not (
            isinstance(self._prior, (int, float)) and math.isfinite(self._prior) and self._prior > 0
        ):
            raise ValueError(
                f"mtbf_prior_s must be a positive number of seconds; got {mtbf_prior_s!r}"
            )
        self._prior = float(self._prior)
        self._max_overhead = float(max_overhead)
        self._max_interval = float(max_interval_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._history: Sequence[AttemptRecord] = tuple(history)
        self._current = current
        self._since = clock() if since is None else since  # the last save's state, or the start
        self._last_step: float | None = None
        self._step_s: float | None = None  # running mean of a step with no upload beside it
        self._uploading_until: float | None = None
        self._taken = 0.0  # seconds the running upload has taken from steps so far
        self._blocked: float | None = None
        self._cost: float | None = None
        self._pending = 0  # background saves whose commit has not been heard of yet
        self._upload_began: float | None = None  # when the upload in flight was asked for
        self._upload_s: float | None = None  # running mean, call to commit
        self._listening = False
        self._recorder: _Recorder | None = None
        self._history_ready = threading.Event()  # cleared while a read of it runs
        self._history_ready.set()
        self._choice = self._choose()

    @classmethod
    def for_checkpoint(
        cls,
        checkpoint: object,
        every: float | Literal["auto"],
        *,
        clock: Callable[[], float] = time.monotonic,
        mtbf_prior_s: float | None = None,
        max_overhead: float = MAX_OVERHEAD,
        max_interval_s: float = MAX_INTERVAL_S,
        since: float | None = None,
    ) -> SaveInterval:
        """The interval of the saves made through ``checkpoint``.

        For a :class:`taskpoint.Checkpoint`, ``"auto"`` reads the run's attempt history
        from its store (a store failure is logged and the prior is used), and the interval
        listens to its commits (:meth:`taskpoint.Checkpoint.on_commit`): a background
        save's upload is measured until it commits, and the choice is recorded in the
        attempt's records for ``taskpoint show``. Any other checkpoint-like object (a
        Flyte checkpoint, say) has no history: ``"auto"`` uses the prior, and a save costs
        the time training was blocked.

        Args:
            checkpoint: where the saves go.
            every: seconds of training between saves, or ``"auto"``.
            clock: seconds, monotonic.
            mtbf_prior_s: the prior mean time between failures (see the class).
            max_overhead: the largest share of training time automatic saves may cost while
                the run has not failed.
            max_interval_s: the longest automatic interval, seconds.
            since: the clock's reading when training started (``None``: now).

        Raises:
            ValueError: as the constructor.
        """
        interval = cls(
            every, clock=clock, mtbf_prior_s=mtbf_prior_s, max_overhead=max_overhead,
            max_interval_s=max_interval_s, since=since,
        )
        if isinstance(checkpoint, Checkpoint):
            if interval._auto:
                interval._learn_history(checkpoint)
            interval.listen(checkpoint)
        return interval

    def _learn_history(self, checkpoint: Checkpoint) -> None:
        """Take the run's attempt records into the choice: at once where this process has
        read them already (its load's resume line) or the run has no earlier attempt, else
        on a thread: a resumed life's first save call would otherwise wait in the training
        loop on a read that grows with the run's restarts (a request per record). No timed
        save is due until the records are in (:meth:`due`); a failed read is logged and
        leaves the prior."""
        attempt = checkpoint._attempt
        if attempt.number in (None, 0) or attempt.history_read():
            self._take_history(checkpoint)
            return
        self._history_ready.clear()
        threading.Thread(
            target=self._take_history, args=(checkpoint,), name="taskpoint-interval-history",
            daemon=True,
        ).start()

    def _take_history(self, checkpoint: Checkpoint) -> None:
        try:
            self.failures_seen(checkpoint._attempt.history(), checkpoint.attempt)
        except CheckpointError as exc:
            log.warning(
                "cannot read the run history at %s (%s); the save interval uses the prior "
                "mean time between failures, %.0f s", checkpoint.url, exc, self._prior,
            )
        finally:
            self._history_ready.set()

    def history_ready(self, timeout: float | None = None) -> bool:
        """Wait until the run's attempt records are taken into the choice (at most
        ``timeout`` seconds; ``None``: as long as it takes) and say whether they are: an
        automatic interval of a resumed life reads them on a thread (see
        :meth:`for_checkpoint`); any other answers ``True`` at once."""
        return self._history_ready.wait(timeout)

    def __repr__(self) -> str:
        return f"SaveInterval({self._choice.describe()})"

    @property
    def choice(self) -> IntervalChoice:
        """The interval now in force and its inputs."""
        return self._choice

    @property
    def save_cost_s(self) -> float | None:
        """The running estimate of one save's cost to training, seconds (``None``: no save
        measured yet)."""
        return self._cost

    def listen(self, checkpoint: Checkpoint) -> None:
        """Hear of ``checkpoint``'s commits (:meth:`committed`): background saves'
        uploads end at their commit, and the choice is recorded in the attempt's records.
        :meth:`for_checkpoint` does this; a second call for the same interval adds nothing."""
        with self._lock:
            if self._listening:
                return
            self._listening = True
            self._recorder = _Recorder(checkpoint)
        checkpoint.on_commit(self.committed)

    def detach(self) -> None:
        """Stop hearing of the checkpoint's commits and recording the choice (the
        interval was replaced by another one for the same checkpoint); the rest works on."""
        with self._lock:
            self._recorder, self._listening, self._pending = None, False, 0
            self._upload_began = None
            if self._uploading_until == math.inf:
                self._uploading_until = self._clock()

    def step_done(self) -> None:
        """A training step finished: time it. Steps that ran beside an upload count what
        they took beyond a plain step towards that save's cost."""
        with self._lock:
            now = self._clock()
            if self._last_step is not None:
                took = now - self._last_step
                if self._uploading_until is not None and self._last_step < self._uploading_until:
                    if self._step_s is not None:
                        self._taken += max(0.0, took - self._step_s)
                else:
                    self._step_s = took if self._step_s is None else _mix(self._step_s, took)
            if self._uploading_until is not None and now >= self._uploading_until:
                self._finish_cost()
            self._last_step = now

    def due(self, agree: Callable[[bool], bool] | None = None) -> bool:
        """Whether a save is due now: the interval has passed since the last save (or the
        start). The first automatic save of a run, whose cost is not known yet, is due at
        once; none is due while a resumed life's run history is still being read
        (:meth:`history_ready`).

        Args:
            agree: under several ranks, the adapter's collective that hands global rank 0's
                value to every rank (one call, made on every rank): every rank then answers
                as rank 0's clock says, so all save at the same step.
        """
        with self._lock:
            local = self._history_ready.is_set() and (
                self._clock() - self._since >= self._choice.interval_s
            )
        return bool(agree(local)) if agree is not None else local

    def saved(self, *, blocked_s: float, upload_s: float = 0.0, background: bool = False) -> None:
        """A save committed (blocking) or was handed to the background: restart the
        interval and measure its cost.

        Args:
            blocked_s: seconds training waited for the save call.
            upload_s: seconds its upload runs beside training (0 for a blocking save);
                the steps in that window count what they lose towards the cost. Ignored
                with ``background`` on a listening interval.
            background: its upload runs beside training until it commits. An interval that
                listens to the checkpoint's commits (:meth:`for_checkpoint`) counts the steps
                until then; another one counts ``upload_s`` (the time blocked alone if 0).

        Raises:
            ValueError: a duration is negative or not finite.
        """
        for name, value in (("blocked_s", blocked_s), ("upload_s", upload_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0; got {value!r}")
        with self._lock:
            now = self._clock()
            if self._uploading_until is not None:
                self._finish_cost()
            self._since = now
            self._last_step = now
            self._blocked = blocked_s
            if background and self._listening:
                if self._pending <= 0:  # else it queues behind the upload in flight
                    self._upload_began = now - blocked_s  # from the call
                self._pending += 1
                if self._pending > 0:  # else its commit came before this call
                    self._uploading_until, self._taken = math.inf, 0.0
                    self._update()  # a first save's cost: the time blocked, until it commits
                    return
                self._pending, self._upload_began = 0, None
                self._finish_cost()
            elif upload_s > 0:
                self._uploading_until, self._taken = now + upload_s, 0.0
            else:
                self._finish_cost()

    def committed(self, stats: SaveStats) -> None:
        """A save through the checkpoint committed (its ``on_commit`` listener): a
        background save's upload ends now, so the steps from here on run at full speed
        again (a save it replaced, ``stats.coalesced``, ends with it); the choice is
        recorded in the attempt's records when it changed."""
        with self._lock:
            if self._recorder is None:  # detached (or never listening)
                return
            if stats.background:
                now = self._clock()
                self._pending -= 1 + stats.coalesced
                if self._pending <= 0 and self._uploading_until is not None:
                    self._uploading_until = now
                if self._upload_began is not None:
                    took = now - self._upload_began
                    self._upload_s = took if self._upload_s is None else _mix(self._upload_s, took)
                    # the save queued behind it starts uploading now
                    self._upload_began = now if self._pending > 0 else None
                    self._update()
            choice, recorder = self._choice, self._recorder
        if recorder is not None:
            recorder.note(choice)

    def failures_seen(self, history: Sequence[AttemptRecord], current: int | None = None) -> None:
        """The run's history changed (a new attempt began): recompute the interval. Until
        this interval has measured a save of its own, it takes the save cost (and upload
        time) the newest earlier attempt recorded for its automatic interval: a resumed
        run then saves when Young/Daly says, not at once, which would upload again the
        state it has just restored."""
        with self._lock:
            self._history, self._current = tuple(history), current
            if self._auto and self._cost is None and self._blocked is None:
                self._cost, upload = _recorded_costs(history, current)
                if self._upload_s is None:
                    self._upload_s = upload
            self._update()

    def _finish_cost(self) -> None:
        if self._blocked is None:
            return
        cost = self._blocked + self._taken
        self._cost = cost if self._cost is None else _mix(self._cost, cost)
        self._blocked, self._uploading_until, self._taken = None, None, 0.0
        self._update()

    def _update(self) -> None:
        choice = self._choose()
        if choice != self._choice and self._auto:
            log.info("save interval: %s", choice.describe())
        self._choice = choice

    def _choose(self) -> IntervalChoice:
        if not self._auto:
            return IntervalChoice(self._fixed, "fixed")
        mtbf, failures, observed = mean_time_between_failures(
            self._history, prior_s=self._prior, current=self._current
        )
        cost = self._cost if self._cost is not None else self._blocked  # first, provisional
        upload = self._upload_s
        if cost is None:
            return IntervalChoice(
                0.0, "first-save", None, mtbf, failures, observed, self._prior, upload
            )
        interval, rule = young_daly(cost, mtbf), "young-daly"
        floor = cost / self._max_overhead
        if failures == 0 and interval < floor:  # only a guessed rate is bounded (see module)
            interval, rule = floor, "overhead"
        if upload is not None and interval < upload:  # sooner would only coalesce
            interval, rule = upload, "upload"
        if interval > self._max_interval:
            interval, rule = self._max_interval, "max-interval"
        return IntervalChoice(interval, rule, cost, mtbf, failures, observed, self._prior, upload)


class _Recorder:
    """Writes a listening interval's choice to its checkpoint's attempt records, when it
    changed enough to matter (another rule, a failure more, the interval moved by
    :data:`_RECORD_CHANGE` or more); from the thread that committed."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._last: IntervalChoice | None = None

    def note(self, choice: IntervalChoice) -> None:
        last = self._last
        if last is not None and (
            last.rule == choice.rule
            and last.failures == choice.failures
            and abs(choice.interval_s - last.interval_s)
            < _RECORD_CHANGE * max(last.interval_s, 1e-9)
        ):
            return
        self._last = choice
        self._checkpoint.record_interval(choice.to_record())


class SaveSchedule:
    """Which of an adapter's step boundaries save: every N steps, every N seconds (or
    ``"auto"``), either, or both (a save happens when either says so, and any save
    restarts the time).

    Holds the :class:`SaveInterval` of the checkpoint and ``every_s`` last given
    (:meth:`SaveInterval.for_checkpoint`), made anew when either changes. The first interval
    counts from :meth:`start` (the adapter calls it when training starts or resumes: after
    its restore), else from the first boundary.

    Args:
        clock: seconds, monotonic, for the interval (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._interval: SaveInterval | None = None
        self._checkpoint: object = None
        self._every_s: float | str | None = None
        self._started: float | None = None

    def start(self) -> None:
        """Training starts (or resumes) now: the first interval counts from here."""
        self._started = self.clock()

    @property
    def interval(self) -> SaveInterval | None:
        """The interval in use (``None`` before a call with ``every_s``)."""
        return self._interval

    def due(
        self,
        checkpoint: object,
        counter: int | None,
        every: int | None,
        every_s: float | Literal["auto"] | None,
        agree: Callable[[bool], bool] | None = None,
    ) -> bool:
        """A step boundary: whether it saves. Without ``every`` and ``every_s``, always;
        with an unusable ``counter`` (``None``), always (the save then says what is wrong);
        else when ``counter`` is a multiple of ``every`` or the interval is due. With
        ``every_s`` the step is timed and ``agree`` (every rank's collective returning
        rank 0's value) is called once, whatever the steps say, so every rank makes the
        same calls.

        Args:
            checkpoint: where the saves go.
            counter: the loop's step (or chunk, epoch) counter.
            every: save when ``counter`` is a multiple of it (validated by the adapter).
            every_s: seconds of training between saves, or ``"auto"``.
            agree: see :meth:`SaveInterval.due`.

        Raises:
            ValueError: ``every_s`` is not a positive number of seconds or ``"auto"``.
        """
        interval = None
        if every_s is not None:
            every_s = check_every(every_s, "every_s")
            interval = self._interval
            if interval is None or self._checkpoint is not checkpoint or self._every_s != every_s:
                if interval is not None:
                    interval.detach()  # its listener stays on the checkpoint: silence it
                interval = SaveInterval.for_checkpoint(
                    checkpoint, every_s, clock=self.clock, since=self._started
                )
                self._interval, self._checkpoint, self._every_s = interval, checkpoint, every_s
            interval.step_done()
        by_time = interval.due(agree) if interval is not None else False
        if counter is None or (every is None and interval is None):
            return True
        return by_time or (every is not None and counter % every == 0)

    def saved(self, *, blocked_s: float, background: bool = False) -> None:
        """A save was made at a boundary (whichever rule asked for it): restart the time
        and measure the save (see :meth:`SaveInterval.saved`)."""
        if self._interval is not None:
            self._interval.saved(blocked_s=max(0.0, blocked_s), background=background)


class TimedSaves:
    """A framework adapter's saves by training time, from what its user gave: seconds (a
    ``timedelta`` too), ``"auto"`` or a :class:`SaveInterval` of their own (``None``: no
    timed saves). The interval is made once, at training start (:meth:`start`), asked at
    each step boundary (:meth:`due`) and restarted by each save (:meth:`saved`).

    Args:
        spec: the user's setting, checked by the adapter.
    """

    def __init__(self, spec: object) -> None:
        self.spec = spec
        self.interval: SaveInterval | None = spec if isinstance(spec, SaveInterval) else None

    @property
    def choice(self) -> IntervalChoice | None:
        """The interval in force and what it was chosen from (``None``: none)."""
        return None if self.interval is None else self.interval.choice

    def start(self, checkpoint: object) -> None:
        """Make the interval of the saves through ``checkpoint`` (once:
        :meth:`SaveInterval.for_checkpoint`)."""
        spec = self.spec
        if self.interval is not None or spec is None:
            return
        seconds = getattr(spec, "total_seconds", None)  # a timedelta
        every = check_every(seconds() if callable(seconds) else spec, "every")
        self.interval = SaveInterval.for_checkpoint(checkpoint, every)

    def due(self, agree: Callable[[bool], bool]) -> bool:
        """A step boundary: count the step and say whether a timed save is due, by
        ``agree`` (every rank's collective returning rank 0's value: every rank calls this)."""
        interval = self.interval
        if interval is None:
            return False
        interval.step_done()
        return interval.due(agree=agree)

    def saved(self, *, blocked_s: float, background: bool) -> None:
        """A save was made: restart the interval (see :meth:`SaveInterval.saved`)."""
        if self.interval is not None:
            self.interval.saved(blocked_s=max(0.0, blocked_s), background=background)


def _recorded_costs(
    history: Sequence[AttemptRecord], current: int | None
) -> tuple[float | None, float | None]:
    """``(save_cost_s, upload_s)`` of the newest automatic interval recorded by an attempt
    of ``history`` other than ``current`` that measured a save; ``(None, None)`` if none."""
    for record in sorted(history, key=lambda r: r.attempt, reverse=True):
        if record.attempt == current or record.interval is None:
            continue
        choice = IntervalChoice.from_record(record.interval)
        if choice is None or choice.rule == "fixed":
            continue
        cost, upload = choice.save_cost_s, choice.upload_s
        if cost is not None and cost >= 0:
            return cost, upload if upload is not None and upload >= 0 else None
    return None, None


def _mix(old: float, new: float) -> float:
    return (1 - _EWMA) * old + _EWMA * new
