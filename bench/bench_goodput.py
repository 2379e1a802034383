"""Goodput benchmark for issue #33: a job that keeps failing, restarted as an orchestrator
would, checkpointed by taskpoint and the plain way, side by side in one run.

Run: uv run python bench/bench_goodput.py [--size-mb 200] [--steps 160] [--step-s 0.25]
        [--failures 4] [--seed 0] [--regimes a,b] [--grace 30] [--restart-delay 1]
        [--json PATH]

The job (``bench/_goodput_job.py``): ``--size-mb`` of fp32 state (parameters and SGD
momentum, every element changing at every step, as an optimizer step changes them; the
gradients come from torch's RNG, so an exact resume needs the RNG state too); the
accelerator's compute is a sleep of ``--step-s`` per step (the CPU idles while a GPU
computes), then the optimizer step. Two ways to checkpoint it:

- taskpoint: the PyTorch guide's loop (``TaskpointState(model, opt, blocking=False,
  save_on_exception=True)``, ``save_sync(ckpt, step=step, every=N)`` at every step;
  ``--no-save-on-exception`` drops the save at an exception), its checkpoint from
  ``taskpoint.ctx()`` under the environment contract, exactly as the Kubernetes Job recipe
  of docs/preemption.md sets it (``TASKPOINT_ROOT``, ``TASKPOINT_ACTION``,
  ``TASKPOINT_RUN_ID``, ``TASKPOINT_GRACE_PERIOD``; ``--save-on-preemption`` adds
  ``TASKPOINT_SAVE_ON_PREEMPTION=1``, which the recipe does not set);
- plain: ``torch.save`` of the model, optimizer and RNG state every N steps and a blocking
  ``boto3`` ``upload_file`` of ``latest.pt`` to the same S3 server, resumed from it. It is
  the careful plain job: a SIGTERM handler sets a flag, and the next step boundary saves,
  uploads and exits. The comparison does not rest on plain forgetting that.

Both store on one SeaweedFS S3 server on loopback that the bench starts (moto where the
``weed`` binary cannot run; the output says which).

The driver restarts the job as an orchestrator restarts a pod: after each failure, a new
process with the same run id, after ``--restart-delay`` seconds, with a fresh working folder
and ``TMPDIR`` (a new node's local disk). A life is a pod: its processes form one process
group, SIGTERM goes to the main process (as the kubelet sends it), SIGKILL to the whole
group, and when the main process exits whatever it left running is killed (the container
stops): an upload process that outlives the trainer dies with its node.

The failure schedule (``--seed``, ``--failures``): SIGTERM with a grace period of
``--grace`` seconds (then SIGKILL to the group if the life is still alive), SIGKILL without
warning, and an exception raised by the job; each kind at least once, the rest drawn. Failure
k hits the life that first reaches training step ``s_k`` (the steps are drawn one per equal
segment of the middle 80% of the run, so they increase), at the start of that step, while
its compute runs: the signal is sent as the job announces the step; the exception is raised
before it. Why steps, not wall time: both sides then meet the same failures at the same
points of the same work, whatever each spent on saving, so the steps a failure throws away
compare failure by failure (the SIGKILL target below is such a comparison); a schedule in
wall time would also hit the slower side with more failures, which favours the faster side:
counting in steps is the conservative choice for the side with less overhead. A life that
fails unplanned (a crash) is restarted too, and the next life still owes the pending
failure. The schedule is the same for both sides and both regimes.

Two regimes, from the time one upload of the state takes (``U``, measured first with the
plain job's own save, or ``--upload-s``): (a) a save every ``3 U`` of training; (b) a save
every ``U / 2``, faster than the store takes them (``--every-a`` / ``--every-b`` set the
steps between saves instead).

What is measured, from inside the job (each life appends timestamps to a small JSON log in
the driver's folder; the driver adds when it started each life, signalled it and saw it
exit):

- wall: from the first life's start to the end of training in the last (its last save
  committed);
- uninterrupted: the same job with no checkpoint and no failure, run once (it also gives
  the final weights' SHA-256 that every side must end with, bit for bit);
- goodput = uninterrupted / wall;
- badput by cause: ``blocked`` (time training spent inside save calls: the plain
  ``torch.save`` plus upload; taskpoint's ``save_sync``, including a preemption save, the
  save at an exception and the final ``wait``), ``restore`` (the time the job spent in the
  checkpoint library's restore, from importing it, taskpoint or boto3, to the state
  restored: taskpoint imports its S3 client at its first store call, so both sides count
  the same work; taskpoint's job calls ``prefetch()`` before it builds its state, and that
  call counts here too, while the download it started runs beside the build, which
  ``--no-prefetch`` leaves out), ``recomputed`` (compute of the steps a
  failure threw away: done in a life beyond the step the next life resumed at, including the
  step in progress), ``restart`` (from a life's death to the next life's restore: the
  restart delay, the process start, the imports, building the state, and a dying life's
  exit), and ``other``, what is left of ``wall - uninterrupted``, itself split into the
  first life's start against the reference's, the kept steps' compute against the
  reference's (slowed by background work or by load; negative when they ran faster), and
  the rest (which stays near 0 when the parts above account for the run);
- steps lost per failure: the last step a life completed minus the step the next resumed at.

Targets, each a ratio from this one run: (a) taskpoint's checkpoint badput (blocked +
restore + recomputed) at most a third of plain's, and its goodput above plain's; (b)
taskpoint's goodput not below plain's, and each SIGKILL recomputes at most one upload's
worth of steps (``ceil(U / step)``, ``U`` the plain run's median upload) more than
plain's; in both, every resume exact (the final weights equal the uninterrupted run's) and
every SIGTERM loses 0 steps. The load average is printed at the start and the end: run it
on an otherwise idle machine. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Moto, Weed, note

JOB = Path(__file__).resolve().parent / "_goodput_job.py"
KINDS = ("sigterm", "sigkill", "exception")
SENT_SHARE_MIN = 0.95
"""The share of their payload bytes the kept taskpoint saves sent (the rest was found in the
store already) at or below which the bench warns that the job's state repeats itself."""
_LIVE: set[int] = set()
"""Process groups of lives still running: killed if the bench itself is stopped."""


