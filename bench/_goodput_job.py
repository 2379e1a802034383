"""The training job :mod:`bench_goodput` restarts: one process is one life of one run.

Run by the bench, never by hand: ``python bench/_goodput_job.py``, configured by the
environment (``BENCH_*`` below, and for the taskpoint side the ``TASKPOINT_*`` variables of
the Kubernetes recipe in docs/preemption.md). Its working folder and ``TMPDIR`` are a fresh
folder per life (a new node's local disk).

The job: ``BENCH_SIZE_MB`` of state, half fp32 parameters, half SGD momentum buffers, with
every element changing at every step (an optimizer step: the gradient of each tensor is its
weights times a scalar drawn from torch's global RNG, so an exact resume must restore the RNG
too, and no two chunks of the state are alike); the
accelerator's compute is a sleep of ``BENCH_STEP_S`` per step, the CPU idling as it does
while a GPU computes. ``BENCH_STEPS`` steps in all, a save every ``BENCH_EVERY`` steps and
after the last step. On the taskpoint side ``BENCH_EVERY_S`` (seconds, or ``auto``), when
set, replaces ``BENCH_EVERY``: ``save_sync(ckpt, step=step, every_s=...)`` at every step, a
save by training time (:mod:`bench_interval`'s sweep).

``BENCH_SIDE`` picks how it checkpoints:

- ``taskpoint``: the PyTorch guide's loop under the environment contract
  (``taskpoint.ctx().checkpoint.prefetch()`` before the state is built, as the guide's
  restart section has it, ``TaskpointState(model, opt, blocking=False,
  save_on_exception=True)``, ``save_sync(ckpt, step=step, every=N)`` at every step,
  ``state.wait()`` at the end; ``BENCH_SAVE_ON_EXCEPTION=0`` drops the save at an
  exception, ``BENCH_PREFETCH=0`` the prefetch);
- ``plain``: ``torch.save`` of the model's, the optimizer's and the RNG's state to
  ``latest.pt`` on the local disk and a blocking ``boto3`` ``upload_file`` of it to the same
  S3 server, restored from there; a careful plain job: SIGTERM sets a flag, and the next
  step boundary saves, uploads and exits (143);
- ``none``: no checkpoint at all (the uninterrupted reference run).

What it does is timed from inside and appended, one JSON object a line, to ``BENCH_LOG``
(flushed at once, so a SIGKILL loses nothing written before it)::

    {"ev": "main", "t"}                        the interpreter runs this file
    {"ev": "prefetch", "t0", "t1"}             taskpoint's calls before the state is built:
                                               its import, ``ctx()`` and ``prefetch()``
    {"ev": "restore", "t0", "t1", "step"}      the restore (step 0: nothing to restore),
                                               from loading the checkpoint library
                                               (taskpoint, or boto3 and its client); after
                                               a prefetch, from the adapter's making
    {"ev": "step", "s", "t0", "t1"}            step s (1-based) computed; no t1 when it died
    {"ev": "save", "s", "t0", "t1", "upload_s", "preempt", "saved"}
                                               training blocked in a save call (every
                                               save_sync call on the taskpoint side, and
                                               its save at an exception, s -1); a
                                               plain save's upload part; written first
                                               with "t0" only, then again complete
    {"ev": "raise", "t", "s"}                  the injected exception, before step s
    {"ev": "end", "t", "step"}                 training done, last save committed
    {"ev": "hash", "sha256"}                   the final weights and optimizer state

Each step begins by printing ``STEP <s>`` to stdout: the driver sends a scheduled signal when
it reads the step it is scheduled for. ``BENCH_FAIL_EXCEPTION=<s>`` raises before step s.
Times are ``time.time()`` (the driver's clock too).
"""

from __future__ import annotations

import json
import os
import sys
import time

_T_MAIN = time.time()

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import hashlib  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

MB = 2**20
TENSORS = 8
"""Parameter tensors in the model (each with its momentum buffer)."""


class _Log:
    """Appends one JSON object a line to ``path``, flushed at once."""

    def __init__(self, path: str) -> None:
        self._fh = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, **event: Any) -> None:
        self._fh.write(json.dumps(event) + "\n")
        self._fh.flush()


class Model(nn.Module):
    """``size_mb / 2`` MiB of fp32 parameters in :data:`TENSORS` tensors."""

    def __init__(self, size_mb: float) -> None:
        super().__init__()
        count = max(1, int(size_mb * MB / 2 / 4 / TENSORS))
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(count)) for _ in range(TENSORS))


