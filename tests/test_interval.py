"""Save intervals by training time, fixed or chosen from the run's costs and failures."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
from taskpoint import Checkpoint
from taskpoint.format import history as history_module
from taskpoint.format.history import (
    AttemptRecord,
    claim_attempt,
    read_attempts,
    record_end,
    record_interval,
)
from taskpoint.runtime.interval import (
    MTBF_PRIOR_S,
    IntervalChoice,
    SaveInterval,
    SaveSchedule,
    TimedSaves,
    mean_time_between_failures,
    young_daly,
)
from taskpoint.store.store import Store


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _train(interval: SaveInterval, clock: FakeClock, steps: int, step_s: float) -> None:
    for _ in range(steps):
        clock.advance(step_s)
        interval.step_done()


def _held_auto(
    tmp_path: Path, prior_s: float
) -> tuple[Checkpoint, SaveInterval, FakeClock, threading.Event]:
    """An automatic interval on a real checkpoint whose uploads wait for the returned event
    (set it to let them commit), with a fake clock."""
    release = threading.Event()

    def held(_moved: int) -> None:
        release.wait(30)

    checkpoint = Checkpoint(tmp_path.as_uri(), progress=held)
    clock = FakeClock()
    interval = SaveInterval.for_checkpoint(checkpoint, "auto", mtbf_prior_s=prior_s, clock=clock)
    return checkpoint, interval, clock, release


def _payload(tmp_path: Path, fill: bytes) -> Path:
    """A 100 kB file beside ``tmp_path`` (not in the store's folder), rewritten each call."""
    source = tmp_path.parent / f"{tmp_path.name}-payload"
    source.write_bytes(fill * 100_000)
    return source


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf() -> None:
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly(0.0, 3600.0) == 0.0
    with pytest.raises(ValueError, match="cost_s"):
        young_daly(-1.0, 10.0)


def test_a_fixed_interval_is_due_once_its_seconds_of_training_passed() -> None:
    clock = FakeClock()
    interval = SaveInterval(30, clock=clock)
    _train(interval, clock, 2, 10.0)
    assert not interval.due()
    _train(interval, clock, 1, 10.0)
    assert interval.due()
    interval.saved(blocked_s=0.5)
    assert not interval.due()
    assert interval.choice.rule == "fixed"
    assert interval.choice.interval_s == 30


@pytest.mark.parametrize("every", [0, -5, math.inf, math.nan, "hourly", True])
def test_a_bad_interval_says_what_is_accepted(every: object) -> None:
    with pytest.raises(ValueError, match='positive number of seconds or "auto"'):
        SaveInterval(every)  # type: ignore[arg-type]


def test_the_prior_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "900")
    clock = FakeClock()
    interval = SaveInterval("auto", clock=clock)
    interval.saved(blocked_s=2.0)
    assert interval.choice.mtbf_s == 900
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "soon")
    with pytest.raises(ValueError, match="TASKPOINT_MTBF_PRIOR_S must be a positive number"):
        SaveInterval("auto")


def test_a_new_run_saves_first_then_follows_young_daly_on_the_prior() -> None:
    clock = FakeClock()
    interval = SaveInterval("auto", mtbf_prior_s=3600.0, clock=clock)
    assert interval.due(), "the first save is due at once: it measures the cost"
    interval.saved(blocked_s=2.0)
    choice = interval.choice
    assert choice.rule == "young-daly"
    assert choice.mtbf_s == 3600.0 and choice.failures == 0
    assert choice.interval_s == pytest.approx(120.0)
    _train(interval, clock, 11, 10.0)
    assert not interval.due()
    _train(interval, clock, 1, 10.0)
    assert interval.due()
    assert "young-daly" in choice.describe() and "2 s" in choice.describe()


def test_saves_come_more_often_when_cheaper_and_less_often_when_dearer() -> None:
    """Young/Daly: the interval is the square root of the cost times the failure rate's
    inverse, so a cheaper save shortens it (saves come more often) and a dearer one
    lengthens it."""
    clock = FakeClock()
    interval = SaveInterval("auto", mtbf_prior_s=36_000.0, clock=clock)
    interval.saved(blocked_s=8.0)
    dear = interval.choice.interval_s
    for _ in range(20):
        _train(interval, clock, 3, 1.0)
        interval.saved(blocked_s=0.5)
    cheap = interval.choice.interval_s
    assert cheap < dear
    for _ in range(20):
        _train(interval, clock, 3, 1.0)
        interval.saved(blocked_s=20.0)
    assert interval.choice.interval_s > cheap


