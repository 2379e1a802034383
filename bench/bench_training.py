"""Training-side benchmark for issue #18 ("Training never waits for the store").

Run: uv run python bench/bench_training.py [--steps 70] [--save-steps 20] [--repeat 2]
                                           [--size-mb 1024] [--loop-mb 256]
                                           [--skip hf,lightning,loop,transfer]

Prints one line per ratio with its target and PASS/MISS, on S3 = a SeaweedFS server on
loopback (moto where the ``weed`` binary cannot run; the output says which):

1. HF ``Trainer`` (a GPT-2 built from a config, >= 50 MB of fp32 weights, AdamW, random
   token ids), saving every ``--save-steps`` steps with ``save_total_limit=2``, three ways:
   plain (the ``checkpoint-N`` folders on local disk only), with
   ``TaskpointTrainerCallback`` (background upload to S3), and with it at ``blocking=True``.
   Ratios: total ``trainer.train()`` wall time, background / plain; time blocked per save,
   background / plain and background / blocking.
2. The same for Lightning: ``TaskpointModelCheckpoint`` against a plain ``ModelCheckpoint``
   (same arguments, ``every_n_train_steps``) and against ``blocking=True``.
3. A CPU-bound torch loop's step rate while a background save of a ``--loop-mb`` tree
   uploads, over its rate with no upload.
4. Saving and restoring a ``--size-mb`` tree of 8 fp32 shards, against a raw parallel s3fs
   ``put``/``get`` of the same files (throughput ratios).

"Blocked per save" is the time spent inside the framework's save path: the Trainer's
``_save_checkpoint`` plus the callbacks' ``on_save``; the checkpoint callback's
``on_train_batch_end`` at a step where it saved, for Lightning. Training wall time runs from
``fit``/``train`` to its return, so it includes waiting for the last upload at the end
(70 steps by default: saves at steps 20, 40 and 60, then 10 more steps, at whose end the
HF Trainer saves once more). Whether training waits depends on whether one upload fits in
the steps between two saves: the output gives the time between saves and the upload time
the callbacks logged (``taskpoint/upload_s``); ``--lightning-batch`` sets case 2's step time
(its default makes a step about as long as case 1's).

Every case runs with ``torch.set_num_threads(1)``: the loop keeps one of this VM's two
cores, leaving the other to the upload process (niced). The SeaweedFS server stands in for a
remote store: it runs at the upload process's nice value, so that it too takes only the CPU
training leaves. Each contender runs once untimed first; timings are medians over
``--repeat`` runs (per-save figures: the median save of each run, then the median over runs),
the contenders taking turns. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import fsspec  # noqa: E402
import taskpoint  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    FreshSaves,
    make_data,
    note,
    raw_get_s,
    raw_put_s,
    report,
    s3_server,
    timed,
)
from taskpoint.checkpoint import _save  # noqa: E402

MB = 2**20
MODES = ("plain", "background", "blocking")


@dataclass
class Run:
    """One training run: its wall time and the time blocked at each save."""

    wall_s: float = 0.0
    blocked_s: list[float] = field(default_factory=list)
    end_s: list[float] = field(default_factory=list)  # the end hooks (the last upload's wait)
    saved_at: list[float] = field(default_factory=list)  # perf_counter() at each save's end
    logged: dict[str, float] = field(default_factory=dict)  # taskpoint/* figures, summed


def _time_calls(obj: Any, name: str, sink: list[float], ends: list[float] | None = None) -> None:
    """Wrap ``obj.name`` (an instance attribute from now on) to append each call's seconds
    to ``sink`` (and when it returned to ``ends``)."""
    inner = getattr(obj, name)

    def timed_call(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            now = time.perf_counter()
            sink.append(now - started)
            if ends is not None:
                ends.append(now)

    setattr(obj, name, timed_call)


def _median_save(runs: list[Run]) -> float:
    return statistics.median(statistics.median(r.blocked_s) for r in runs)


def _weights_mb(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / MB


class Framework:
    """Runs one framework's training in a mode: ``plain``, ``background`` or ``blocking``."""

    name = ""

    def __init__(self, url: str, options: dict[str, Any], tmp: Path, steps: int,
                 save_steps: int) -> None:
        self.url, self.options, self.tmp = url, options, tmp
        self.steps, self.save_steps = steps, save_steps
        self.runs = 0

    def checkpoint(self) -> taskpoint.Checkpoint:
        """A new run URL each time: nothing deduplicates against an earlier run's uploads."""
        self.runs += 1
        return taskpoint.Checkpoint(f"{self.url}/{self.name}-{self.runs}",
                                    storage_options=self.options, workdir=self.tmp / "restores")

    def run(self, mode: str, steps: int | None = None) -> Run:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class HF(Framework):
    name = "hf"
    batch, seq = 16, 32

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from transformers import GPT2Config

        self.config = GPT2Config(vocab_size=8192, n_positions=self.seq, n_embd=512, n_layer=4,
                                 n_head=8, bos_token_id=0, eos_token_id=0)

    def describe(self) -> str:
        from transformers import GPT2LMHeadModel

        mb = _weights_mb(GPT2LMHeadModel(self.config))
        return (f"GPT-2 (vocab 8192, 512 wide, 4 layers): {mb:.0f} MB of fp32 weights, AdamW, "
                f"batch {self.batch}x{self.seq} tokens")

    def run(self, mode: str, steps: int | None = None) -> Run:
        from taskpoint_hf import TaskpointTrainerCallback
        from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

        steps = steps or self.steps
        torch.manual_seed(0)
        model = GPT2LMHeadModel(self.config)
        ids = torch.randint(0, self.config.vocab_size, (steps * self.batch, self.seq))
        dataset = [{"input_ids": row, "labels": row} for row in ids]
        out = self.tmp / f"hf-{mode}"
        args = TrainingArguments(
            output_dir=str(out), max_steps=steps, save_strategy="steps",
            save_steps=self.save_steps, save_total_limit=2,
            per_device_train_batch_size=self.batch, report_to=[], use_cpu=True,
            disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, seed=0,
        )
        callbacks = []
        if mode != "plain":
            callbacks.append(TaskpointTrainerCallback(self.checkpoint(), out,
                                                      blocking=mode == "blocking"))
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        result = Run()
        # The save path: _save_checkpoint (the Trainer's own writes and rotation), then the
        # callbacks' on_save, called back to back from _maybe_log_save_evaluate.
        writing: list[float] = []
        saving: list[float] = []
        _time_calls(trainer, "_save_checkpoint", writing)
        _time_calls(trainer.callback_handler, "on_save", saving, result.saved_at)
        _time_calls(trainer.callback_handler, "on_train_end", result.end_s)
        started = time.perf_counter()
        trainer.train()
        result.wall_s = time.perf_counter() - started
        result.blocked_s = [w + s for w, s in zip(writing, saving, strict=True)]
        for entry in trainer.state.log_history:
            for key, value in entry.items():
                if key.startswith("taskpoint/") and key != "taskpoint/stored_bytes":
                    result.logged[key] = result.logged.get(key, 0.0) + value
        shutil.rmtree(out)
        return result


