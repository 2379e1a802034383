"""An action's history drawn for people: attempts, resumes and checkpoints in time order.

``taskpoint show`` prints :func:`render`; ``taskpoint show --json`` adds :func:`to_json`
to the action's description. Both are pure: they take what :mod:`taskpoint.inspect.inventory` read
(an :class:`~taskpoint.inspect.inventory.ActionInfo`, its attempt records and the verification
results) and perform no I/O. Records written by older versions lack most fields, and a
damaged store holds garbage: every field may be missing, and any value is shown as what it
is, never raised over.

Example::

    from rich.console import Console
    from taskpoint.inspect import timeline
    from taskpoint.inspect.inventory import find_action

    info = find_action("s3://bucket/jobs", "train.fit/20250601T120000Z-3f2a9c")
    Console().print(timeline.render(info, info.verify()))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.text import Text
from rich.tree import Tree

from taskpoint.format.history import AttemptRecord, finite_number, steps_lost
from taskpoint.format.manifest import Manifest, parse_manifest_name
from taskpoint.inspect.goodput import goodput
from taskpoint.runtime.interval import IntervalChoice

if TYPE_CHECKING:
    from taskpoint.inspect.inventory import ActionInfo, Damage

__all__ = [
    "AttemptView",
    "Event",
    "Line",
    "age",
    "attempt_views",
    "duration",
    "events",
    "human_size",
    "render",
    "to_json",
]

STYLES = {
    "succeeded": "bold green",
    "failed": "bold red",
    "preempted": "bold yellow",
    "crashed": "bold red",
    "died": "bold magenta",
    "died (no record)": "bold magenta",
    "running or died": "bold cyan",
    "unfinished": "bold cyan",
    "ok": "green",
    "CORRUPT": "bold red",
    "NEWER FORMAT": "bold yellow",
    "UNREADABLE": "bold red",
    "unverified": "dim",
}
"""How each outcome, state and check is coloured (on a terminal, and in SVG)."""


# -- formatting ---------------------------------------------------------------------------


def human_size(size: int) -> str:
    """``size`` bytes as ``"12 B"``, ``"1.5 MiB"``... (TiB at most)."""
    if size < 1024:
        return f"{size} B"
    for unit, power in (("KiB", 1), ("MiB", 2), ("GiB", 3)):
        if size < 1024 ** (power + 1):
            return f"{size / 1024**power:.1f} {unit}"
    if size < 1024**5 * 10**6:
        return f"{size / 1024**4:.1f} TiB"
    return f"{size} B"


def age(seconds: float) -> str:
    """A coarse age: ``"5s"``, ``"3m"``, ``"2h"``, ``"4d"``."""
    if not math.isfinite(seconds):
        return "?"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def duration(seconds: float) -> str:
    """A precise duration: ``"12ms"``, ``"4.20s"``, ``"2m05s"``, ``"1h02m"``."""
    if not math.isfinite(seconds):
        return "?"
    sign, seconds = ("-", -seconds) if seconds < 0 else ("", seconds)
    if seconds < 1:
        text = f"{seconds * 1000:.0f}ms"
    elif seconds < 60:
        text = f"{seconds:.2f}s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    elif seconds < 86400 * 10**6:
        text = f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    else:
        text = "forever"
    return sign + text


def _local(at: float) -> datetime | None:
    try:
        return datetime.fromtimestamp(at)
    except (OverflowError, OSError, ValueError):
        return None


def _clock(at: float | None, day_of: float | None = None) -> str:
    """``at`` as local ``HH:MM:SS``, with the date unless it falls on ``day_of``'s day."""
    moment = _local(at) if at is not None else None
    if moment is None:
        return "?"
    same_day = day_of is not None and (day := _local(day_of)) is not None
    if same_day and day is not None and day.date() == moment.date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def save_stats(manifest: Manifest) -> dict[str, Any]:
    """A manifest's ``stats`` with every field checked: a missing or bad one is ``None``."""
    raw = manifest.stats
    stats: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    background = stats.get("background")
    return {
        "save_s": finite_number(stats.get("save_s")),
        "upload_s": finite_number(stats.get("upload_s")),
        "uploaded": _count(stats.get("uploaded")),
        "reused": _count(stats.get("reused")),
        "blocked_s": finite_number(stats.get("blocked_s")),
        "background": background if isinstance(background, bool) else None,
        "coalesced": _count(stats.get("coalesced")) or 0,
    }


