"""Preemption benchmark for issue #25 ("Lose at most one step").

Run: uv run python bench/bench_preemption.py [--sizes 20,200,1024] [--repeat 3]
                                             [--skip commit,steps,ddp]

Prints one line per figure with its target and PASS/MISS:

1. From SIGTERM to the preemption save committed. A real training process holds SIZE MB
   of fp32 weights (10 tensors) in a ``TaskpointState`` and calls
   ``state.save_sync(checkpoint, step=step, every=10**9)`` after every 50 ms step, outside
   a task with ``TASKPOINT_SAVE_ON_PREEMPTION=1``. Its first save commits everything; then
   each step changes one tensor (10% of the state). The bench sends the process SIGTERM
   and takes the time until the preemption save's manifest was committed (its ``created``
   time; same clock): target <= 5 s at 200 MB, on a SeaweedFS server on loopback (moto
   where the ``weed`` binary cannot run; the output says which). 20 MB and 1 GB are
   printed too, with what the save uploaded. Medians over ``--repeat`` processes.
2. Steps lost, from the attempt records (``taskpoint.history``): a taskpoint task with the
   README quickstart's lines (a save per step, here in the background), SIGTERM during one
   attempt and an exception during the next, each resumed from the store: the PyTorch
   loop at 1 rank and at 2 ranks (``torchrun``, gloo on CPU, the SIGTERM to rank 1 only,
   the exception on both), scikit-learn (``partial_fit`` chunks; it has no ranks).
   Targets: SIGTERM <= 1, exception <= 1.

Nothing here is a test; run it on an otherwise idle machine for the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

MB = 2**20
HERE = Path(__file__).resolve()
STEP_S = 0.05
"""How long one step of the SIGTERM-to-commit trainer computes (sleeps)."""


# -- the processes the bench starts ------------------------------------------------------


def child_commit(size_mb: int, url: str) -> None:
    """The trainer of case 1 (run as ``--child commit``); prints READY once its first save
    committed, then trains until SIGTERM stops it with ``taskpoint.Preempted``."""
    import taskpoint
    import torch
    from taskpoint_pytorch import TaskpointState
    from torch import nn

    class Weights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            count = size_mb * MB // 4 // 10
            self.tensors = nn.ParameterList(nn.Parameter(torch.randn(count)) for _ in range(10))

    options = json.loads(os.environ["BENCH_STORAGE_OPTIONS"])
    checkpoint = taskpoint.Checkpoint(url, storage_options=options, keep=2)
    model = Weights()
    state = TaskpointState(model, rng=False)
    state.restore_sync(checkpoint)
    state.save_sync(checkpoint, step=1)
    print("READY", flush=True)
    step = 1
    while True:
        step += 1
        with torch.no_grad():
            model.tensors[0].add_(1e-3)  # the same tenth of the state changes
        time.sleep(STEP_S)
        state.save_sync(checkpoint, step=step, every=10**9)


def _records(url: str, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from taskpoint.history import read_attempts, steps_lost
    from taskpoint.store import Store

    records = read_attempts(Store(url, options))
    return [
        {"attempt": r.attempt, "outcome": r.outcome, "step": r.step,
         "preemption_save": r.preemption_save,
         "steps_lost": steps_lost(r, after.resumed_step) if after is not None else None}
        for r, after in zip(records, [*records[1:], None], strict=True)
    ]


def child_torch_steps(root: str) -> None:
    """Case 2, PyTorch (run as ``--child torch``, alone or under torchrun): the quickstart
    loop with background saves; attempt 0 gets SIGTERM (on rank 1 only under torchrun)
    before step 10, attempt 1 raises before step 20 (on every rank)."""
    import taskpoint
    import torch
    import torch.distributed as dist
    from taskpoint_pytorch import TaskpointState
    from torch import nn

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    env = taskpoint.TaskEnvironment(name="loop", root=root, run_id="r", keep=3)

    @env.task(retries=2, backoff=0.0)
    def train(steps: int = 30) -> None:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        if distributed:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = TaskpointState(model, opt, blocking=False)
        resume = state.restore_sync(context.checkpoint)
        for step in range((resume.step if resume else 0) + 1, steps + 1):
            if context.attempt == 0 and step == 10 and rank == (1 if distributed else 0):
                os.kill(os.getpid(), signal.SIGTERM)
            if context.attempt == 1 and step == 20:
                raise RuntimeError("simulated failure")
            x = torch.randn(32, 64)
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.save_sync(context.checkpoint, step=step)
        state.wait()

    try:
        train()
    finally:
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        print("RECORDS " + json.dumps(_records(f"{root}/loop.train/r")), flush=True)


def child_sklearn_steps(root: str) -> None:
    """Case 2, scikit-learn (run as ``--child sklearn``): the quickstart loop, a save per
    chunk; SIGTERM during chunk 10 of attempt 0, an exception before chunk 20 of attempt 1."""
    import numpy as np
    import taskpoint
    from sklearn.linear_model import SGDClassifier
    from taskpoint_sklearn import TaskpointSklearnCheckpoint

    env = taskpoint.TaskEnvironment(name="sk", root=root, run_id="r", keep=3)

    @env.task(retries=2, backoff=0.0)
    def train(chunks: int = 30) -> None:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        ckpt = TaskpointSklearnCheckpoint(context.checkpoint)
        bundle = ckpt.resume_sync(SGDClassifier(random_state=0), rng=np.random.default_rng(0))
        for i in range(bundle.progress, chunks):
            if context.attempt == 0 and i + 1 == 10:
                os.kill(os.getpid(), signal.SIGTERM)
            if context.attempt == 1 and i + 1 == 20:
                raise RuntimeError("simulated failure")
            x = bundle.rng.standard_normal((64, 8))
            bundle.partial_fit(x, (x[:, 0] > 0).astype(int), classes=[0, 1])
            bundle.progress = i + 1
            ckpt.save_sync(bundle)

    train()
    print("RECORDS " + json.dumps(_records(f"{root}/sk.train/r")), flush=True)


# -- the measurements --------------------------------------------------------------------


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(extra)
    return env


def sigterm_to_commit(size_mb: int, url: str, options: dict[str, Any]) -> tuple[float, int, int]:
    """One trainer process: seconds from SIGTERM to the preemption save's commit, the bytes
    that save uploaded, and its stored size."""
    import taskpoint

    proc = subprocess.Popen(
        [sys.executable, str(HERE), "--child", "commit", str(size_mb), url],
        env=_environment(
            TASKPOINT_SAVE_ON_PREEMPTION="1", BENCH_STORAGE_OPTIONS=json.dumps(options)
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        else:
            raise RuntimeError(f"the trainer ended before its first save: {proc.stderr.read()}")  # type: ignore[union-attr]
        time.sleep(10 * STEP_S)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if "the preemption save committed" not in err:
        raise RuntimeError(f"no preemption save:\n{err[-3000:]}")
    manifests = [m for m in taskpoint.Checkpoint(url, storage_options=options).committed()
                 if m.preemption]
    (manifest,) = manifests
    uploaded = int((manifest.stats or {}).get("uploaded", -1))
    return manifest.created - sent, uploaded, manifest.size


def case_commit(sizes: list[int], repeat: int) -> None:
    from _common import note, report, s3_server

    server = s3_server()
    print(f"store s3:// ({server.name} on 127.0.0.1)", flush=True)
    try:
        for size in sizes:
            figures = [
                sigterm_to_commit(size, f"s3://bench/preempt-{size}-{i}-{os.getpid()}",
                                  server.options)
                for i in range(repeat)
            ]
            seconds = statistics.median(f[0] for f in figures)
            uploaded = statistics.median(f[1] for f in figures)
            label = f"SIGTERM -> preemption save committed, {size} MB state, 10% changed (s)"
            if size == 200:
                report(label, seconds, "<= 5")
            else:
                note(f"{label:<74} {seconds:>11.3f}")
            note(f"    uploaded {uploaded / MB:.1f} MB of {figures[0][2] / MB:.1f} MB stored; "
                 f"runs: {', '.join(f'{f[0]:.2f}' for f in figures)} s")
    finally:
        server.stop()


def _lost(records: list[dict[str, Any]], label: str) -> None:
    from _common import note, report

    sigterm, exception = records[0], records[1]
    assert sigterm["outcome"] == "preempted" and exception["outcome"] == "failed", records
    report(f"{label}: steps lost to SIGTERM", float(sigterm["steps_lost"]), "<= 1")
    report(f"{label}: steps lost to an exception", float(exception["steps_lost"]), "<= 1")
    note(f"    preemption save {sigterm['preemption_save']}; stopped at step {sigterm['step']}, "
         f"failed at step {exception['step']}")


def _run_records(command: list[str], root: Path, timeout: float = 900) -> list[dict[str, Any]]:
    done = subprocess.run(
        command, env=_environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        capture_output=True, text=True, timeout=timeout,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RECORDS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{command[-3:]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RECORDS "):])  # type: ignore[no-any-return]


def case_steps(ddp: bool) -> None:
    from _common import note

    with tempfile.TemporaryDirectory(prefix="tp-bench-preempt-") as tmp:
        root = Path(tmp)
        note("steps lost (README quickstart lines; from the attempt records):")
        _lost(_run_records([sys.executable, str(HERE), "--child", "torch", f"file://{root / 't1'}"],
                           root), "PyTorch loop, 1 rank")
        if ddp:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                "--nproc_per_node=2", "--monitor-interval=0.2", str(HERE), "--child", "torch",
                f"file://{root / 't2'}",
            ]
            _lost(_run_records(command, root), "PyTorch loop, 2 ranks (SIGTERM on rank 1)")
        _lost(_run_records([sys.executable, str(HERE), "--child", "sklearn",
                            f"file://{root / 'sk'}"], root), "scikit-learn, 1 process")
        note("    scikit-learn at 2 ranks: not applicable (partial_fit runs in one process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,1024", help="MB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: commit,steps,ddp")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "commit":
            child_commit(int(rest[0]), rest[1])
        elif kind == "torch":
            child_torch_steps(rest[0])
        else:
            child_sklearn_steps(rest[0])
        return
    sys.path.insert(0, str(HERE.parent))
    skip = set(filter(None, args.skip.split(",")))
    print(f"load: {os.getloadavg()[0]:.2f} (1 min); cpus: {os.cpu_count()}", flush=True)
    if "commit" not in skip:
        case_commit([int(s) for s in args.sizes.split(",")], args.repeat)
    if "steps" not in skip:
        case_steps(ddp="ddp" not in skip)


if __name__ == "__main__":
    main()
