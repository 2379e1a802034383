"""Preemption benchmark for issue #25 ("Lose at most one step").

Run: uv run python bench/bench_preemption.py [--sizes 20,200,1024] [--repeat 3]
        [--skip commit,steps,ddp,pytorch,lightning,hf,sklearn]

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
2. Steps lost, from the attempt records (``taskpoint.format.history``): a taskpoint task with the
   README quickstart's lines, SIGTERM during attempt 0 (once 7 steps are done, on the
   highest rank only), an exception during attempt 1 (once 11 steps are done, on every
   rank), attempt 2 finishing; each attempt resumes from the store. The cases (``--skip``
   keys): ``pytorch``, the PyTorch loop with a save per step, in the background;
   ``lightning``, ``TaskpointModelCheckpoint`` with ``save_last=True`` and
   ``every_n_train_steps=5`` on a CPU Trainer; ``hf``, the Hugging Face ``Trainer`` with
   ``TaskpointTrainerCallback`` and ``save_steps=5`` on a tiny BERT classifier built from
   its config (nothing downloaded); each at 1 rank and at 2 ranks (``torchrun``, gloo on
   CPU, DDP; Lightning and the Trainer join torchrun's ranks); and ``sklearn``
   (``partial_fit`` chunks, a save per chunk; it has no ranks). The exception comes one
   step after a save in the Lightning and HF cases. Targets: SIGTERM <= 1, exception <= 1.
   ``--skip ddp`` leaves out the 2-rank runs, ``--skip steps`` the whole case.

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
from collections.abc import Callable
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
    from taskpoint.format.history import read_attempts, steps_lost
    from taskpoint.store.store import Store

    records = read_attempts(Store(url, options))
    return [
        {"attempt": r.attempt, "outcome": r.outcome, "step": r.step,
         "preemption_save": r.preemption_save,
         "steps_lost": steps_lost(r, after.resumed_step) if after is not None else None}
        for r, after in zip(records, [*records[1:], None], strict=True)
    ]


def _print_records(url: str) -> None:
    """Global rank zero (or the only process) prints the attempt records for the bench."""
    if int(os.environ.get("RANK", "0")) == 0:
        print("RECORDS " + json.dumps(_records(url)), flush=True)


SIGTERM_AT = 7
"""Attempt 0 of every case receives SIGTERM once this many steps are done (on the highest
rank only)."""
FAIL_AT = 11
"""Attempt 1 of every case raises once this many steps are done (on every rank): one step
after a save in the Lightning and HF cases, which save every ``SAVE_EVERY`` steps."""
SAVE_EVERY = 5
"""``every_n_train_steps`` (Lightning) and ``save_steps`` (HF)."""
STEPS = 30


def _disrupt(attempt: int, done: int) -> None:
    """Called by every case at the start of each step with the steps ``done`` so far:
    SIGTERM (attempt 0, the highest rank) or an exception (attempt 1, every rank)."""
    last_rank = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    if attempt == 0 and done == SIGTERM_AT and last_rank:
        os.kill(os.getpid(), signal.SIGTERM)
    if attempt == 1 and done == FAIL_AT:
        raise RuntimeError(f"simulated failure after step {done}")


def _train_task(name: str, root: str, fit: Callable[[Any, int], None]) -> None:
    """Runs ``fit(checkpoint, attempt)`` as the quickstart's task (``NAME.train``, run id
    ``r``, two retries at once), then prints its attempt records."""
    import taskpoint

    env = taskpoint.TaskEnvironment(name=name, root=root, run_id="r", keep=3)

    @env.task(retries=2, backoff=0.0)
    def train() -> None:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        fit(context.checkpoint, context.attempt)

    train()
    _print_records(f"{root}/{name}.train/r")


def child_torch_steps(root: str) -> None:
    """Case 2, PyTorch (run as ``--child pytorch``, alone or under torchrun): the quickstart
    loop with background saves, one per step, disrupted by :func:`_disrupt`."""
    import torch
    import torch.distributed as dist
    from taskpoint_pytorch import TaskpointState
    from torch import nn

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")

    def fit(checkpoint: Any, attempt: int) -> None:
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        if distributed:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = TaskpointState(model, opt, blocking=False)
        resume = state.restore_sync(checkpoint)
        for step in range((resume.step if resume else 0) + 1, STEPS + 1):
            _disrupt(attempt, step - 1)
            x = torch.randn(32, 64)
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.save_sync(checkpoint, step=step)
        state.wait()

    try:
        _train_task("loop", root, fit)
    finally:
        if distributed:
            dist.destroy_process_group()


def child_sklearn_steps(root: str) -> None:
    """Case 2, scikit-learn (run as ``--child sklearn``): the quickstart loop, a save per
    chunk (a step), disrupted by :func:`_disrupt`."""
    import numpy as np
    from sklearn.linear_model import SGDClassifier
    from taskpoint_sklearn import TaskpointSklearnCheckpoint

    def fit(checkpoint: Any, attempt: int) -> None:
        ckpt = TaskpointSklearnCheckpoint(checkpoint)
        bundle = ckpt.resume_sync(SGDClassifier(random_state=0), rng=np.random.default_rng(0))
        for i in range(bundle.progress, STEPS):
            _disrupt(attempt, i)
            x = bundle.rng.standard_normal((64, 8))
            bundle.partial_fit(x, (x[:, 0] > 0).astype(int), classes=[0, 1])
            bundle.progress = i + 1
            ckpt.save_sync(bundle)

    _train_task("sk", root, fit)


def child_lightning_steps(root: str) -> None:
    """Case 2, Lightning (run as ``--child lightning``, alone or under torchrun, where
    Lightning joins torchrun's ranks with DDP over gloo): the quickstart's
    ``TaskpointModelCheckpoint`` with ``save_last=True``, a save every ``SAVE_EVERY``
    steps, disrupted by :func:`_disrupt` at the start of a batch."""
    import lightning as L
    import torch
    from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Disrupt(L.Callback):
        def __init__(self, attempt: int) -> None:
            self.attempt = attempt

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            _disrupt(self.attempt, trainer.global_step)

    def fit(ckpt: Any, attempt: int) -> None:
        L.seed_everything(0, verbose=False)
        x = torch.randn(64, 8)
        loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4, shuffle=True)
        mc = TaskpointModelCheckpoint(
            ckpt, dirpath="ckpts", save_last=True, every_n_train_steps=SAVE_EVERY
        )
        ranks = {"devices": 2, "strategy": "ddp"} if distributed else {}
        trainer = L.Trainer(
            max_steps=STEPS, callbacks=[mc, Disrupt(attempt)], accelerator="cpu",
            logger=False, enable_progress_bar=False, enable_model_summary=False, **ranks,
        )
        trainer.fit(Tiny(), loader, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))

    _train_task("lt", root, fit)


def child_hf_steps(root: str) -> None:
    """Case 2, Hugging Face ``Trainer`` (run as ``--child hf``, alone or under torchrun):
    the quickstart's ``TaskpointTrainerCallback`` and ``restore_last_checkpoint`` on a tiny
    BERT classifier built from its config (nothing downloaded), a save every
    ``SAVE_EVERY`` steps, disrupted by :func:`_disrupt` at ``on_step_begin``."""
    import torch
    from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.set_num_threads(1)

    class Disrupt(TrainerCallback):
        def __init__(self, attempt: int) -> None:
            self.attempt = attempt

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _disrupt(self.attempt, state.global_step)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (64, 12), generator=generator)
    data = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": int(row[0]) % 2}
            for row in ids]

    def fit(ckpt: Any, attempt: int) -> None:
        args = TrainingArguments(
            output_dir="out", save_steps=SAVE_EVERY, save_total_limit=2, max_steps=STEPS,
            per_device_train_batch_size=4, report_to="none", disable_tqdm=True, use_cpu=True,
            logging_steps=STEPS,
        )
        resume = restore_last_checkpoint(ckpt, args)
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, num_labels=2,
        )
        trainer = Trainer(
            model=BertForSequenceClassification(config), args=args, train_dataset=data,
            callbacks=[TaskpointTrainerCallback(ckpt, args.output_dir), Disrupt(attempt)],
        )
        trainer.train(resume_from_checkpoint=resume)

    _train_task("hf", root, fit)


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


def _lost(records: list[dict[str, Any]], label: str, seconds: float) -> None:
    from _common import note, report

    sigterm, exception = records[0], records[1]
    assert sigterm["outcome"] == "preempted" and exception["outcome"] == "failed", records
    report(f"{label}: steps lost to SIGTERM", float(sigterm["steps_lost"]), "<= 1")
    report(f"{label}: steps lost to an exception", float(exception["steps_lost"]), "<= 1")
    note(f"    preemption save {sigterm['preemption_save']}; stopped at step {sigterm['step']}, "
         f"failed at step {exception['step']}; {seconds:.0f} s for the three attempts")


def _run_records(command: list[str], cwd: Path, timeout: float = 900) -> list[dict[str, Any]]:
    done = subprocess.run(
        command, env=_environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), cwd=cwd,
        capture_output=True, text=True, timeout=timeout,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RECORDS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{command[-3:]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RECORDS "):])  # type: ignore[no-any-return]


STEP_CASES = {
    "pytorch": ("PyTorch loop", child_torch_steps, True),
    "lightning": ("Lightning", child_lightning_steps, True),
    "hf": ("HF Trainer", child_hf_steps, True),
    "sklearn": ("scikit-learn", child_sklearn_steps, False),
}
"""``--skip`` key: the label, the child (run as ``--child KEY``), whether it has ranks."""


def case_steps(skip: set[str]) -> None:
    """Steps lost for each case of ``STEP_CASES`` not in ``skip``, at 1 rank and (unless
    ``ddp`` is skipped) 2 under torchrun; each case's working directory is its own."""
    from _common import note

    with tempfile.TemporaryDirectory(prefix="tp-bench-preempt-") as tmp:
        note("steps lost (README quickstart lines; from the attempt records):")
        for kind, (name, _, ranked) in STEP_CASES.items():
            if kind in skip:
                continue
            for ranks in (1, 2) if ranked and "ddp" not in skip else (1,):
                work = Path(tmp) / f"{kind}-{ranks}"
                work.mkdir()
                launcher = [sys.executable] if ranks == 1 else [
                    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                    f"--nproc_per_node={ranks}", "--monitor-interval=0.2",
                ]
                started = time.monotonic()
                records = _run_records(
                    [*launcher, str(HERE), "--child", kind, f"file://{work / 'store'}"], work
                )
                seconds = time.monotonic() - started
                where = "1 process" if not ranked else (
                    "1 rank" if ranks == 1 else f"{ranks} ranks (SIGTERM on rank {ranks - 1})"
                )
                _lost(records, f"{name}, {where}", seconds)
            if not ranked:
                note(f"    {name} at 2 ranks: not applicable (it runs in one process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,1024", help="MB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--skip", default="",
        help="comma-separated: commit,steps (all of case 2),ddp (its 2-rank runs),"
             "pytorch,lightning,hf,sklearn",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "commit":
            child_commit(int(rest[0]), rest[1])
        else:
            STEP_CASES[kind][1](rest[0])
        return
    sys.path.insert(0, str(HERE.parent))
    skip = set(filter(None, args.skip.split(",")))
    print(f"load: {os.getloadavg()[0]:.2f} (1 min); cpus: {os.cpu_count()}", flush=True)
    if "commit" not in skip:
        case_commit([int(s) for s in args.sizes.split(",")], args.repeat)
    if "steps" not in skip:
        case_steps(skip)


if __name__ == "__main__":
    main()