class Lightning(Framework):
    name = "lightning"
    width, depth = 1792, 4
    batch = 576  # steps about as long as the HF case's (--lightning-batch)

    def describe(self) -> str:
        mb = self.depth * (self.width + 1) * self.width * 4 / MB
        return (f"LightningModule, {self.depth} Linear({self.width}, {self.width}) layers: "
                f"{mb:.0f} MB of fp32 weights, Adam, batch {self.batch}")

    def run(self, mode: str, steps: int | None = None) -> Run:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import ModelCheckpoint
        from taskpoint_lightning import TaskpointModelCheckpoint

        width, depth = self.width, self.depth

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                layers: list[torch.nn.Module] = []
                for _ in range(depth):
                    layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
                self.net = torch.nn.Sequential(*layers)

            def training_step(self, batch: Any, _: int) -> Any:
                return self.net(batch[0]).pow(2).mean()

            def configure_optimizers(self) -> Any:
                return torch.optim.Adam(self.parameters(), lr=1e-4)

        steps = steps or self.steps
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(steps * self.batch, width))
        loader = torch.utils.data.DataLoader(data, batch_size=self.batch)
        out = self.tmp / f"pl-{mode}"
        kwargs: dict[str, Any] = {"dirpath": str(out), "every_n_train_steps": self.save_steps}
        callback = (
            ModelCheckpoint(**kwargs) if mode == "plain"
            else TaskpointModelCheckpoint(self.checkpoint(), blocking=mode == "blocking",
                                          **kwargs)
        )
        result = Run()
        _time_calls(callback, "on_train_end", result.end_s)
        _time_calls(callback, "teardown", result.end_s)
        batch_end = callback.on_train_batch_end

        def timed_batch_end(trainer: Any, *a: Any, **k: Any) -> None:
            before = callback._last_global_step_saved
            started = time.perf_counter()
            batch_end(trainer, *a, **k)
            if callback._last_global_step_saved != before:  # it saved at this step
                result.saved_at.append(time.perf_counter())
                result.blocked_s.append(result.saved_at[-1] - started)

        callback.on_train_batch_end = timed_batch_end  # type: ignore[method-assign]
        figures = _figures_logger()  # in every mode, for the same cost
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=figures, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback], num_sanity_val_steps=0,
        )
        started = time.perf_counter()
        trainer.fit(Module(), loader)
        result.wall_s = time.perf_counter() - started
        result.logged = figures.sums
        shutil.rmtree(out)
        return result