def test_an_upload_beside_training_counts_what_it_takes_from_the_steps() -> None:
    clock = FakeClock()
    interval = SaveInterval("auto", mtbf_prior_s=36_000.0, clock=clock)
    _train(interval, clock, 5, 1.0)  # a plain step takes 1 s
    interval.saved(blocked_s=0.1, upload_s=4.0)
    _train(interval, clock, 2, 1.5)  # beside the upload each step takes 0.5 s more
    _train(interval, clock, 3, 1.0)  # after it, plain steps again: the cost is final
    assert interval.save_cost_s == pytest.approx(0.1 + 2 * 0.5)


def test_saves_stay_within_the_overhead_bound_on_the_prior_and_the_longest_interval(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    cheap_failures = SaveInterval("auto", mtbf_prior_s=60.0, max_overhead=0.02, clock=clock)
    cheap_failures.saved(blocked_s=1.0)
    # Young/Daly says sqrt(2 x 1 x 60) ~ 11 s: 9% of training in saves; raised to 50 s.
    assert cheap_failures.choice.rule == "overhead"
    assert cheap_failures.choice.interval_s == pytest.approx(50.0)
    # the run's own failures every 60 s: Young/Daly's 11 s holds, 9% in saves, since 50 s
    # would lose more in recomputed steps (about 25 s a failure, not 5.5 s) than it saves
    cheap_failures.failures_seen(_history(tmp_path, [(60.0, "crashed", None)] * 3))
    assert cheap_failures.choice.rule == "young-daly"
    assert cheap_failures.choice.interval_s == pytest.approx(math.sqrt(2 * 1.0 * 60.0))
    rare = SaveInterval("auto", mtbf_prior_s=1e9, max_interval_s=600.0, clock=clock)
    rare.saved(blocked_s=1.0)
    assert rare.choice.rule == "max-interval"
    assert rare.choice.interval_s == 600.0


def _history(tmp_path: Path, lives: list[tuple[float, str | None, str | None]]) -> list[AttemptRecord]:
    """Attempt records written to a real store: (seconds it ran, outcome, preemption save)."""
    store = Store(tmp_path.as_uri())
    for number, (_, outcome, saved) in enumerate(lives):
        assert claim_attempt(store, number) == number
        if outcome is not None:
            record_end(store, number, outcome, preemption_save=saved)  # type: ignore[arg-type]
    records = read_attempts(store)
    # Give the records the durations of the lives (the claims above took microseconds).
    start, shifted = 0.0, []
    for record, (ran, outcome, _) in zip(records, lives, strict=True):
        ended = start + ran if outcome is not None else None
        shifted.append(AttemptRecord(**{**record.__dict__, "started": start, "ended": ended}))
        start += ran
    return shifted


def test_the_mean_time_between_failures_counts_the_failures_that_lose_work(tmp_path: Path) -> None:
    records = _history(
        tmp_path,
        [
            (100.0, "crashed", None),
            (200.0, None, None),  # no end record: killed outright, until the next claim
            (300.0, "preempted", "committed"),  # a warned failure with its save: no loss
            (400.0, "preempted", "missed"),
            (500.0, "failed", None),
        ],
    )
    mtbf, failures, observed = mean_time_between_failures(records, prior_s=1000.0)
    assert failures == 4
    assert observed == pytest.approx(1500.0)
    assert mtbf == pytest.approx(1500.0 / 4)  # the run's own rate: the prior is set aside


def test_a_run_learns_a_fast_failure_rate_from_its_first_failures(tmp_path: Path) -> None:
    """A run failing every 30 s under the 4-hour default prior: the estimate is the
    prior (plus what it saw) until the first failure, then the run's own rate at once,
    not hundreds of failures later (as a prior weighing as one 4-hour failure made it)."""
    none_yet = _history(tmp_path / "none", [(30.0, None, None)])
    mtbf, failures, _ = mean_time_between_failures(
        none_yet, current=0, now=none_yet[0].started + 30.0  # type: ignore[operator]
    )
    assert (mtbf, failures) == (pytest.approx(MTBF_PRIOR_S + 30.0), 0)
    for count in (1, 3):
        lives = _history(tmp_path / str(count), [(30.0, "crashed", None)] * count)
        mtbf, failures, _ = mean_time_between_failures(lives)
        assert (mtbf, failures) == (pytest.approx(30.0), count)


def test_the_interval_falls_as_failures_come_more_often_and_rises_as_they_get_rarer(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    interval = SaveInterval("auto", mtbf_prior_s=MTBF_PRIOR_S, clock=clock)
    interval.saved(blocked_s=1.0)
    prior_only = interval.choice.interval_s
    interval.failures_seen(_history(tmp_path / "stormy", [(60.0, "crashed", None)] * 10))
    assert interval.choice.failures == 10
    assert interval.choice.interval_s < prior_only
    interval.failures_seen(_history(tmp_path / "calm", [(100_000.0, "crashed", None)]))
    assert interval.choice.interval_s > prior_only


def test_the_time_between_failures_is_training_time_not_restores(tmp_path: Path) -> None:
    """Each life counts from the end of its restore: 3 lives of 100 s, the last two
    spending 40 s restoring first, observe 100 + 60 + 60 s."""
    lives = _history(tmp_path, [(100.0, "crashed", None)] * 3)
    restored = [lives[0]] + [
        dataclasses.replace(r, resumed_at=r.started + 40.0)  # type: ignore[operator]
        for r in lives[1:]
    ]
    mtbf, failures, observed = mean_time_between_failures(restored)
    assert (failures, observed) == (3, pytest.approx(220.0))
    assert mtbf == pytest.approx(220.0 / 3)


def test_a_life_killed_unrecorded_ends_by_the_next_process_start(tmp_path: Path) -> None:
    """A SIGKILLed life has no end record: it ended before the next process started, not
    at that process's claim, which comes after its interpreter, imports and restore."""
    lives = _history(tmp_path, [(100.0, None, None), (50.0, "succeeded", None)])
    claimed = lives[1].started
    assert claimed is not None and lives[0].started == 0.0
    restarted = [lives[0], dataclasses.replace(lives[1], process_started=claimed - 30.0)]
    _, failures, observed = mean_time_between_failures(restarted)
    assert failures == 1
    assert observed == pytest.approx(70.0 + 50.0)  # not 100 + 50
    _, _, unknown = mean_time_between_failures(lives)  # older records: up to the claim
    assert unknown == pytest.approx(150.0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_claim_records_when_its_process_started(tmp_path: Path) -> None:
    store = Store(tmp_path.as_uri())
    before = time.time()
    assert claim_attempt(store, 0) == 0
    (record,) = read_attempts(store)
    assert record.process_started is not None and record.started is not None
    assert record.process_started <= record.started
    assert before - record.process_started < 24 * 3600  # this test process, not the machine


def test_the_current_attempt_is_running_not_failed(tmp_path: Path) -> None:
    records = _history(tmp_path, [(100.0, "crashed", None), (50.0, None, None)])
    mtbf, failures, observed = mean_time_between_failures(
        records, prior_s=1000.0, current=1, now=records[1].started + 400.0  # type: ignore[operator]
    )
    assert failures == 1
    assert observed == pytest.approx(500.0)
    assert mtbf == pytest.approx(500.0)  # and it grows while the current attempt runs on


# -- the public API over a real checkpoint: history, commits, rank agreement, records --------


def _lives(store_root: Path, monkeypatch: pytest.MonkeyPatch, lives: list[tuple[float, str]]) -> None:
    """Write the attempt records of earlier process lives with the real record functions,
    under a fake wall clock (no sleeping): each ran its seconds, then ended with its outcome."""
    now = [1_700_000_000.0]
    monkeypatch.setattr("taskpoint.format.history.time.time", lambda: now[0])
    store = Store(store_root.as_uri())
    for number, (ran, outcome) in enumerate(lives):
        assert claim_attempt(store, number) == number
        now[0] += ran
        record_end(store, number, outcome)  # type: ignore[arg-type]
        now[0] += 1.0  # the restart
    monkeypatch.undo()


def _first_auto_save(checkpoint: Checkpoint, clock: FakeClock, cost_s: float) -> SaveInterval:
    interval = SaveInterval.for_checkpoint(checkpoint, "auto", clock=clock)
    checkpoint.save_sync(b"state")
    interval.saved(blocked_s=cost_s)
    return interval


def test_a_new_run_uses_the_prior(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "1800")
    clock = FakeClock()
    interval = _first_auto_save(Checkpoint(tmp_path.as_uri()), clock, 1.0)
    choice = interval.choice
    assert (choice.mtbf_s, choice.failures, choice.prior_s) == (1800.0, 0, 1800.0)
    assert choice.interval_s == pytest.approx(math.sqrt(2 * 1.0 * 1800.0))
    explicit = SaveInterval.for_checkpoint(
        Checkpoint((tmp_path / "other").as_uri()), "auto", mtbf_prior_s=7200.0, clock=clock
    )
    explicit.saved(blocked_s=1.0)
    assert explicit.choice.mtbf_s == 7200.0


def test_the_interval_falls_as_the_runs_failures_come_often_and_rises_as_they_get_rare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's own attempt records, read from its store, set the mean time between
    failures: six crashes a minute apart shorten the interval below a new run's, six a
    day apart lengthen it."""
    clock = FakeClock()
    new_run = _first_auto_save(Checkpoint((tmp_path / "new").as_uri()), clock, 1.0).choice
    _lives(tmp_path / "stormy", monkeypatch, [(60.0, "crashed")] * 6)
    stormy = _first_auto_save(Checkpoint((tmp_path / "stormy").as_uri()), clock, 1.0).choice
    _lives(tmp_path / "calm", monkeypatch, [(86_400.0, "failed")] * 6)
    calm = _first_auto_save(Checkpoint((tmp_path / "calm").as_uri()), clock, 1.0).choice
    assert stormy.failures == calm.failures == 6
    assert stormy.observed_s == pytest.approx(6 * 60.0)
    assert stormy.interval_s < new_run.interval_s < calm.interval_s


def test_a_preempted_life_whose_save_committed_lost_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1_700_000_000.0]
    monkeypatch.setattr("taskpoint.format.history.time.time", lambda: now[0])
    store = Store(tmp_path.as_uri())
    for number, saved in enumerate(["committed", "committed", "committed", "missed"]):
        claim_attempt(store, number)
        now[0] += 60.0
        record_end(store, number, "preempted", preemption_save=saved)  # type: ignore[arg-type]
    monkeypatch.undo()
    choice = _first_auto_save(Checkpoint(tmp_path.as_uri()), FakeClock(), 1.0).choice
    assert choice.failures == 1, "only the preemption whose save was missed lost work"
    assert choice.observed_s == pytest.approx(240.0)


def test_a_background_uploads_cost_counts_until_its_commit(tmp_path: Path) -> None:
    """A background save through a real checkpoint: the steps that ran while its upload
    was in flight (held until the test lets it go) count what they lost, up to the
    commit the interval hears of; the steps after it run at full speed again."""
    checkpoint, interval, clock, release = _held_auto(tmp_path, 36_000.0)
    _train(interval, clock, 5, 1.0)  # a plain step takes 1 s
    checkpoint.save_sync(_payload(tmp_path, b"x"), background=True)
    interval.saved(blocked_s=0.1, background=True)
    assert interval.choice.save_cost_s == pytest.approx(0.1), "provisional: the time blocked"
    assert not interval.due()
    _train(interval, clock, 3, 1.5)  # beside the upload each step takes 0.5 s more
    assert interval.save_cost_s is None, "the upload is still in flight"
    release.set()
    assert checkpoint.wait(30)
    _train(interval, clock, 3, 1.0)
    assert interval.save_cost_s == pytest.approx(0.1 + 3 * 0.5)
    assert interval.choice.interval_s == pytest.approx(math.sqrt(2 * 1.6 * 36_000.0))


def test_due_follows_rank_zeros_answer() -> None:
    clock = FakeClock()
    interval = SaveInterval(10, clock=clock)
    clock.advance(11)
    assert interval.due()
    assert not interval.due(agree=lambda mine: False), "rank 0 says not yet"
    clock.advance(-5)
    asked: list[bool] = []
    assert interval.due(agree=lambda mine: asked.append(mine) or True), "rank 0 says now"
    assert asked == [False], "one call, with this rank's own answer"


def test_the_choice_is_recorded_for_taskpoint_show(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path.as_uri())
    clock = FakeClock()
    interval = SaveInterval.for_checkpoint(checkpoint, "auto", mtbf_prior_s=3600.0, clock=clock)
    checkpoint.save_sync(b"first")
    interval.saved(blocked_s=2.0)
    checkpoint.save_sync(b"second")  # the commit records the choice in force
    (record,) = read_attempts(Store(tmp_path.as_uri()))
    assert record.interval is not None
    assert record.interval["every"] == "auto"
    assert record.interval["rule"] == "young-daly"
    assert record.interval["interval_s"] == pytest.approx(120.0)
    assert record.interval["save_cost_s"] == pytest.approx(2.0)
    assert record.interval["prior_s"] == 3600.0
    metrics = interval.choice.metrics()
    assert metrics["taskpoint/interval_s"] == pytest.approx(120.0)
    assert metrics["taskpoint/save_cost_s"] == pytest.approx(2.0)
    assert SaveInterval(600).choice.metrics() == {"taskpoint/interval_s": 600.0}


def test_the_public_names() -> None:
    import taskpoint

    assert taskpoint.SaveInterval is SaveInterval
    assert taskpoint.IntervalChoice is SaveInterval("auto").choice.__class__


def test_a_garbage_interval_record_reads_as_unknown() -> None:
    assert IntervalChoice.from_record({"interval_s": "soon", "rule": "fixed"}) is None
    assert IntervalChoice.from_record({"interval_s": 5.0}) is None
    choice = IntervalChoice.from_record({"interval_s": 5.0, "rule": "young-daly", "failures": True})
    assert choice is not None and choice.failures == 0 and choice.save_cost_s is None
    full = IntervalChoice(120.0, "young-daly", 2.0, 3600.0, 1, 50.0, 3600.0)
    assert IntervalChoice.from_record(full.to_record()) == full


def test_a_schedule_that_changes_its_interval_records_only_the_new_one(tmp_path: Path) -> None:
    """An adapter's schedule makes a new interval when ``every_s`` changes; the old one's
    commit listener, still on the checkpoint, records nothing more."""
    checkpoint = Checkpoint(tmp_path.as_uri())
    clock = FakeClock()
    schedule = SaveSchedule(clock)
    schedule.start()
    clock.advance(600.0)
    assert schedule.due(checkpoint, 1, None, 600)
    checkpoint.save_sync(b"fixed")
    schedule.saved(blocked_s=0.5)
    assert schedule.due(checkpoint, 2, None, "auto"), "a new auto interval saves first"
    checkpoint.save_sync(b"auto")
    schedule.saved(blocked_s=0.5)
    checkpoint.save_sync(b"again")
    (record,) = read_attempts(Store(tmp_path.as_uri()))
    assert record.interval is not None and record.interval["every"] == "auto"


def test_timed_saves_make_their_interval_once_from_seconds_a_timedelta_or_the_users_own(
    tmp_path: Path,
) -> None:
    from datetime import timedelta

    ckpt = Checkpoint(tmp_path / "store")
    none = TimedSaves(None)
    none.start(ckpt)
    assert none.interval is None and none.choice is None and not none.due(lambda due: due)
    for spec, seconds in ((45.0, 45.0), (timedelta(minutes=2), 120.0)):
        timed = TimedSaves(spec)
        assert timed.choice is None  # made at training start
        timed.start(ckpt)
        made = timed.interval
        assert made is not None and timed.choice is not None
        assert timed.choice.interval_s == seconds
        timed.start(ckpt)
        assert timed.interval is made
        made.detach()
    clock = FakeClock()
    own = SaveInterval(30, clock=clock)
    timed = TimedSaves(own)
    timed.start(ckpt)
    assert timed.interval is own
    asked: list[bool] = []
    clock.advance(31.0)
    assert timed.due(lambda due: asked.append(due) or False) is False  # rank 0 said no
    assert asked == [True]
    assert timed.due(lambda due: due) is True
    timed.saved(blocked_s=-1.0, background=False)  # a clock step back counts as no wait
    assert not timed.due(lambda due: due)


def test_an_automatic_interval_is_no_shorter_than_a_background_upload(tmp_path: Path) -> None:
    """Saves asked for faster than uploads commit only replace the one queued: once a
    background save's call-to-commit time is measured, an automatic interval that Young/Daly
    puts below it rises to it (rule ``upload``); a fixed interval is left as given."""
    checkpoint, interval, clock, release = _held_auto(tmp_path, 50.0)
    _train(interval, clock, 3, 1.0)
    checkpoint.save_sync(_payload(tmp_path, b"x"), background=True)
    interval.saved(blocked_s=0.02, background=True)
    assert interval.choice.upload_s is None, "no upload measured before its commit"
    assert interval.choice.interval_s == pytest.approx(young_daly(0.02, 50.0))  # 1.41 s
    _train(interval, clock, 8, 0.9975)  # the upload takes 8 s from the call
    release.set()
    assert checkpoint.wait(30)
    choice = interval.choice
    assert choice.upload_s == pytest.approx(8.0)
    assert (choice.rule, choice.interval_s) == ("upload", pytest.approx(8.0))
    assert "upload 8 s" in choice.describe()
    assert "taskpoint/upload_s" not in choice.metrics()  # a save's own figure's name
    record = choice.to_record()
    assert record["upload_s"] == pytest.approx(8.0)
    restored = IntervalChoice.from_record(record)
    assert restored is not None and restored.to_record() == record
    assert not interval.due(), "7.98 s since the save: Young/Daly alone saved after 1.41 s"
    _train(interval, clock, 1, 0.1)
    assert interval.due()
    assert SaveInterval(2.0).choice.rule == "fixed"


def test_a_save_queued_behind_an_upload_counts_from_the_commit_before_it(tmp_path: Path) -> None:
    """Two background saves back to back: the second waits for the first's upload, so its
    own upload is timed from the first's commit, not from its call."""
    gate = [threading.Event(), threading.Event()]
    commits: list[object] = []

    uploading = threading.Event()

    def held(_moved: int) -> None:  # the first upload's progress, then the second's
        uploading.set()
        gate[min(len(commits), 1)].wait(30)

    checkpoint = Checkpoint(tmp_path.as_uri(), progress=held)
    checkpoint.on_commit(commits.append)
    clock = FakeClock()
    interval = SaveInterval.for_checkpoint(checkpoint, "auto", mtbf_prior_s=50.0, clock=clock)
    checkpoint.save_sync(_payload(tmp_path, b"x"), background=True)
    interval.saved(blocked_s=0.0, background=True)
    assert uploading.wait(30)  # the first is uploading: the second queues, not replaces it
    clock.advance(1.0)
    checkpoint.save_sync(_payload(tmp_path, b"y"), background=True)  # queued behind the first
    interval.saved(blocked_s=0.0, background=True)
    clock.advance(3.0)
    gate[0].set()  # the first commits 4 s after its call
    deadline = time.monotonic() + 30
    while interval.choice.upload_s is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert interval.choice.upload_s == pytest.approx(4.0)
    clock.advance(2.0)
    gate[1].set()  # the second, 2 s after the first's commit
    assert checkpoint.wait(30)
    assert interval.choice.upload_s == pytest.approx(0.8 * 4.0 + 0.2 * 2.0)


def test_a_resumed_run_starts_from_the_save_cost_its_last_attempt_recorded(
    tmp_path: Path,
) -> None:
    """A run's first automatic save is due at once, to measure its cost; a resumed run's is
    not: it takes the cost and upload time the attempt before it recorded, so it does not
    upload again the state it has just restored."""
    first = Checkpoint(tmp_path.as_uri(), attempt=0)
    first.mark_started()
    clock = FakeClock()
    interval = SaveInterval.for_checkpoint(first, "auto", mtbf_prior_s=3600.0, clock=clock)
    assert interval.choice.rule == "first-save" and interval.due()
    first.save_sync(b"first")
    interval.saved(blocked_s=2.0)
    first.save_sync(b"second")  # the commit records the choice: every 120 s on a 2 s save
    first.mark_ended("crashed")

    resumed = Checkpoint(tmp_path.as_uri(), attempt=1)
    resumed.mark_started()
    assert resumed.load_sync() is not None
    later = SaveInterval.for_checkpoint(resumed, "auto", mtbf_prior_s=3600.0, clock=clock)
    assert later.history_ready(30), "a resumed life reads the run's records on a thread"
    choice = later.choice
    assert choice.rule == "young-daly", "a resumed run measured nothing yet, but its run did"
    assert choice.save_cost_s == pytest.approx(2.0)
    assert choice.failures == 1
    assert choice.interval_s == pytest.approx(young_daly(2.0, choice.mtbf_s or 0.0))
    assert not later.due(), "due at once: the restored state would be uploaded again"
    _train(later, clock, 1, choice.interval_s)
    assert later.due()
    later.saved(blocked_s=1.0)  # its own saves blend in
    assert later.save_cost_s == pytest.approx(0.8 * 2.0 + 0.2 * 1.0)


def test_an_unusable_recorded_cost_leaves_the_first_save_to_measure_it(tmp_path: Path) -> None:
    """A negative or missing save cost in the record before (garbage, a fixed interval's
    record) is not taken: the resumed run measures its own, as a new run does."""
    store = Store(tmp_path.as_uri())
    for number, record in enumerate(
        [
            {"every": "auto", "interval_s": 10.0, "rule": "young-daly", "save_cost_s": -1.0},
            {"every": 60.0, "interval_s": 60.0, "rule": "fixed", "save_cost_s": None},
        ]
    ):
        claim_attempt(store, number)
        record_interval(store, number, record)
        record_end(store, number, "crashed")
    history = read_attempts(store)
    assert [r.interval is not None for r in history] == [True, True]
    interval = SaveInterval("auto", history=history, mtbf_prior_s=3600.0, clock=FakeClock())
    interval.failures_seen(history, current=None)
    assert interval.choice.rule == "first-save" and interval.due()


def test_the_resume_line_and_the_interval_share_one_read_of_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The resume line (at INFO) and the save interval share one read of the attempt
    records, made by the load, not again inside the first save call training waits on."""
    first = Checkpoint(tmp_path.as_uri(), attempt=0)
    first.mark_started()
    first.save_sync(b"state")
    reads: list[str] = []
    real = history_module.read_attempts

    def counted(store: Store) -> list[AttemptRecord]:
        reads.append(threading.current_thread().name)
        return real(store)

    monkeypatch.setattr(history_module, "read_attempts", counted)
    resumed = Checkpoint(tmp_path.as_uri(), attempt=1)
    resumed.mark_started()
    with caplog.at_level("INFO", logger="taskpoint"):
        assert resumed.load_sync() is not None
    assert any("resuming at" in r.getMessage() for r in caplog.records)
    interval = SaveInterval.for_checkpoint(resumed, "auto", clock=FakeClock())
    assert interval.choice.failures == 1, "attempt 0 left no end record: it died"
    assert reads == [threading.current_thread().name], "read once, by the load itself"
    assert [r.attempt for r in resumed.attempts()] == [0, 1], "attempts() reads afresh"
    assert len(reads) == 2


def test_a_resumed_lifes_first_save_call_does_not_wait_for_the_runs_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed life's automatic interval reads the run's attempt records (a request per
    record, more with every restart) on a thread: the save call that makes the interval
    returns while the read is held, no timed save is due until the records are in, and
    then the choice rests on them."""
    first = Checkpoint(tmp_path.as_uri(), attempt=0)
    first.mark_started()
    clock = FakeClock()
    interval = SaveInterval.for_checkpoint(first, "auto", mtbf_prior_s=3600.0, clock=clock)
    first.save_sync(b"first")
    interval.saved(blocked_s=2.0)
    first.save_sync(b"second")  # records the choice: a 2 s save
    first.mark_ended("crashed")

    release = threading.Event()
    real = history_module.read_attempts

    def held(store: Store) -> list[AttemptRecord]:
        assert release.wait(30), "the test never released the read"
        return real(store)

    monkeypatch.setattr(history_module, "read_attempts", held)
    resumed = Checkpoint(tmp_path.as_uri(), attempt=1)
    resumed.mark_started()
    assert resumed.load_sync() is not None  # at WARNING: no resume line reads the records
    made: list[SaveInterval] = []
    maker = threading.Thread(
        target=lambda: made.append(
            SaveInterval.for_checkpoint(resumed, "auto", mtbf_prior_s=3600.0, clock=clock)
        )
    )
    maker.start()
    maker.join(10)
    try:
        assert made, "making the interval waited for the run's records"
        later = made[0]
        assert not later.history_ready(0)
        _train(later, clock, 1, 100_000.0)
        assert not later.due(), "a save came due before the run's records were in"
    finally:
        release.set()
        maker.join(30)
    assert later.history_ready(30)
    choice = later.choice
    assert (choice.rule, choice.failures) == ("young-daly", 1)
    assert choice.save_cost_s == pytest.approx(2.0)
    assert later.due(), "the interval has long passed"