def build(size_mb: float, seed: int) -> tuple[Model, torch.optim.SGD]:
    """The model and its optimizer, the same in every life and every side (``seed``); the
    momentum buffers exist from the start so a first save holds the whole state."""
    torch.manual_seed(seed)
    model = Model(size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # a zero step: creates the momentum buffers, changes no weight
    torch.manual_seed(seed + 1)  # the training RNG stream starts here in every side
    return model, opt


def train_step(model: Model, opt: torch.optim.SGD) -> None:
    """One optimizer step that changes every element of the state; RNG-dependent.

    Each tensor's gradient is its weights times a scalar drawn from torch's RNG, so every
    element of a momentum buffer differs from its neighbours as a real one's does: a
    gradient of one value per tensor would make each buffer a single repeated value, which a
    store that keeps chunks by content holds once (half the state, sent as a few chunks)."""
    grads = torch.rand(TENSORS, dtype=torch.float64).tolist()
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            assert p.grad is not None
            torch.mul(p, g - 0.5, out=p.grad)
    opt.step()


def fingerprint(model: Model, opt: torch.optim.SGD) -> str:
    """SHA-256 of every parameter and momentum buffer, bit for bit."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
        digest.update(opt.state[p]["momentum_buffer"].numpy().tobytes())
    return digest.hexdigest()


class _Steps:
    """The loop's shared part: announce, maybe raise, compute, log."""

    def __init__(self, log: _Log, step_s: float, fail_exception: int | None) -> None:
        self.log, self.step_s, self.fail_exception = log, step_s, fail_exception

    def run(self, step: int, model: Model, opt: torch.optim.SGD) -> None:
        print(f"STEP {step}", flush=True)
        t0 = time.time()
        if step == self.fail_exception:
            self.log.write(ev="raise", t=t0, s=step)
            raise RuntimeError(f"bench: injected failure before step {step}")
        self.log.write(ev="step", s=step, t0=t0)
        time.sleep(self.step_s)  # the accelerator computes; the CPU idles
        train_step(model, opt)
        self.log.write(ev="step", s=step, t0=t0, t1=time.time())


def _time_failure_save(log: _Log) -> None:
    """Log the save at an exception as a save: it runs in the ``sys.excepthook`` that
    ``taskpoint.ctx()`` installed, so this hook, put on top, times all of it (and the end
    record and traceback after it: a few milliseconds)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        t0 = time.time()
        log.write(ev="save", s=-1, t0=t0)
        try:
            previous(kind, exc, tb)
        finally:
            log.write(ev="save", s=-1, t0=t0, t1=time.time(), preempt=False, saved=True)

    sys.excepthook = hook


def prefetch(log: _Log) -> None:
    """Start the restore before the state is built, as a restarted job does."""
    t0 = time.time()
    _checkpoint().prefetch()
    log.write(ev="prefetch", t0=t0, t1=time.time())


def _checkpoint() -> Any:
    """The attempt's checkpoint, from the environment contract (imports taskpoint)."""
    import taskpoint

    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None, "TASKPOINT_ACTION unset"
    return context.checkpoint


def run_taskpoint(log: _Log, steps: _Steps, model: Model, opt: torch.optim.SGD,
                  total: int, every: int, every_s: str | None = None) -> int:
    """The guide's loop under the environment contract, saving every ``every`` steps or,
    with ``every_s`` (seconds or ``"auto"``), by training time; returns the step reached."""
    t0 = time.time()  # the restore counts from loading the checkpoint library, as plain's
    from taskpoint_pytorch import TaskpointState

    ckpt = _checkpoint()
    on_exception = os.environ.get("BENCH_SAVE_ON_EXCEPTION", "1") != "0"
    state = TaskpointState(model, opt, blocking=False, save_on_exception=on_exception)
    if on_exception:
        _time_failure_save(log)
    resume = state.restore_sync(ckpt)
    start = resume.step if resume else 0
    log.write(ev="restore", t0=t0, t1=time.time(), step=start)
    by_time: dict[str, Any] = {}
    if every_s is not None:
        by_time["every_s"] = every_s if every_s == "auto" else float(every_s)
    step = start
    saved = True  # a life that trains no step has nothing new to save
    for step in range(start + 1, total + 1):
        steps.run(step, model, opt)
        t0 = time.time()
        log.write(ev="save", s=step, t0=t0)
        try:
            if by_time:
                saved = state.save_sync(ckpt, step=step, **by_time)
            else:
                saved = state.save_sync(ckpt, step=step, every=every)
        except BaseException:  # a Preempted after the preemption save, or a store error
            log.write(ev="save", s=step, t0=t0, t1=time.time(), preempt=True, saved=True)
            raise
        log.write(ev="save", s=step, t0=t0, t1=time.time(), preempt=False, saved=saved)
    t0 = time.time()
    log.write(ev="save", s=step, t0=t0)
    if not saved:  # the last step's call did not save: the end must
        state.save_sync(ckpt, step=step)
    state.wait()
    log.write(ev="save", s=step, t0=t0, t1=time.time(), preempt=False, saved=not saved)
    return step


def run_plain(log: _Log, steps: _Steps, model: Model, opt: torch.optim.SGD,
              total: int, every: int) -> int:
    """``torch.save`` every ``every`` steps and a blocking upload of ``latest.pt``; returns
    the step reached, or exits 143 after a SIGTERM's save."""
    t0 = time.time()  # the restore counts from loading the S3 client, as taskpoint's
    import boto3
    from botocore.exceptions import ClientError

    bucket, key = os.environ["BENCH_BUCKET"], os.environ["BENCH_KEY"]
    s3 = boto3.client("s3")  # credentials and endpoint from the AWS_* environment
    local = Path("latest.pt")
    stop = {"signalled": False}

    def on_sigterm(signum: int, frame: object) -> None:
        stop["signalled"] = True

    signal.signal(signal.SIGTERM, on_sigterm)

    def save(step: int, preempt: bool = False) -> None:
        t0 = time.time()
        log.write(ev="save", s=step, t0=t0)
        blob = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(), "step": step}
        torch.save(blob, local)
        tu = time.time()
        s3.upload_file(str(local), bucket, key)
        t1 = time.time()
        log.write(ev="save", s=step, t0=t0, t1=t1, upload_s=t1 - tu, preempt=preempt,
                  saved=True)

    start = 0
    try:
        s3.download_file(bucket, key, str(local))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
            raise
    else:
        blob = torch.load(local, weights_only=True)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["rng"])
        start = int(blob["step"])
    log.write(ev="restore", t0=t0, t1=time.time(), step=start)
    step = start
    for step in range(start + 1, total + 1):
        steps.run(step, model, opt)
        if stop["signalled"]:
            save(step, preempt=True)
            sys.exit(143)
        if step % every == 0:
            save(step)
    if step % every:
        save(step)
    return step