# -- the failure schedule ------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """The ``index``-th failure of the schedule: ``kind`` when a life reaches ``step``."""

    index: int
    kind: str
    step: int


def schedule(seed: int, count: int, steps: int) -> list[Failure]:
    """``count`` failures drawn from ``seed``: every kind once (when ``count`` allows), the
    rest drawn; step ``k`` drawn from the ``k``-th of ``count`` equal segments of steps
    ``[0.1 steps, 0.9 steps]``, so steps increase and each life has work to lose."""
    if count < 0:
        raise ValueError(f"--failures must be 0 or more; got {count}")
    rng = random.Random(seed)
    kinds = list(KINDS[:count]) + [rng.choice(KINDS) for _ in range(count - len(KINDS))]
    rng.shuffle(kinds)
    low, high = 0.1 * steps, 0.9 * steps
    width = (high - low) / max(count, 1)
    chosen: list[Failure] = []
    last = 1
    for k, kind in enumerate(kinds):
        lo = math.ceil(low + k * width + 0.2 * width)
        hi = math.floor(low + (k + 1) * width - 0.2 * width)
        step = max(last + 1, rng.randint(lo, max(lo, hi)))
        if step >= steps:
            raise ValueError(f"--steps {steps} is too few for {count} failures")
        chosen.append(Failure(k, kind, step))
        last = step
    return chosen


# -- running lives -------------------------------------------------------------------------


