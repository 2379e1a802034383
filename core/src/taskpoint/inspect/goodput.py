"""A run's goodput and its badput by cause, from the records it left in the store.

Goodput is the share of a run's wall time spent on training that was kept: the training
steps the run needed, over the time it took from its first record to its last. The rest
is badput, split by cause:

- ``blocked``: time training waited inside saves (the ``blocked_s`` total of each
  attempt's end record, plus the kept manifests committed after it; for an attempt whose
  record has no total, the sum of its kept manifests' ``blocked_s``);
- ``restore``: time spent restoring (each resume record's ``restore_s``);
- ``recomputed``: training a failure threw away (the steps between where an attempt ended
  and where the next resumed, at the run's time per step);
- ``restart``: from one attempt's end to the next one's start (the orchestrator's delay, a
  new process starting, and whatever of an attempt's start its records do not show);
- ``other``: what is left (startup before the first record, steps slowed by background
  work, saves of an attempt without end-record totals whose manifests retention deleted).

:func:`goodput` is pure: it takes the attempt records
(:func:`taskpoint.format.history.read_attempts`) and the committed manifests it can see,
performs no I/O, and never raises over a damaged or partial record: what it cannot know
it leaves ``None`` and says why in :attr:`RunGoodput.missing`.

Example::

    from taskpoint.inspect.goodput import goodput
    from taskpoint.inspect.inventory import find_action

    info = find_action("s3://bucket/jobs", "train/train-42")
    if info is not None:
        cost = goodput(info.history, info.checkpoints)
        print(cost.goodput, cost.badput_s, cost.missing)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from taskpoint.format.history import AttemptRecord, finite_number
from taskpoint.format.manifest import Manifest, parse_manifest_name

__all__ = ["AttemptCost", "RunGoodput", "goodput"]


@dataclass(frozen=True)
class AttemptCost:
    """What one attempt cost, as far as its records say.

    Attributes:
        attempt: the attempt number.
        outcome: the outcome recorded, or ``None`` (no end record: it died, or still runs).
        began: Unix time of its earliest recorded moment (its claim, or the start of its
            restore, whichever came first), or ``None``.
        ended: Unix time it ended; without an end record, its last recorded moment (a
            lower bound), or ``None``.
        blocked_s: seconds training waited in its committed saves: its end record's total
            plus its kept manifests committed after that record was written, or where the
            record has no total (older versions, a died attempt) the sum over its kept
            manifests.
        saves: how many saves it committed, counted the same way.
        restore_s: seconds its restore took (0 when it restored nothing).
        resumed_step: the step it resumed at (0 when it started over).
        step: the step it reached; without an end record, its last save's step (a lower
            bound), or ``None``.
        steps_lost: steps between where it ended and where the next attempt resumed;
            ``None`` for the last attempt or when unknown.
        restart_s: seconds from the previous attempt's end to its beginning; ``None`` for
            the first attempt or when unknown.
    """

    attempt: int
    outcome: str | None
    began: float | None
    ended: float | None
    blocked_s: float
    saves: int
    restore_s: float
    resumed_step: int
    step: int | None
    steps_lost: int | None
    restart_s: float | None


@dataclass(frozen=True)
class RunGoodput:
    """A run's goodput and badput by cause (see the module docstring); seconds throughout.

    Attributes:
        wall_s: from the first attempt's beginning to the last one's end.
        productive_s: the training the run kept: its final step times ``step_s``.
        goodput: ``productive_s / wall_s``, or ``None`` when either is unknown.
        badput_s: seconds by cause: ``blocked``, ``restore``, ``recomputed``, ``restart``
            and ``other`` (the rest of ``wall_s``; a cause that cannot be known is left out
            and ``other`` is then ``None``).
        final_step: the step the run reached.
        steps_lost: steps all failures threw away (``None`` when one's is unknown).
        step_s: seconds per training step: the one given, else estimated from the
            attempts (their span less restore and blocked time, per step advanced).
        attempts: each attempt's cost, ascending.
        missing: what the records lacked, one sentence each.
    """

    wall_s: float | None
    productive_s: float | None
    goodput: float | None
    badput_s: Mapping[str, float | None]
    final_step: int | None
    steps_lost: int | None
    step_s: float | None
    attempts: tuple[AttemptCost, ...]
    missing: tuple[str, ...]


def _blocked(manifest: Manifest) -> float | None:
    stats = manifest.stats if isinstance(manifest.stats, Mapping) else {}
    blocked = finite_number(stats.get("blocked_s"))
    return blocked if blocked is not None and blocked >= 0 else None


def _cost(record: AttemptRecord, saves: list[Manifest], missing: list[str]) -> AttemptCost:
    """One attempt's cost without its neighbours (``steps_lost``, ``restart_s`` unset)."""
    restore = record.restore_s if record.restore_s is not None and record.restore_s >= 0 else 0.0
    restore_began = None if record.resumed_at is None else record.resumed_at - restore
    moments = [t for t in (record.started, restore_began) if t is not None]
    began = min(moments) if moments else None
    ended = record.ended
    if ended is None:
        later = [t for t in (record.started, record.resumed_at, *(m.created for m in saves))
                 if t is not None]
        ended = max(later) if later else None
    blocked = [_blocked(m) for m in saves]
    kept_blocked = sum(b for b in blocked if b is not None)
    if record.blocked_s is not None and record.saves is not None:
        # the end record's totals outlive retention; saves committed after it was written
        # (a background upload finishing at exit) show only in their manifests
        after = [m for m in saves if record.ended is not None and m.created > record.ended]
        total_blocked = record.blocked_s + sum(_blocked(m) or 0.0 for m in after)
        total_saves = record.saves + len(after)
    else:
        total_blocked, total_saves = kept_blocked, len(saves)
        if any(b is None for b in blocked):
            missing.append(f"attempt {record.attempt}: a save records no blocked time")
    step = record.step
    if step is None:
        if record.outcome is None:
            missing.append(
                f"attempt {record.attempt} has no end record: its end and the step it reached "
                "are its last save's (a lower bound)")
        steps_saved = [m.step for m in saves if m.step is not None]
        step = max(steps_saved) if steps_saved else None
    return AttemptCost(
        attempt=record.attempt, outcome=record.outcome, began=began, ended=ended,
        blocked_s=total_blocked, saves=total_saves,
        restore_s=restore, resumed_step=_resumed_step(record), step=step,
        steps_lost=None, restart_s=None,
    )


def _resumed_from_attempt(record: AttemptRecord) -> int | None:
    """The attempt that saved the checkpoint ``record``'s attempt resumed from."""
    if record.resumed_from is None:
        return None
    order = parse_manifest_name(record.resumed_from.rpartition("/")[2])
    return None if order is None else order[0]


def _resumed_step(record: AttemptRecord) -> int:
    """The step ``record``'s attempt resumed at: 0 when it restored nothing (or a
    checkpoint that recorded no step)."""
    return (record.resumed_step or 0) if record.resumed_from is not None else 0


def _estimate_step_s(costs: Sequence[AttemptCost]) -> float | None:
    """Median over the attempts of (span - restore - blocked) / steps advanced."""
    rates = [
        (c.ended - c.began - c.restore_s - c.blocked_s) / (c.step - c.resumed_step)
        for c in costs
        if c.began is not None and c.ended is not None and c.step is not None
        and c.step > c.resumed_step and c.ended - c.began - c.restore_s - c.blocked_s > 0
    ]
    return statistics.median(rates) if rates else None


def goodput(
    history: Sequence[AttemptRecord],
    checkpoints: Sequence[Manifest] = (),
    *,
    step_s: float | None = None,
) -> RunGoodput:
    """The goodput and badput by cause of the run ``history`` describes.

    Args:
        history: the run's attempt records (:func:`taskpoint.format.history.read_attempts`),
            in any order.
        checkpoints: its committed manifests (any order): the source of the time each save
            blocked training for attempts whose end records have no totals (older versions,
            died attempts); such an attempt's saves that retention deleted are not counted.
        step_s: seconds per training step when the caller knows it; else it is estimated
            from the records.

    Returns:
        The figures; each one the records cannot give is ``None``, with the reason in
        :attr:`RunGoodput.missing`.

    Raises:
        ValueError: ``step_s`` is given and is not a positive number.
    """
    if step_s is not None and (finite_number(step_s) is None or step_s <= 0):
        raise ValueError(f"step_s must be a positive number of seconds; got {step_s!r}")
    missing: list[str] = []
    records = sorted(history, key=lambda r: r.attempt)
    by_attempt: dict[int, list[Manifest]] = {}
    for m in checkpoints:
        by_attempt.setdefault(m.attempt, []).append(m)
    costs = [_cost(r, sorted(by_attempt.get(r.attempt, []), key=lambda m: m.seq), missing)
             for r in records]
    for i, cost in enumerate(costs):
        lost: int | None = None
        restart: float | None = None
        if i + 1 < len(costs):
            if cost.step is None and _resumed_from_attempt(records[i + 1]) == cost.attempt:
                # its saves are gone (retention), but the next attempt resumed from one
                cost = replace(cost, step=costs[i + 1].resumed_step)
                missing.append(f"attempt {cost.attempt}'s step is the one the next attempt "
                               "resumed from (a lower bound)")
            if cost.step is not None:
                lost = max(0, cost.step - costs[i + 1].resumed_step)
        before = costs[i - 1].ended if i else None
        if before is not None and cost.began is not None:
            restart = max(0.0, cost.began - before)
        costs[i] = replace(cost, steps_lost=lost, restart_s=restart)

    known_step = step_s is not None
    step_s = step_s if known_step else _estimate_step_s(costs)
    if not known_step:
        missing.append("no record holds the time of a step: it is estimated from the "
                       "attempts' spans less their restore and blocked time")
    if checkpoints and any(
        len(by_attempt.get(r.attempt, [])) == 0 and r.blocked_s is None for r in records
    ):
        missing.append("saves whose manifests retention deleted are not counted as blocked")
    firsts = [c.began for c in costs if c.began is not None]
    lasts = [c.ended for c in costs if c.ended is not None]
    wall = max(lasts) - min(firsts) if firsts and lasts and max(lasts) > min(firsts) else None
    final = costs[-1].step if costs else None
    failures = costs[:-1]
    lost_all = (None if any(c.steps_lost is None for c in failures)
                else sum(c.steps_lost or 0 for c in failures))
    productive = None if final is None or step_s is None else final * step_s
    badput: dict[str, float | None] = {
        "blocked": sum(c.blocked_s for c in costs),
        "restore": sum(c.restore_s for c in costs),
        "recomputed": None if lost_all is None or step_s is None else lost_all * step_s,
        "restart": (None if any(c.restart_s is None for c in costs[1:])
                    else sum(c.restart_s or 0.0 for c in costs[1:])),
    }
    known = [v for v in badput.values() if v is not None]
    badput["other"] = (
        wall - productive - sum(known)
        if wall is not None and productive is not None and len(known) == len(badput)
        else None
    )
    if wall is None:
        missing.append("the records give no span of time for the run")
    return RunGoodput(
        wall_s=wall, productive_s=productive,
        goodput=productive / wall if productive is not None and wall else None,
        badput_s=badput, final_step=final, steps_lost=lost_all, step_s=step_s,
        attempts=tuple(costs), missing=tuple(missing),
    )