def run_none(log: _Log, steps: _Steps, model: Model, opt: torch.optim.SGD, total: int) -> int:
    """The uninterrupted reference: no checkpoint."""
    t = time.time()
    log.write(ev="restore", t0=t, t1=t, step=0)
    for step in range(1, total + 1):
        steps.run(step, model, opt)
    return total


def main() -> None:
    env = os.environ
    log = _Log(env["BENCH_LOG"])
    log.write(ev="main", t=_T_MAIN, pid=os.getpid())
    torch.set_num_threads(1)
    side = env["BENCH_SIDE"]
    total, every = int(env["BENCH_STEPS"]), int(env.get("BENCH_EVERY", "1"))
    fail = env.get("BENCH_FAIL_EXCEPTION")
    steps = _Steps(log, float(env["BENCH_STEP_S"]), int(fail) if fail else None)
    if side == "taskpoint" and env.get("BENCH_PREFETCH", "1") != "0":
        prefetch(log)  # the download runs while the state is built
    model, opt = build(float(env["BENCH_SIZE_MB"]), int(env["BENCH_SEED"]))
    if side == "taskpoint":
        reached = run_taskpoint(log, steps, model, opt, total, every,
                                env.get("BENCH_EVERY_S") or None)
    elif side == "plain":
        reached = run_plain(log, steps, model, opt, total, every)
    elif side == "none":
        reached = run_none(log, steps, model, opt, total)
    else:
        raise SystemExit(f"BENCH_SIDE must be taskpoint, plain or none; got {side!r}")
    log.write(ev="end", t=time.time(), step=reached)
    log.write(ev="hash", sha256=fingerprint(model, opt))


if __name__ == "__main__":
    main()