@dataclass
class Life:
    """One process of a run, as the driver saw it, and its log."""

    index: int
    spawn: float
    failure: Failure | None = None
    signalled: float | None = None  # when the scheduled signal was sent
    grace_killed: float | None = None  # when the group was killed at the grace period's end
    exit: float | None = None
    rc: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)


def _run_life(index: int, env: dict[str, str], node: Path, log: Path, err: Path,
              failure: Failure | None, grace: float, limit_s: float) -> Life:
    """Start one life in ``node`` (its local disk), deliver its signal, wait for its end."""
    node.mkdir(parents=True)
    (node / "tmp").mkdir()
    env = {**env, "BENCH_LOG": str(log), "TMPDIR": str(node / "tmp")}
    if failure is not None and failure.kind == "exception":
        env["BENCH_FAIL_EXCEPTION"] = str(failure.step)
    with err.open("wb") as err_fh:
        proc = subprocess.Popen(
            [sys.executable, str(JOB)], cwd=node, env=env, stdout=subprocess.PIPE,
            stderr=err_fh, start_new_session=True,
        )
        life = Life(index, time.time(), failure)
        _LIVE.add(proc.pid)
        to_send = failure.kind if failure is not None and failure.kind != "exception" else None

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").split()
                if (to_send and failure is not None and life.signalled is None
                        and line[:1] == ["STEP"] and int(line[1]) == failure.step):
                    life.signalled = time.time()
                    if to_send == "sigterm":
                        proc.send_signal(signal.SIGTERM)  # the main process, as the kubelet
                    else:
                        os.killpg(proc.pid, signal.SIGKILL)  # the node goes

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while True:
            try:
                life.rc = proc.wait(timeout=0.02)
                break
            except subprocess.TimeoutExpired:
                now = time.time()
                if (life.signalled is not None and to_send == "sigterm"
                        and life.grace_killed is None and now > life.signalled + grace):
                    life.grace_killed = now
                    os.killpg(proc.pid, signal.SIGKILL)
                if now > life.spawn + limit_s:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise RuntimeError(
                        f"life {index} ran past {limit_s:.0f} s; see {err}") from None
        life.exit = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the container stops: its leftovers go
        _LIVE.discard(proc.pid)
        reader.join(5)
    life.events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return life


@dataclass
class Side:
    """One side of one regime (or the reference run): its settings and its lives."""

    name: str
    every: int
    lives: list[Life] = field(default_factory=list)
    fired: list[tuple[Failure, int]] = field(default_factory=list)  # failure, life index


def run_side(side: Side, base_env: dict[str, str], folder: Path, failures: list[Failure],
             grace: float, restart_delay: float, limit_s: float) -> Side:
    """Run ``side``'s job to its end, restarting it after each failure."""
    folder.mkdir(parents=True)
    env = {**base_env, "BENCH_SIDE": side.name, "BENCH_EVERY": str(side.every)}
    pending = list(failures)
    for index in range(len(failures) + 4):
        failure = pending[0] if pending else None
        node = folder / f"node-{index}"
        life = _run_life(index, env, node, folder / f"life-{index}.jsonl",
                         folder / f"life-{index}.err", failure, grace, limit_s)
        shutil.rmtree(node, ignore_errors=True)  # the node is gone
        side.lives.append(life)
        if any(e["ev"] == "end" for e in life.events):
            if life.rc != 0:
                raise RuntimeError(f"{side.name}: life {index} trained to its end but exited "
                                   f"{life.rc}; see {folder / f'life-{index}.err'}")
            return side
        fired = failure is not None and (
            life.signalled is not None
            or any(e["ev"] == "raise" for e in life.events))
        if fired and failure is not None:
            side.fired.append((failure, index))
            pending.pop(0)
        else:
            tail = (folder / f"life-{index}.err").read_text(errors="replace")[-2000:]
            print(f"  {side.name}: life {index} failed unplanned (exit {life.rc}):\n{tail}",
                  flush=True)
        time.sleep(restart_delay)
    raise RuntimeError(f"{side.name}: no life finished the job; logs in {folder}")


