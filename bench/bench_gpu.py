"""What a save of CUDA training state costs the training loop (issue #33, on a GPU).

Run (on a machine with CUDA): uv run python bench/bench_gpu.py [--layers 4] [--width 8192]

A model of ``--layers`` square ``nn.Linear(width, width)`` layers on the GPU, with Adam's
state (about 3 x 4 bytes per parameter: 3.2 GB for 4 layers of 8192), trained by real steps.
The store is a ``file://`` folder on the machine's disk (a GPU machine here reaches no object
store). Per way of saving, in one process:

- **plain**: ``torch.save`` of the model and optimizer state to a local file, then a copy of
  that file into the store (``fsspec`` ``put_file``): training waits for both;
- **blocking**: ``TaskpointState(model, opt).save_sync(checkpoint)``;
- **background**: ``TaskpointState(..., blocking=False).save_sync(checkpoint)``: training
  waits only for the copy to pinned host memory; the step time while the upload runs and
  the time from the call to the commit are printed too. Saved twice, since the second save
  copies into the first one's host memory.

Then restore: a copy of the plain file from the store to a local file (a download, as from
an object store), ``torch.load(map_location="cuda")`` and ``load_state_dict``,
against ``TaskpointState.restore_sync`` (download, unpack, load). The background save is
checked to hold the weights of the call, not those of the steps that ran during its upload.
Prints ratios against plain; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import fsspec
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState
from torch import nn

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch).float().pow(2).mean().backward()
    opt.step()


def _step_time(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, n: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(n):
        _step(model, opt, batch)
    _sync()
    return (time.perf_counter() - start) / n


def _timed(fn: object) -> float:
    _sync()
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    _sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--work", default=None, help="folder for the store and local files")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    assert DEVICE != "cuda" or torch.cuda.is_available(), "needs CUDA (or --device cpu)"

    work = Path(args.work or tempfile.mkdtemp(prefix="tp-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    model, opt = _model(args.layers, args.width)
    batch = torch.randn(args.batch, args.width, device=DEVICE)
    for _ in range(3):
        _step(model, opt, batch)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size()
        for entry in opt.state_dict()["state"].values() for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
    step = _step_time(model, opt, batch, 20)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{name}: state {state_bytes / 1e9:.2f} GB, "
          f"step {step * 1e3:.1f} ms, cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")

    # plain: torch.save + a copy into the store
    local = work / "plain" / "latest.pt"
    local.parent.mkdir(parents=True, exist_ok=True)
    fs = fsspec.filesystem("file")
    plain_store = work / "plain-store"
    plain_store.mkdir(exist_ok=True)

    def plain_save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, local)
        fs.put_file(str(local), str(plain_store / "latest.pt"))

    plain = [_timed(plain_save) for _ in range(2)]
    print(f"plain save: blocked {plain[0]:.2f} s, {plain[1]:.2f} s")

    blocking_url = f"file://{work / 'blocking-store'}"
    blocking_state = TaskpointState(model, opt)
    blocking = [_timed(lambda: blocking_state.save_sync(taskpoint.Checkpoint(blocking_url)))
                for _ in range(2)]
    print(f"taskpoint blocking save: blocked {blocking[0]:.2f} s, {blocking[1]:.2f} s")

    background_url = f"file://{work / 'background-store'}"
    background_state = TaskpointState(model, opt, blocking=False)
    checkpoint = taskpoint.Checkpoint(background_url)
    blocked: list[float] = []
    commits: list[float] = []
    during: list[float] = []
    expected: dict[str, torch.Tensor] = {}
    for round_ in range(2):
        start = time.perf_counter()
        blocked.append(_timed(lambda r=round_: background_state.save_sync(checkpoint, step=r)))
        if round_ == 1:
            expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        steps = 0
        _sync()
        step_start = time.perf_counter()
        while steps < 5 or (steps < 200 and not background_state.wait(timeout=0)):
            _step(model, opt, batch)
            steps += 1
            if steps % 5 == 0:
                _sync()
        _sync()
        during.append((time.perf_counter() - step_start) / steps)
        assert background_state.wait()
        commits.append(time.perf_counter() - start)
    print(f"taskpoint background save: blocked {blocked[0]:.2f} s, {blocked[1]:.2f} s (reused "
          f"host memory); commit {commits[0]:.2f} s, {commits[1]:.2f} s after the call; step "
          f"{statistics.mean(during) * 1e3:.1f} ms while uploading ({step * 1e3:.1f} ms idle)")

    # restore
    fresh, fresh_opt = _model(args.layers, args.width)

    def plain_restore() -> None:  # a download from the store to a local file, as from S3
        downloaded = work / "plain-restore" / "latest.pt"
        downloaded.parent.mkdir(exist_ok=True)
        fs.get_file(str(plain_store / "latest.pt"), str(downloaded))
        bundle = torch.load(downloaded, map_location=DEVICE, weights_only=True)
        fresh.load_state_dict(bundle["model"])
        fresh_opt.load_state_dict(bundle["optimizer"])

    plain_load = _timed(plain_restore)
    fresh, fresh_opt = _model(args.layers, args.width)
    restored = TaskpointState(fresh, fresh_opt)
    taskpoint_load = _timed(lambda: restored.restore_sync(taskpoint.Checkpoint(background_url)))
    exact = all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())
    print(f"restore: plain {plain_load:.2f} s, taskpoint {taskpoint_load:.2f} s; background "
          f"save holds the weights of its call: {exact}")
    print(
        f"SUMMARY {state_bytes / 1e9:.2f} GB: training blocked per save, background "
        f"{statistics.median(blocked):.2f} s / plain {statistics.median(plain):.2f} s = "
        f"{statistics.median(blocked) / statistics.median(plain):.3f}; blocking "
        f"{statistics.median(blocking) / statistics.median(plain):.2f}x plain; step while "
        f"uploading {statistics.mean(during) / step:.2f}x idle; restore "
        f"{taskpoint_load / plain_load:.2f}x plain; exact {exact}"
    )
    assert exact, "the background save did not hold the weights of its call"


if __name__ == "__main__":
    main()
