"""Incremental-save benchmark for store format 2 (issue #19's targets).

Run: uv run python bench/bench_incremental.py [--size-mb 512] [--fresh-mb 200]
                                              [--stores file,s3] [--chunks 128,512,2048]

Prints one line per ratio with its target and PASS/MISS:

1. saving an unchanged tree of 8 shards again: payload bytes uploaded, wall time / first save;
2. a save where 1 of the 8 shards changed: bytes uploaded / that shard's size;
3. an HF ``Trainer`` ``output_dir`` with ``save_total_limit=2`` (tiny GPT-2 from a config,
   random token ids), three saves: bytes uploaded per save / one ``checkpoint-N``;
4. Lightning with ``save_last=True`` (``last.ckpt`` beside ``epoch=...ckpt``): bytes
   uploaded per save / one ``.ckpt``;
5. restoring the tree / raw parallel ``fs.get`` of the same files (throughput ratio), and
   restoring into a directory that already holds every file / a full restore;
6. the first save of a fresh tree of fp32 shards against the reference (single-threaded
   ``tarfile`` "w:gz", level 9, to a temp file + put), against a raw put and against a
   durable raw put (on ``file://`` each copied file fsynced, as a save's objects are: a raw
   copy alone only fills the page cache); its restore against the reference's.

Cases 3 and 4 also run with other FastCDC average chunk sizes (``--chunks``, KiB; on the
first store only: bytes uploaded do not depend on the store) and report what whole-file
dedup would have uploaded, from the committed manifests: a file is sent unless a file with
the same content hash was committed before. S3 is a local SeaweedFS server (moto where the
``weed`` binary cannot run; the output says which). Timings are medians of ``--repeat``
runs; nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tarfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import taskpoint  # noqa: E402
from _common import (  # noqa: E402
    FreshSaves,
    bench_store,
    make_data,
    note,
    raw_durable_put_s,
    raw_get_s,
    raw_put_s,
    report,
    timed,
)
from taskpoint.format import _tree_save  # noqa: E402

MB = 2**20


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@contextlib.contextmanager
def _chunk_avg(kib: int) -> Iterator[None]:
    saved = _tree_save.CHUNK_AVG
    _tree_save.CHUNK_AVG = kib * 1024
    try:
        yield
    finally:
        _tree_save.CHUNK_AVG = saved


class _Recorder:
    """Per commit: the bytes taskpoint uploaded and those whole-file dedup would have."""

    def __init__(self, ckpt: taskpoint.Checkpoint, unit: Callable[[], int]) -> None:
        self.ckpt = ckpt
        self.unit = unit  # the size the save is judged against, read at commit time
        self.rows: list[tuple[int, int, int]] = []  # (uploaded, whole-file, unit)
        self._seen: set[str] = set()
        ckpt.on_commit(self._on_commit)

    def _on_commit(self, stats: taskpoint.SaveStats) -> None:
        manifest = self.ckpt.committed()[0]
        whole = 0
        for entry in manifest.entries or ():
            if entry.type == "file" and entry.hash not in self._seen:
                self._seen.add(entry.hash or "")
                whole += entry.size
        self.rows.append((stats.uploaded, whole, self.unit()))


# -- the tree cases (1, 2, 5, 6) -------------------------------------------------------


def tree_cases(store: str, url: str, options: dict[str, Any], size_mb: int, fresh_mb: int,
               repeat: int, tmp: Path) -> None:
    fs, base = fsspec.core.url_to_fs(url, **options)
    if store == "file":
        fs.makedirs(base, exist_ok=True)
    data = make_data(tmp, size_mb, "dir")
    stats: list[taskpoint.SaveStats] = []
    ckpt = taskpoint.Checkpoint(f"{url}/inc", storage_options=options, workdir=tmp / "restores")
    ckpt.on_commit(stats.append)

    os.sync()
    started = time.perf_counter()
    ckpt.save_sync(data)
    first = time.perf_counter() - started
    second = timed(lambda: ckpt.save_sync(data), repeat, warmup=0)
    report(f"1. unchanged {size_mb} MB tree: payload bytes uploaded", stats[-1].uploaded, "== 0",
           " B")
    report("1. unchanged tree: save time / first save", second / first, "<= 0.05")
    note(f"   (first save {first:.2f}s, unchanged save {second:.2f}s)")

    shard = data / "shard-03.bin"
    rng = np.random.default_rng(7)
    shard.write_bytes(rng.standard_normal(shard.stat().st_size // 4, dtype=np.float32).tobytes())
    ckpt.save_sync(data)
    report("2. 1 of 8 shards changed: bytes uploaded / shard size",
           stats[-1].uploaded / shard.stat().st_size, "<= 1.05")

    raw = f"{base}/raw"
    fs.put(str(data), raw, recursive=True)
    got = tmp / "raw-got"
    raw_get = raw_get_s(fs, raw, got, repeat)

    def tp_load() -> None:
        restored = ckpt.load_sync()
        assert restored is not None
        shutil.rmtree(restored.parent)

    tp_get = timed(tp_load, repeat)
    report(f"5. restore {size_mb} MB: raw parallel get / taskpoint", raw_get / tp_get, ">= 0.8")
    into = tmp / "into"
    ckpt.load_sync(into=into)
    kept = timed(lambda: ckpt.load_sync(into=into), repeat)
    report("5. restore with every file present / full restore", kept / tp_get, "<= 0.1")
    note(f"   (raw get {raw_get:.2f}s, taskpoint {tp_get:.2f}s, all present {kept:.2f}s)")
    shutil.rmtree(into, ignore_errors=True)
    shutil.rmtree(got, ignore_errors=True)
    shutil.rmtree(data)
    fs.rm(raw, recursive=True)

    fresh_root = tmp / "fresh"
    fresh_root.mkdir()
    fresh = make_data(fresh_root, fresh_mb, "dir")
    ref_obj = f"{base}/reference.tar.gz"

    def ref_save() -> None:
        archive = tmp / "reference.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
            tar.add(fresh, arcname=".")
        fs.put_file(str(archive), ref_obj)
        archive.unlink()

    def ref_load() -> None:
        local = tmp / "ref-download"
        fs.get_file(ref_obj, str(local))
        with tarfile.open(local, "r:gz") as tar:
            tar.extractall(tmp / "ref-out", filter="data")
        shutil.rmtree(tmp / "ref-out")
        local.unlink()

    saves = FreshSaves(url, options, fresh, tmp / "restores")  # a new run's URL each time
    raw_put = raw_put_s(fs, fresh, f"{base}/raw-fresh", repeat)
    durable_put = raw_durable_put_s(fs, fresh, f"{base}/raw-fresh", repeat)
    tp_save = timed(saves.save, repeat)
    ref = timed(ref_save, 1, warmup=0)
    report(f"6. fresh {fresh_mb} MB save: reference / taskpoint", ref / tp_save, ">= 15")
    report("6. fresh save: taskpoint / raw put", tp_save / raw_put, "<= 2")
    report("6. fresh save: taskpoint / durable raw put (fsynced)", tp_save / durable_put, "<= 1.5")

    tp_load_s = timed(saves.load, repeat)
    ref_load_s = timed(ref_load, 1, warmup=0)
    report("6. fresh restore: reference / taskpoint", ref_load_s / tp_load_s, ">= 2.5")
    note(f"   (reference save {ref:.2f}s, taskpoint {tp_save:.2f}s, raw put {raw_put:.2f}s, "
         f"durable raw put {durable_put:.2f}s; "
         f"reference restore {ref_load_s:.2f}s, taskpoint {tp_load_s:.2f}s)")
    shutil.rmtree(fresh_root)


# -- the framework cases (3, 4) --------------------------------------------------------


def hf_case(url: str, options: dict[str, Any], tmp: Path) -> _Recorder:
    import torch
    from taskpoint_hf import TaskpointTrainerCallback
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8192, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (32, 64))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    out = tmp / "hf-out"
    args = TrainingArguments(
        output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=2,
        save_total_limit=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0,
    )
    # In this process, so that _chunk_avg's override reaches the saves (an upload process
    # would chunk at the default size whatever --chunks says).
    ckpt = taskpoint.Checkpoint(url, storage_options=options, workdir=tmp / "restores",
                                background_upload="thread")

    def newest() -> int:
        folders = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        return _tree_size(folders[-1])

    recorder = _Recorder(ckpt, newest)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[TaskpointTrainerCallback(ckpt, out)])
    trainer.train()
    shutil.rmtree(out)
    return recorder


def lightning_case(url: str, options: dict[str, Any], tmp: Path) -> _Recorder:
    import lightning.pytorch as pl
    import torch
    from taskpoint_lightning import TaskpointModelCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(5)))

        def training_step(self, batch: Any, _: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 1024))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    out = tmp / "pl-out"
    # In this process, so that _chunk_avg's override reaches the saves (an upload process
    # would chunk at the default size whatever --chunks says).
    ckpt = taskpoint.Checkpoint(url, storage_options=options, workdir=tmp / "restores",
                                background_upload="thread")

    def one_ckpt() -> int:
        return max(p.stat().st_size for p in out.glob("epoch=*.ckpt"))

    recorder = _Recorder(ckpt, one_ckpt)
    callback = TaskpointModelCheckpoint(ckpt, dirpath=str(out), save_last=True,
                                        every_n_epochs=1)
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], limit_train_batches=2,
    )
    trainer.fit(Module(), loader)
    shutil.rmtree(out)
    return recorder


def framework_cases(store: str, url: str, options: dict[str, Any], chunks: list[int],
                    tmp: Path) -> None:
    for number, name, case, unit in (
        (3, "HF Trainer, save_total_limit=2", hf_case, "checkpoint-N"),
        (4, "Lightning, save_last=True", lightning_case, ".ckpt"),
    ):
        whole_done = False
        for kib in chunks:
            with _chunk_avg(kib), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = case(f"{url}/{name.split(',')[0].replace(' ', '-')}-{kib}", options, tmp)
            worst = max(up / size for up, _, size in rec.rows)
            sizes = "/".join(f"{up / MB:.1f}" for up, _, _ in rec.rows)
            report(f"{number}. {name}, {kib} KiB chunks: max uploaded / one {unit}", worst,
                   "<= 1.05")
            note(f"   ({len(rec.rows)} saves uploading {sizes} MB; one {unit} "
                 f"{rec.rows[-1][2] / MB:.1f} MB)")
            if not whole_done:
                whole = max(w / size for _, w, size in rec.rows)
                report(f"{number}. {name}, whole-file dedup: max uploaded / one {unit}",
                       whole, "<= 1.05")
                whole_done = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512, help="tree of cases 1, 2 and 5")
    parser.add_argument("--fresh-mb", type=int, default=200, help="tree of case 6")
    parser.add_argument("--stores", default="file,s3")
    parser.add_argument("--chunks", default="128,512,2048",
                        help="FastCDC average chunk sizes (KiB) for cases 3 and 4")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--skip", default="", help="comma-separated: tree,frameworks")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    default_kib = _tree_save.CHUNK_AVG // 1024
    if default_kib in chunks:  # the default first: it is what every store runs
        chunks.remove(default_kib)
    chunks.insert(0, default_kib)
    skip = set(args.skip.split(","))
    print(f"{os.cpu_count()} CPUs; taskpoint {taskpoint.__version__}; "
          f"default chunk {default_kib} KiB", flush=True)
    for store in args.stores.split(","):
        with bench_store(store, "tp-bench-inc-") as (url, options, tmp):
            if "tree" not in skip:
                tree_cases(store, url, options, args.size_mb, args.fresh_mb, args.repeat, tmp)
            if "frameworks" not in skip:
                framework_cases(store, url, options,
                                chunks if store == args.stores.split(",")[0] else chunks[:1], tmp)

if __name__ == "__main__":
    main()