# -- accounting (pure: lives and logs in, figures out) ---------------------------------------


@dataclass
class LifeView:
    """What one life's log says, with the time of its death filled in."""

    spawn: float
    death: float
    restore: tuple[float, float, int] | None  # t0, t1, step resumed at
    prefetch_s: float  # in the checkpoint library's calls before the state was built
    steps: dict[int, tuple[float, float | None]]  # s -> (t0, t1)
    saves: list[tuple[float, float | None, float | None]]  # t0, t1, upload_s
    reached: int  # last step completed
    saved: int  # saves made (a save call that saved, a preemption save tried)
    end: float | None
    sha256: str | None


def view(life: Life) -> LifeView:
    """Read ``life``'s log: merge the start and end lines of each step and save, and date
    its death (the kill, else its last logged moment)."""
    steps: dict[int, tuple[float, float | None]] = {}
    saves: dict[float, tuple[float, float | None, float | None]] = {}
    saved: set[float] = set()
    restore = end = sha = None
    prefetch_s = 0.0
    last = life.spawn
    for e in life.events:
        for key in ("t", "t0", "t1"):
            if isinstance(e.get(key), (int, float)):
                last = max(last, e[key])
        if e["ev"] == "step":
            steps[e["s"]] = (e["t0"], e.get("t1"))
        elif e["ev"] == "save":
            saves[e["t0"]] = (e["t0"], e.get("t1"), e.get("upload_s"))
            if e.get("saved"):
                saved.add(e["t0"])
        elif e["ev"] == "restore":
            restore = (e["t0"], e["t1"], int(e["step"]))
        elif e["ev"] == "prefetch" and "t1" in e:
            prefetch_s += e["t1"] - e["t0"]
        elif e["ev"] == "end":
            end = e["t"]
        elif e["ev"] == "hash":
            sha = e["sha256"]
    death = last  # it exited on its own: after its last logged moment
    if life.rc is not None and life.rc < 0:  # a signal ended it: the one the driver sent
        death = max(last, life.grace_killed or life.signalled or last)
    done = [s for s, (_, t1) in steps.items() if t1 is not None]
    reached = max(done) if done else (restore[2] if restore else 0)
    return LifeView(life.spawn, death, restore, prefetch_s, steps, list(saves.values()),
                    reached, len(saved), end, sha)


def _startup(v: LifeView) -> float:
    """From the process's start to its restore (imports, building the state), less the
    checkpoint library's calls made before (a prefetch's)."""
    return (v.restore[0] if v.restore else v.death) - v.spawn - v.prefetch_s


def _compute(v: LifeView, upto: int | None = None) -> float:
    """Compute time of ``v``'s completed steps (up to step ``upto``)."""
    return sum(t1 - t0 for s, (t0, t1) in v.steps.items()
               if t1 is not None and (upto is None or s <= upto))