def _figures_logger() -> Any:
    from lightning.pytorch.loggers.logger import Logger

    class Figures(Logger):
        """Sums the ``taskpoint/*`` metrics logged (times and bytes)."""

        def __init__(self) -> None:
            super().__init__()
            self.sums: dict[str, float] = {}

        @property
        def name(self) -> str:
            return "figures"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            for key, value in metrics.items():
                if key.startswith("taskpoint/") and key != "taskpoint/stored_bytes":
                    self.sums[key] = self.sums.get(key, 0.0) + float(value)

    return Figures()


def framework_case(number: int, fw: Framework, repeat: int) -> None:
    title = {"hf": "HF Trainer", "lightning": "Lightning"}[fw.name]
    note(f"{number}. {title}: {fw.describe()}; {fw.steps} steps, a save every "
         f"{fw.save_steps} steps")
    for mode in ("plain", "background"):  # warm-up: imports, page cache, the upload process
        fw.run(mode, steps=fw.save_steps)
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    for _ in range(repeat):
        for mode in MODES:
            runs[mode].append(fw.run(mode))
    wall = {mode: statistics.median(r.wall_s for r in runs[mode]) for mode in MODES}
    blocked = {mode: _median_save(runs[mode]) for mode in MODES}
    report(f"{number}. {title}: training wall time, background / plain (local disk)",
           wall["background"] / wall["plain"], "<= 1.10")
    report(f"{number}. {title}: blocked per save, background / plain's own save",
           blocked["background"] / blocked["plain"], "<= 2")
    report(f"{number}. {title}: blocked per save, background / blocking=True",
           blocked["background"] / blocked["blocking"], "<= 0.15")
    saves = len(runs["plain"][0].blocked_s)
    note(f"   (wall: plain {wall['plain']:.1f}s, background {wall['background']:.1f}s, "
         f"blocking {wall['blocking']:.1f}s; blocked per save: plain "
         f"{blocked['plain']:.2f}s, background {blocked['background']:.2f}s, blocking "
         f"{blocked['blocking']:.2f}s; {saves} saves per run)")
    end = statistics.median(sum(r.end_s) for r in runs["background"])
    note(f"   (background wall includes {end:.1f}s at the end waiting for the last upload)")
    per_save = ", ".join(f"{s:.2f}" for s in runs["background"][-1].blocked_s)
    note(f"   (background, last run, blocked at each save: {per_save} s)")
    bg = runs["background"][-1]
    gaps = [b - a for a, b in zip(bg.saved_at, bg.saved_at[1:], strict=False)]
    if gaps:
        note(f"   (background, last run: {statistics.median(gaps):.1f}s between saves; "
             f"{bg.wall_s / fw.steps:.2f}s per step, saves included)")
    logged = bg.logged
    if logged:
        note("   (logged by the callback, last run: " + ", ".join(
            f"{k.removeprefix('taskpoint/')} {v:,.2f}" for k, v in sorted(logged.items())) + ")")


# -- 3. a training loop's step rate while an upload runs ---------------------------------