# -- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptView:
    """One attempt as shown: its record, what it is judged to have become, its saves.

    Attributes:
        record: what the attempt's records say (all ``None`` but the number when it has
            none, e.g. an attempt known only from its checkpoints).
        state: the outcome recorded (``"died"`` for an attempt whose process ended without
            recording it, as the next attempt found), or when there is none
            ``"died (no record)"`` (a later attempt exists), ``"running or died"`` (the newest of an unfinished run) or
            ``"no record (run <state>)"`` (the newest of a finished run).
        checkpoints: the kept checkpoints it committed, oldest first.
        next_resumed_step: for an attempt a later one followed, the step that one resumed
            at (0 when it started over); ``None`` otherwise or when unknown.
    """

    record: AttemptRecord
    state: str
    checkpoints: list[Manifest] = field(default_factory=list)
    next_resumed_step: int | None = None

    @property
    def steps_lost(self) -> int | None:
        """Training steps between where this attempt ended and where the next resumed;
        ``None`` for a successful or the last attempt, or without reported steps."""
        if self.record.outcome == "succeeded" or self.next_resumed_step is None:
            return None
        return steps_lost(self.record, self.next_resumed_step)

    @property
    def attempt(self) -> int:
        return self.record.attempt

    @property
    def duration_s(self) -> float | None:
        started, ended = self.record.started, self.record.ended
        return ended - started if started is not None and ended is not None else None


@dataclass(frozen=True)
class Event:
    """One thing that happened to an action, for the timeline.

    Attributes:
        kind: ``"start"``, ``"resume"``, ``"checkpoint"``, ``"damaged"`` or ``"end"``.
        attempt: the attempt it belongs to.
        at: Unix time, when recorded (a resume record's time is not kept).
        manifest: the checkpoint (``"checkpoint"``).
        damage: the unreadable manifest (``"damaged"``).
    """

    kind: str
    attempt: int
    at: float | None
    manifest: Manifest | None = None
    damage: Damage | None = None


def attempt_views(info: ActionInfo) -> list[AttemptView]:
    """Every attempt the action's records or checkpoints name, ascending."""
    records = {r.attempt: r for r in info.history}
    numbers = set(records) | set(info.attempts) | {m.attempt for m in info.checkpoints}
    ordered = sorted(numbers)
    views = []
    for attempt in ordered:
        record = records.get(attempt) or AttemptRecord(attempt=attempt)
        state = "died" if record.died else record.outcome
        if state is None:
            if attempt != ordered[-1]:
                state = "died (no record)"
            elif info.finished:
                state = f"no record (run {info.state})"
            else:
                state = "running or died"
        saves = sorted((m for m in info.checkpoints if m.attempt == attempt), key=lambda m: m.seq)
        views.append(AttemptView(record, state, saves))
    for index, view in enumerate(views[:-1]):
        later = views[index + 1].record
        if later.started is not None or later.resumed_from is not None:
            resumed = later.resumed_step if later.resumed_from is not None else 0
            views[index] = replace(view, next_resumed_step=resumed)
    return views


def _damaged_manifests(info: ActionInfo) -> dict[int, list[Damage]]:
    found: dict[int, list[Damage]] = {}
    for damage in info.damaged:
        order = parse_manifest_name(damage.key.rpartition("/")[2])
        if order is not None:
            found.setdefault(order[0], []).append(damage)
    return found


def _in_time_order(sequence: list[Event]) -> list[Event]:
    """Sort by time; an event without one stays after the event it follows in ``sequence``."""
    keyed = []
    last = -math.inf
    for index, event in enumerate(sequence):
        if event.at is not None:
            last = event.at
        keyed.append((last if event.at is None else event.at, index, event))
    return [event for _, _, event in sorted(keyed, key=lambda k: (k[0], k[1]))]