def account(side: Side, reference: LifeView) -> dict[str, Any]:
    """Goodput and badput by cause of ``side``'s finished run (see the module docstring),
    against the uninterrupted ``reference`` run."""
    assert reference.end is not None, "the reference run did not finish"
    uninterrupted_s = reference.end - reference.spawn
    views = [view(life) for life in side.lives]
    last = views[-1]
    assert last.end is not None, "the run did not finish"
    wall = last.end - views[0].spawn
    blocked = sum((t1 if t1 is not None else v.death) - t0
                  for v in views for t0, t1, _ in v.saves)
    restore = sum((v.restore[1] - v.restore[0] if v.restore else 0.0) + v.prefetch_s
                  for v in views)
    recomputed = restart = 0.0
    per_life: list[dict[str, Any]] = []
    for i, v in enumerate(views):
        if i:
            restart += ((v.restore[0] if v.restore else v.death) - views[i - 1].death
                        - v.prefetch_s)
        if v is last:
            break
        after = next((w.restore[2] for w in views[i + 1:] if w.restore), 0)
        lost_s = sum((t1 if t1 is not None else v.death) - t0
                     for s, (t0, t1) in v.steps.items() if s > after)
        recomputed += lost_s
        per_life.append({"life": i, "reached": v.reached, "next_resumed": after,
                         "steps_lost": max(0, v.reached - after), "recomputed_s": lost_s})
    uploads = [u for v in views for _, _, u in v.saves if u is not None]
    badput = {"blocked": blocked, "restore": restore, "recomputed": recomputed,
              "restart": restart}
    badput["other"] = wall - uninterrupted_s - sum(badput.values())
    # What "other" holds: the first start against the reference's, the kept steps' compute
    # against the reference's (slowed by background work, or by load), and the rest.
    kept = sum(_compute(v, next((w.restore[2] for w in views[i + 1:] if w.restore), 0))
               for i, v in enumerate(views[:-1])) + _compute(last)
    other = {"first_start": _startup(views[0]) - _startup(reference),
             "slower_steps": kept - _compute(reference)}
    other["rest"] = badput["other"] - sum(other.values())
    lost_by_life = {row["life"]: row for row in per_life}
    failures = [{"index": f.index, "kind": f.kind, "step": f.step, "life": life,
                 "steps_lost": lost_by_life[life]["steps_lost"],
                 "recomputed_s": lost_by_life[life]["recomputed_s"]}
                for f, life in side.fired]
    return {
        "side": side.name, "every": side.every, "wall_s": wall, "lives": len(views),
        "goodput": uninterrupted_s / wall, "badput_s": badput, "other_s": other,
        "checkpoint_badput_s": blocked + restore + recomputed,
        "saves": sum(v.saved for v in views),
        "upload_s": statistics.median(uploads) if uploads else None,
        "sha256": last.sha256, "failures": failures, "lives_detail": per_life,
    }


def from_records(url: str, options: dict[str, Any], step_s: float) -> dict[str, Any]:
    """What the run's own records in the store say (:mod:`taskpoint.inspect.goodput`, as
    ``taskpoint show`` would), for comparison with what the job measured."""
    import taskpoint
    from taskpoint.format.history import read_attempts
    from taskpoint.inspect.goodput import goodput
    from taskpoint.store.store import Store

    history = read_attempts(Store(url, options))
    manifests = taskpoint.Checkpoint(url, storage_options=options).committed()
    figures = goodput(history, manifests, step_s=step_s)
    return {"attempts": len(figures.attempts), "wall_s": figures.wall_s,
            "goodput": figures.goodput, "badput_s": dict(figures.badput_s),
            "steps_lost": figures.steps_lost, "missing": list(figures.missing),
            "sent_share": _sent_share(manifests)}


def _sent_share(manifests: Sequence[Any]) -> float | None:
    """The share of their payload bytes that the kept saves sent to the store. The job's
    state changes completely every step, so it must be about 1: less means the saves found
    chunks to share, and the job no longer measures what it claims (a state of one repeated
    value per tensor once halved what taskpoint sent, against plain's whole upload)."""
    from taskpoint.inspect.timeline import save_stats

    sent = size = 0
    for manifest in manifests:
        uploaded = save_stats(manifest)["uploaded"]
        if uploaded is not None and manifest.size:
            sent, size = sent + uploaded, size + manifest.size
    return sent / size if size else None