def _spin(until: Callable[[], bool]) -> tuple[int, float]:
    """Steps of a CPU-bound torch loop (one thread) until ``until()``; (steps, seconds)."""
    a = torch.randn(256, 256)
    steps = 0
    started = time.perf_counter()
    while not until():
        for _ in range(4):
            a = torch.tanh(a @ a * 1e-2)
        steps += 1
    return steps, time.perf_counter() - started


def _wait_then_set(ckpt: taskpoint.Checkpoint, done: threading.Event) -> None:
    ckpt.wait()
    done.set()


def _after(seconds: float) -> Callable[[], bool]:
    deadline = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= deadline


def loop_case(url: str, options: dict[str, Any], tmp: Path, size_mb: int, repeat: int) -> None:
    root = tmp / "loop"
    root.mkdir()
    data = make_data(root, size_mb, "dir")
    uploads = iter(range(10**6))
    ratios, seconds = [], []
    for i in range(repeat + 1):  # the first pair is a warm-up
        ckpt = taskpoint.Checkpoint(f"{url}/loop-{next(uploads)}", storage_options=options,
                                    workdir=tmp / "restores")
        done = threading.Event()
        ckpt.save_sync(data, background=True, snapshot="link")
        threading.Thread(target=_wait_then_set, args=(ckpt, done), daemon=True).start()
        steps, took = _spin(done.is_set)
        idle_steps, idle = _spin(_after(took))
        if i:
            ratios.append((steps / took) / (idle_steps / idle))
            seconds.append(took)
    report(f"3. torch loop (1 thread), step rate during a {size_mb} MB upload / without",
           statistics.median(ratios), ">= 0.9")
    note(f"   (upload process at nice {_save.BACKGROUND_NICE}, SeaweedFS too; each upload "
         f"{statistics.median(seconds):.1f}s; runs: "
         + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    shutil.rmtree(root)


# -- 4. save and restore against raw parallel transfers -----------------------------------


def transfer_case(url: str, options: dict[str, Any], tmp: Path, size_mb: int,
                  repeat: int) -> None:
    fs, base = fsspec.core.url_to_fs(url, **options)
    root = tmp / "transfer"
    root.mkdir()
    data = make_data(root, size_mb, "dir")
    raw = f"{base}/raw-transfer"
    raw_put = raw_put_s(fs, data, raw, repeat)
    saves = FreshSaves(url, options, data, tmp / "restores", name="transfer")
    tp_save = timed(saves.save, repeat)
    raw_get = raw_get_s(fs, raw, root / "raw-got", repeat)
    tp_load = timed(saves.load, repeat)
    report(f"4. save {size_mb} MB tree (8 shards): raw parallel put / taskpoint",
           raw_put / tp_save, ">= 0.8")
    report(f"4. restore {size_mb} MB tree: raw parallel get / taskpoint", raw_get / tp_load,
           ">= 0.8")
    note(f"   (raw put {raw_put:.1f}s, taskpoint save {tp_save:.1f}s; raw get "
         f"{raw_get:.1f}s, taskpoint restore {tp_load:.1f}s)")
    fs.rm(raw, recursive=True)
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--size-mb", type=int, default=1024, help="tree of case 4")
    parser.add_argument("--loop-mb", type=int, default=256, help="upload of case 3")
    parser.add_argument("--lightning-batch", type=int, default=Lightning.batch,
                        help="sets case 2's step time")
    parser.add_argument("--skip", default="", help="comma-separated: hf,lightning,loop,transfer")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    Lightning.batch = args.lightning_batch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    nice = _save.BACKGROUND_NICE
    print(f"{os.cpu_count()} CPUs; taskpoint {taskpoint.__version__}; torch "
          f"{torch.__version__}, 1 thread", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tp-bench-train-"))
    server = s3_server(nice=nice)
    try:
        url, options = f"s3://bench/{tmp.name}", server.options
        print(f"store s3:// ({server.name} on 127.0.0.1, nice {nice})", flush=True)
        for number, cls in ((1, HF), (2, Lightning)):
            if cls.name not in skip:
                framework_case(number, cls(url, options, tmp, args.steps, args.save_steps),
                               args.repeat)
        if "loop" not in skip:
            loop_case(url, options, tmp, args.loop_mb, args.repeat)
        if "transfer" not in skip:
            transfer_case(url, options, tmp, args.size_mb, args.repeat)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