def _attempt_events(view: AttemptView, damaged: list[Damage]) -> list[Event]:
    record = view.record
    sequence = [Event("start", view.attempt, record.started)]
    if record.resumed_from is not None:
        sequence.append(Event("resume", view.attempt, record.resumed_at))
    saves: list[tuple[int, Event]] = [
        (m.seq, Event("checkpoint", view.attempt, m.created, manifest=m))
        for m in view.checkpoints
    ]
    for damage in damaged:
        order = parse_manifest_name(damage.key.rpartition("/")[2])
        saves.append((order[1] if order else 0, Event("damaged", view.attempt, None, damage=damage)))
    sequence += [event for _, event in sorted(saves, key=lambda s: s[0])]
    if record.ended is not None or record.outcome is not None:
        sequence.append(Event("end", view.attempt, record.ended))
    return _in_time_order(sequence)


def events(info: ActionInfo) -> list[Event]:
    """The whole run's events in time order, attempts interleaved as they happened."""
    damaged = _damaged_manifests(info)
    sequence = [
        event
        for view in attempt_views(info)
        for event in _attempt_events(view, damaged.get(view.attempt, []))
    ]
    return _in_time_order(sequence)


# -- JSON ---------------------------------------------------------------------------------


def _verdict(verified: Mapping[str, bool] | None, key: str) -> str:
    if verified is None or key not in verified:
        return "unverified"
    return "ok" if verified[key] else "CORRUPT"


def _checkpoint_json(m: Manifest, verified: Mapping[str, bool] | None) -> dict[str, Any]:
    return {
        "key": m.key, "kind": m.kind, "name": m.name, "size": m.size,
        "verified": None if verified is None else verified.get(m.key),
        "stats": save_stats(m), "step": m.step, "preemption": m.preemption,
    }