def _print_records(r: dict[str, Any]) -> None:
    def sec(value: float | None) -> str:
        return "?" if value is None else f"{value:.1f} s"

    b = r["badput_s"]
    note(f"{'':<9} its records say: {r['attempts']} attempts, wall {sec(r['wall_s'])}, "
         f"goodput {'?' if r['goodput'] is None else format(r['goodput'], '.3f')}; blocked "
         f"{sec(b['blocked'])}, restore {sec(b['restore'])}, recomputed "
         f"{sec(b['recomputed'])}, restart {sec(b['restart'])}")
    for line in r["missing"]:
        note(f"{'':<11} ({line})")
    share = r["sent_share"]
    if share is not None:
        warning = "" if share > SENT_SHARE_MIN else (
            "; WARNING: the state should share no chunks between saves, so this is not "
            "the job the bench describes")
        note(f"{'':<11} (its kept saves sent {share:.2f} of their payload bytes{warning})")


def step_seconds(reference: Side) -> float:
    """The mean time of one step (its compute) in the uninterrupted run."""
    v = view(reference.lives[-1])
    return statistics.mean(t1 - t0 for t0, t1 in v.steps.values() if t1 is not None)


# -- the bench -------------------------------------------------------------------------------


def _print_side(r: dict[str, Any], reference_sha: str | None) -> None:
    b = r["badput_s"]
    exact = "exact" if r["sha256"] == reference_sha else "NOT EXACT"
    note(f"{r['side']:<9} wall {r['wall_s']:7.1f} s  goodput {r['goodput']:.3f}  lives "
         f"{r['lives']}  saves {r['saves']}  final weights {exact}")
    note(f"{'':<9} badput: blocked {b['blocked']:6.1f} s  restore {b['restore']:5.1f} s  "
         f"recomputed {b['recomputed']:5.1f} s  restart {b['restart']:5.1f} s  "
         f"other {b['other']:+5.1f} s")
    o = r["other_s"]
    note(f"{'':<9} checkpoint badput {r['checkpoint_badput_s']:.1f} s; other = first start "
         f"{o['first_start']:+.1f} s, slower steps {o['slower_steps']:+.1f} s, "
         f"rest {o['rest']:+.1f} s")
    for f in r["failures"]:
        note(f"{'':<9} failure {f['index']}: {f['kind']:<9} at step {f['step']:>4}: "
             f"{f['steps_lost']:>3} steps lost, {f['recomputed_s']:5.1f} s recomputed")


def _summary(regime: str, tp: dict[str, Any], plain: dict[str, Any], reference_sha: str | None,
             step_s: float, upload_s: float) -> list[tuple[str, bool]]:
    """The regime's target checks, as (label, passed); ``upload_s`` is the calibration's,
    used where the plain run recorded no upload."""
    upload_steps = math.ceil((plain["upload_s"] or upload_s) / step_s)
    checks: list[tuple[str, bool]] = []
    if regime == "a":
        ratio = tp["checkpoint_badput_s"] / max(plain["checkpoint_badput_s"], 1e-9)
        checks.append((f"checkpoint badput {ratio:.2f} of plain's <= 0.33", ratio <= 1 / 3))
        checks.append((f"goodput {tp['goodput']:.3f} > plain's {plain['goodput']:.3f}",
                       tp["goodput"] > plain["goodput"]))
    else:
        checks.append((f"goodput {tp['goodput']:.3f} >= plain's {plain['goodput']:.3f}",
                       tp["goodput"] >= plain["goodput"]))
        plain_lost = {f["index"]: f["steps_lost"] for f in plain["failures"]}
        extra = [f["steps_lost"] - plain_lost[f["index"]] for f in tp["failures"]
                 if f["kind"] == "sigkill" and f["index"] in plain_lost]
        worst = max(extra, default=0)
        checks.append((f"SIGKILL lost <= plain's + {upload_steps} (worst +{worst})",
                       worst <= upload_steps))
    checks.append(("final weights exact", tp["sha256"] == reference_sha))
    sigterm = [f["steps_lost"] for f in tp["failures"] if f["kind"] == "sigterm"]
    plain_sigterm = sum(f["steps_lost"] for f in plain["failures"] if f["kind"] == "sigterm")
    checks.append((f"SIGTERM lost {sum(sigterm)} steps (plain {plain_sigterm})",
                   sum(sigterm) == 0))
    return checks


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def start_store() -> Weed | Moto:
    """The S3 server the lives store on: SeaweedFS on loopback without a volume limit
    (every save of this state is new bytes: tens of GB over the whole bench), moto where
    the ``weed`` binary cannot run (printed)."""
    try:
        return Weed(volumes=0)
    except Exception as exc:
        print(f"SeaweedFS unavailable ({exc}); falling back to moto", flush=True)
        return Moto()


def job_env(server: Weed | Moto, size_mb: float, step_s: float, seed: int) -> dict[str, str]:
    """The environment every life of every side starts with: this process's, the S3
    server's credentials and endpoint, and the job's ``BENCH_*`` sizes."""
    options: dict[str, Any] = server.options
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_ENDPOINT_URL_S3": options["client_kwargs"]["endpoint_url"],
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "BENCH_SIZE_MB": str(size_mb), "BENCH_STEP_S": str(step_s),
        "BENCH_SEED": str(seed), "BENCH_BUCKET": "bench",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH")])),
    }


def kill_lives() -> None:
    """Kill every life still running (the bench is ending, or was stopped)."""
    for group in list(_LIVE):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def clean_up(server: Weed | Moto | None, folder: Path, *, keep: bool) -> None:
    """The bench's end, however it ends: every life killed, the S3 server stopped, and the
    lives' logs folder removed (kept, and its path printed, with ``keep``)."""
    kill_lives()
    if server is not None:
        server.stop()
    if keep:
        print(f"logs kept in {folder}", flush=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=200, help="state size (MiB)")
    parser.add_argument("--steps", type=int, default=160, help="training steps")
    parser.add_argument("--step-s", type=float, default=0.25, help="compute per step (s)")
    parser.add_argument("--failures", type=int, default=4, help="failures per run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule and the job")
    parser.add_argument("--regimes", default="a,b", help="a, b or a,b")
    parser.add_argument("--sides", default="plain,taskpoint", help="plain, taskpoint or both")
    parser.add_argument("--grace", type=float, default=30.0, help="SIGTERM's grace period (s)")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="seconds")
    parser.add_argument("--upload-s", type=float, help="one upload's time (default: measured)")
    parser.add_argument("--every-a", type=int, help="steps between saves in regime a")
    parser.add_argument("--every-b", type=int, help="steps between saves in regime b")
    parser.add_argument("--save-on-preemption", action="store_true",
                        help="set TASKPOINT_SAVE_ON_PREEMPTION=1 (the recipe does not)")
    parser.add_argument("--no-save-on-exception", action="store_true",
                        help="taskpoint's job saves nothing at an exception")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="taskpoint's job restores only once its state is built")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = parser.parse_args()
    regimes = [r for r in args.regimes.split(",") if r]
    sides = [s for s in args.sides.split(",") if s]
    if not set(regimes) <= {"a", "b"} or not set(sides) <= {"plain", "taskpoint"}:
        parser.error("--regimes takes a and/or b; --sides plain and/or taskpoint")
    failures = schedule(args.seed, args.failures, args.steps)
    signal.signal(signal.SIGTERM, _stop)

    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} "
          f"{load_start[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="tp-bench-goodput-"))
    server: Weed | Moto | None = None
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               "schedule": [asdict(f) for f in failures],
                               "load_start": load_start}
    try:
        server = start_store()
        options: dict[str, Any] = server.options
        prefix = uuid.uuid4().hex[:8]
        base = job_env(server, args.size_mb, args.step_s, args.seed)
        print(f"store s3:// ({server.name} on 127.0.0.1); state {args.size_mb:g} MiB, "
              f"{args.steps} steps of {args.step_s:g} s compute; schedule: "
              + ", ".join(f"{f.kind}@{f.step}" for f in failures), flush=True)
        ideal_limit = 60 + args.steps * args.step_s * 10

        # One upload's time, from the plain job's own saves (the first warms up).
        upload_s = args.upload_s
        if upload_s is None:
            calib = run_side(Side("plain", 1), {**base, "BENCH_STEPS": "3",
                                                "BENCH_KEY": f"{prefix}/calibrate/latest.pt"},
                             folder / "calibrate", [], args.grace, 0, ideal_limit)
            uploads = [u for _, t1, u in view(calib.lives[-1]).saves[1:] if u is not None]
            upload_s = statistics.median(uploads)
        # The uninterrupted reference: no checkpoint, no failure.
        reference = run_side(Side("none", 1), {**base, "BENCH_STEPS": str(args.steps)},
                             folder / "reference", [], args.grace, 0, ideal_limit)
        ref = view(reference.lives[-1])
        assert ref.end is not None
        uninterrupted = ref.end - ref.spawn
        step = step_seconds(reference)
        upload_steps = math.ceil(upload_s / step)
        print(f"uninterrupted run {uninterrupted:.1f} s (a step {step:.3f} s); one upload "
              f"{upload_s:.2f} s = {upload_steps} steps", flush=True)
        results.update(uninterrupted_s=uninterrupted, step_s=step, upload_s=upload_s,
                       reference_sha256=ref.sha256, regimes={})

        summaries: list[str] = []
        for regime in regimes:
            if regime == "a":
                every = args.every_a or max(1, round(3 * upload_s / step))
                what = "a save every ~3 uploads"
            else:
                every = args.every_b or max(1, math.floor(upload_s / 2 / step))
                what = "saves faster than uploads"
            print(f"\nregime ({regime}): {what}: every {every} steps = {every * step:.1f} s",
                  flush=True)
            out: dict[str, dict[str, Any]] = {}
            for name in sides:
                env = {**base, "BENCH_STEPS": str(args.steps),
                       "BENCH_KEY": f"{prefix}/{regime}/plain/latest.pt"}
                if name == "taskpoint":
                    env.update(TASKPOINT_ROOT=f"s3://bench/{prefix}/{regime}",
                               TASKPOINT_ACTION="train", TASKPOINT_RUN_ID="goodput",
                               TASKPOINT_GRACE_PERIOD=f"{args.grace:g}")
                    if args.save_on_preemption:
                        env["TASKPOINT_SAVE_ON_PREEMPTION"] = "1"
                    if args.no_save_on_exception:
                        env["BENCH_SAVE_ON_EXCEPTION"] = "0"
                    if args.no_prefetch:
                        env["BENCH_PREFETCH"] = "0"
                run = run_side(Side(name, every), env, folder / regime / name, failures,
                               args.grace, args.restart_delay, ideal_limit)
                out[name] = account(run, ref)
                _print_side(out[name], ref.sha256)
                if name == "taskpoint":
                    out[name]["records"] = from_records(
                        f"s3://bench/{prefix}/{regime}/train/goodput", options, step)
                    _print_records(out[name]["records"])
            results["regimes"][regime] = {"every": every, **out}
            if {"plain", "taskpoint"} <= out.keys():
                checks = _summary(regime, out["taskpoint"], out["plain"], ref.sha256, step,
                                  upload_s)
                for label, ok in checks:
                    note(f"({regime}) {label:<70} {'PASS' if ok else 'MISS'}")
                summaries.append(
                    f"regime ({regime}) every {every} steps: goodput taskpoint "
                    f"{out['taskpoint']['goodput']:.3f} plain {out['plain']['goodput']:.3f}; "
                    + "; ".join(f"{label} {'PASS' if ok else 'MISS'}" for label, ok in checks))
        load_end = os.getloadavg()
        results["load_end"] = load_end
        print("", flush=True)
        for line in summaries:
            print(line, flush=True)
        print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}",
              flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    finally:
        clean_up(server, folder, keep=args.keep)


if __name__ == "__main__":
    main()