def to_json(info: ActionInfo, verified: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """The ``attempts_detail`` and ``timeline`` fields of ``taskpoint show --json``."""
    kept = {m.key for m in info.checkpoints}
    damaged = _damaged_by_name(info)
    detail = []
    for view in attempt_views(info):
        r = view.record
        detail.append({
            "attempt": r.attempt,
            "outcome": r.outcome,
            "state": view.state,
            "started": r.started,
            "ended": r.ended,
            "duration_s": view.duration_s,
            "host": r.host,
            "pid": r.pid,
            "error": r.error,
            "resumed_from": r.resumed_from,
            "resumed_from_kept": None if r.resumed_from is None else r.resumed_from in kept,
            "resumed_from_damaged": None if r.resumed_from is None else r.resumed_from in damaged,
            "restore_s": r.restore_s,
            "restored_size": r.restored_size,
            "resumed_step": r.resumed_step,
            "step": r.step,
            "steps_lost": view.steps_lost,
            "preemption_save": r.preemption_save,
            "died": r.died,
            "noted_by": r.noted_by,
            "traceback": r.traceback,
            "save_interval": r.interval,
            "checkpoints": [m.key for m in view.checkpoints],
        })
    timeline = []
    records = {v.attempt: v.record for v in attempt_views(info)}
    for event in events(info):
        item: dict[str, Any] = {"event": event.kind, "attempt": event.attempt, "at": event.at}
        record = records[event.attempt]
        if event.kind == "start":
            item.update(host=record.host, pid=record.pid)
        elif event.kind == "resume":
            item.update(
                checkpoint=record.resumed_from, restore_s=record.restore_s,
                step=record.resumed_step,
            )
        elif event.kind == "checkpoint" and event.manifest is not None:
            item.update(_checkpoint_json(event.manifest, verified))
        elif event.kind == "damaged" and event.damage is not None:
            item.update(event.damage.to_json())
        elif event.kind == "end":
            item.update(
                outcome=record.outcome, error=record.error, step=record.step,
                preemption_save=record.preemption_save,
            )
        timeline.append(item)
    return {"attempts_detail": detail, "timeline": timeline, "goodput": goodput_json(info)}


BADPUT_CAUSES = ("blocked", "restore", "recomputed", "restart", "other")
"""The causes of badput, in the order ``show`` lists them (see :mod:`taskpoint.inspect.goodput`)."""


def goodput_json(info: ActionInfo) -> dict[str, Any]:
    """The ``goodput`` field of ``taskpoint show --json``: the run's goodput (a fraction),
    its wall time, the training it kept and its badput by cause, in seconds; ``None`` where
    the records cannot tell, and under ``estimated`` what they lacked."""
    cost = goodput(info.history, info.checkpoints)
    return {
        "goodput": cost.goodput,
        "wall_s": cost.wall_s,
        "productive_s": cost.productive_s,
        "badput_s": {cause: cost.badput_s.get(cause) for cause in BADPUT_CAUSES},
        "step_s": cost.step_s,
        "steps_lost": cost.steps_lost,
        "estimated": list(cost.missing),
    }


def _goodput_line(info: ActionInfo) -> Line | None:
    """``goodput 87% of 5m12s · badput: blocked 2.10s, restore 4.00s, ...``, or ``None``
    while the records give no goodput."""
    cost = goodput(info.history, info.checkpoints)
    if cost.goodput is None or cost.wall_s is None:
        return None
    causes = [
        f"{cause} {duration(seconds)}"
        for cause in BADPUT_CAUSES
        if (seconds := cost.badput_s.get(cause)) is not None and seconds >= 0.05
    ]
    head = Text("goodput ", style="bold")
    head.append(f"{cost.goodput:.0%} of {duration(cost.wall_s)}")
    parts: list[str | Text] = [head]
    if causes:
        parts.append("badput: " + ", ".join(causes))
    if cost.missing:
        parts.append(Text("partly estimated (--json says how)", style="dim"))
    return _join(*parts)


# -- rich ---------------------------------------------------------------------------------


def _styled(word: str) -> Text:
    style = STYLES.get(word) or ("dim" if word.startswith("no record") else "")
    return Text(word, style=style)


class Line:
    """Parts shown on one line, joined by ``sep``; where the width runs out, the line breaks
    between parts (never inside one that fits) and goes on indented."""

    def __init__(self, parts: list[Text], sep: str = " · ", indent: int = 2) -> None:
        self.parts = parts
        self.sep = sep
        self.indent = indent

    @property
    def plain(self) -> str:
        """The text, unbroken and unstyled."""
        return self.sep.join(part.plain for part in self.parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(options.max_width, 20)
        text = Text()
        column = 0
        for part in self.parts:
            for index, piece in enumerate(_pieces(part, width - self.indent)):
                size = piece.cell_len
                sep = self.sep if index == 0 else ""
                if column and column + len(sep) + size > width:
                    text.append("\n" + " " * self.indent)
                    column = self.indent
                elif column:
                    text.append(sep, style="dim")
                    column += len(sep)
                text.append_text(piece)
                column += size
        yield text

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((part.cell_len for part in self.parts), default=0)
        return Measurement(min(widest, options.max_width), len(self.plain))


def _pieces(part: Text, room: int) -> list[Text]:
    """``part`` whole if it fits in ``room`` cells, else cut after each ``/``: a URL or a
    path too wide for a line breaks between its segments, never inside a run id."""
    if part.cell_len <= room:
        return [part]
    plain = part.plain
    cuts = [i + 1 for i, char in enumerate(plain[:-1]) if char == "/"]
    return list(part.divide(cuts)) if cuts else [part]


def _join(*parts: str | Text | Line | None, sep: str = " · ") -> Line:
    texts: list[Text] = []
    for part in parts:
        if isinstance(part, Line):
            texts.extend(part.parts)
        elif part:
            texts.append(part if isinstance(part, Text) else Text(part))
    return Line(texts, sep)


def _stats_text(m: Manifest) -> Line | None:
    stats = save_stats(m)
    parts: list[str] = []
    if stats["uploaded"] is not None:
        sent = f"uploaded {human_size(stats['uploaded'])}"
        if stats["upload_s"] is not None:
            sent += f" in {duration(stats['upload_s'])}"
        parts.append(sent)
    elif stats["upload_s"] is not None:
        parts.append(f"upload {duration(stats['upload_s'])}")
    if stats["reused"]:
        parts.append(f"reused {human_size(stats['reused'])}")
    if stats["save_s"] is not None:
        save = f"save {duration(stats['save_s'])}"
        if stats["blocked_s"] is not None:
            save += f", blocked {duration(stats['blocked_s'])}"
        parts.append(save)
    if stats["background"]:
        parts.append("background")
    if stats["coalesced"]:
        count = stats["coalesced"]
        parts.append(f"replaced {count} waiting save{'s' if count != 1 else ''} (coalesced)")
    return _join(*parts) if parts else None


def _when(event: Event, start: float | None) -> Text:
    if event.at is None:
        return Text("")
    text = Text(_clock(event.at, start))
    if start is not None and event.at != start:
        text.append(f" +{duration(event.at - start)}", style="dim")
    return text


def _source_note(
    source: str, kept: set[str], damaged: Mapping[str, Damage], verified: Mapping[str, bool] | None
) -> str | Text | None:
    """What became of the checkpoint an attempt resumed from, if it is no longer intact."""
    label = None
    if source in damaged:
        label = damaged[source].label
    elif source not in kept:
        return "pruned since"
    elif verified is not None and verified.get(source) is False:
        label = "CORRUPT"
    if label is None:
        return None
    note = _styled(label)
    note.append(" since")
    return note


def _damaged_by_name(info: ActionInfo) -> dict[str, Damage]:
    """The damaged manifests, by name (as resume records name their checkpoint)."""
    return {
        name: d for d in info.damaged
        if parse_manifest_name(name := d.key.rpartition("/")[2]) is not None
    }


def _event_text(
    event: Event,
    view: AttemptView,
    kept: set[str],
    verified: Mapping[str, bool] | None,
    damaged: Mapping[str, Damage],
) -> Line | None:
    record = view.record
    when = _when(event, record.started)
    if event.kind == "start":
        return None  # the attempt's own line says when it started
    if event.kind == "resume":
        source = record.resumed_from or "?"
        note = _source_note(source, kept, damaged, verified)
        restored = "restored"
        size = record.restored_size
        if isinstance(size, int):
            restored += f" {human_size(size)}"
        if record.restore_s is not None:
            restored += f" in {duration(record.restore_s)}"
        line = Text("resumed from ", style="bold")
        line.append(source, style="bold blue")
        at = None if record.resumed_step is None else f"at step {record.resumed_step}"
        return _join(_lead(when, line), at, restored, note)
    if event.kind == "checkpoint" and event.manifest is not None:
        m = event.manifest
        line = Text("checkpoint ")
        line.append(m.key, style="blue")
        what = f"{m.kind}, {human_size(m.size)}" if m.name is None else (
            f"{m.kind} {m.name}, {human_size(m.size)}"
        )
        return _join(
            _lead(when, line), _styled(_verdict(verified, m.key)), what,
            None if m.step is None else f"step {m.step}",
            Text("preemption save", style="bold yellow") if m.preemption else None,
            _stats_text(m),
        )
    if event.kind == "damaged" and event.damage is not None:
        line = Text("checkpoint ")
        line.append(event.damage.key.rpartition("/")[2], style="blue")
        return _join(_lead(when, line), _styled(event.damage.label), event.damage.detail)
    if event.kind == "end":
        outcome = "died" if record.died else record.outcome or "ended"
        line = Text(outcome, style=STYLES.get(outcome, ""))
        if record.error:
            line.append(f": {record.error}")
        return _join(_lead(when, line), *_cost_parts(view))
    return None


def _cost_parts(view: AttemptView) -> list[str | Text]:
    """What an attempt's end cost: the step it reached, the next attempt's resume step and
    the steps lost in between, and whether its preemption save committed."""
    record = view.record
    parts: list[str | Text] = []
    if record.preemption_save == "committed":
        parts.append(Text("preemption save committed", style="green"))
    elif record.preemption_save == "missed":
        parts.append(Text("preemption save MISSED", style="bold red"))
    if record.step is not None:
        parts.append(f"at step {record.step}")
    if record.died:  # how far it got is not recorded; its saves say where it was at least
        known = [m.step for m in view.checkpoints if m.step is not None]
        known += [s for s in (record.resumed_step, view.next_resumed_step) if s is not None]
        text = Text("the steps after its last save were lost" if not known else
                    f"saved up to step {max(known)}: the steps after it were lost")
        if view.next_resumed_step is not None:
            text.append(f" (next resumed at step {view.next_resumed_step})")
        parts.append(text)
    lost = view.steps_lost
    if lost is not None:
        text = Text(f"next resumed at step {view.next_resumed_step}: ")
        text.append(f"{lost} step{'' if lost == 1 else 's'} lost", style="bold" if lost else "")
        parts.append(text)
    return parts


def _interval_line(record: AttemptRecord) -> Line | None:
    """How often the attempt saved by time, and why (its interval record), if it did."""
    choice = None if record.interval is None else IntervalChoice.from_record(record.interval)
    if choice is None:
        return None
    return _join(Text("save interval", style="bold"), choice.describe(), sep="  ")


def _lead(when: Text, line: Text) -> Text:
    """An event's time and what happened, kept on one line."""
    if not when:
        return line
    lead = when.copy()
    lead.append("  ")
    lead.append_text(line)
    return lead


def _attempt_label(view: AttemptView) -> Line:
    record = view.record
    label = Text(f"attempt {view.attempt}", style="bold")
    label.append("  ")
    label.append_text(_styled(view.state))
    span = None
    if record.started is not None:
        span = _clock(record.started)
        if record.ended is not None:
            span += f" → {_clock(record.ended, record.started)}"
        if view.duration_s is not None:
            span += f" ({duration(view.duration_s)})"
    where = None
    if record.host is not None or record.pid is not None:
        where = " ".join(
            part for part in (
                record.host,
                None if record.pid is None else f"pid {record.pid}",
            ) if part
        )
    return _join(label, span, where, sep="  ")


def _header(info: ActionInfo, views: list[AttemptView]) -> Line:
    header = Text(info.action, style="bold")
    header.append("  ")
    header.append_text(_styled(info.state))
    starts = [v.record.started for v in views if v.record.started is not None]
    ends = [t for v in views for t in (v.record.ended,) if t is not None]
    finished = finite_number((info.status or {}).get("finished"))
    if finished is not None:
        ends.append(finished)
    tries = len(views)
    facts = [f"{tries} attempt{'s' if tries != 1 else ''}"]
    kept = len(info.checkpoints)
    facts.append(f"{kept} checkpoint{'s' if kept != 1 else ''} kept")
    if starts and ends and max(ends) >= min(starts):
        facts.append(f"{duration(max(ends) - min(starts))} in all")
    return _join(header, *facts, sep="  ")


def render(
    info: ActionInfo, verified: Mapping[str, bool] | None = None, *, verbose: bool = False
) -> RenderableType:
    """The run as a tree: one branch per attempt, its resume and its saves in time order.

    Args:
        info: the action, with its attempt records (``info.history``).
        verified: manifest keys mapped to whether the payload is intact (see
            :meth:`ActionInfo.verify`); ``None`` shows checkpoints as unverified.
        verbose: show under a failed attempt's end the traceback its record keeps
            (otherwise a note says one is kept).
    """
    views = attempt_views(info)
    kept = {m.key for m in info.checkpoints}
    damaged = _damaged_manifests(info)
    by_name = _damaged_by_name(info)
    tree = Tree(_header(info, views), guide_style="dim")
    for view in views:
        branch = tree.add(_attempt_label(view))
        interval = _interval_line(view.record)
        if interval is not None:
            branch.add(interval)
        for event in _attempt_events(view, damaged.get(view.attempt, [])):
            line = _event_text(event, view, kept, verified, by_name)
            if line is None:
                continue
            traceback = view.record.traceback if event.kind == "end" else None
            if traceback and not verbose:
                line = _join(line, Text("traceback kept: show --verbose", style="dim"))
            node = branch.add(line)
            if traceback and verbose:
                node.add(Text(traceback, style="dim"))
    problems = [d for d in info.damaged if parse_manifest_name(d.key.rpartition("/")[2]) is None]
    if problems:
        branch = tree.add(Text("records that cannot be read", style="bold red"))
        for damage in problems:
            branch.add(_join(damage.key, _styled(damage.label), damage.detail))
    summary = _goodput_line(info)
    if summary is None:
        return Group(Line([Text(info.url, style="dim")]), tree)
    return Group(Line([Text(info.url, style="dim")]), tree, summary)
