"""Background saves: ``save_sync`` copies the state off the training tensors and returns;
serialising and uploading run in a thread, one save at a time; a save asked for during an
upload waits behind it, replacing one waiting there.

Uploads are made slow on purpose with a real ``taskpoint.Checkpoint`` whose ``progress=``
callback (called as payload bytes stream) holds them while a gate is closed.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import taskpoint
import torch
from taskpoint import preemption
from taskpoint_pytorch import ResumePoint, TaskpointState
from taskpoint_pytorch._bundle import cpu_copy
from torch import nn


class Gate:
    """A ``progress=`` callback that holds every upload while the gate is closed."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()

    def close(self) -> None:
        self._open.clear()
        self.held.clear()

    def open(self) -> None:
        self._open.set()

    def open_in(self, seconds: float) -> None:
        threading.Timer(seconds, self._open.set).start()

    def __call__(self, moved: int) -> None:
        if not self._open.is_set():
            self.held.set()
            assert self._open.wait(timeout=60), "the test never opened the gate"


def _until_idle(state: TaskpointState) -> None:
    """Until the state's background saves have finished (without taking their error)."""
    deadline = time.monotonic() + 60
    while state._preemption.uploads.busy and time.monotonic() < deadline:
        time.sleep(0.01)


def _held_upload(tmp_path: Path, gate: Gate, **options: Any) -> tuple[
    taskpoint.Checkpoint, list[taskpoint.SaveStats], nn.Module, torch.optim.Optimizer,
    TaskpointState,
]:
    """A background state whose first save (epoch 1) uploads, held at the closed ``gate``:
    its checkpoint (with ``options``), the commits it reports, the model, its optimizer and
    the state."""
    checkpoint = taskpoint.Checkpoint(
        f"file://{tmp_path / 'store'}", keep=5, progress=gate, **options
    )
    commits: list[taskpoint.SaveStats] = []
    checkpoint.on_commit(commits.append)
    model, opt = _trained()
    state = TaskpointState(model, opt, blocking=False)
    gate.close()
    state.save_sync(checkpoint, epoch=1)
    assert gate.held.wait(timeout=30)  # its upload is in flight, held
    return checkpoint, commits, model, opt, state


def _until_committed(commits: list[Any], count: int) -> None:
    """Until ``count`` commits were seen, without a wait (which would stop an upload in
    flight for the newer save behind it)."""
    deadline = time.monotonic() + 60
    while len(commits) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()


def test_a_background_save_returns_at_once_with_the_state_as_it_was(tmp_path: Path) -> None:
    gate = Gate()
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", progress=gate)
    model, opt = _trained()
    state = TaskpointState(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    gate.close()
    started = time.monotonic()
    state.save_sync(checkpoint, epoch=1, step=1, background=True)
    assert time.monotonic() - started < 5
    assert gate.held.wait(timeout=30)  # the upload runs, held at the gate
    assert checkpoint.committed() == []
    _step(model, opt)  # the training tensors change in place while it uploads
    gate.open()
    assert state.wait()

    fresh = nn.Linear(4, 3)
    resume = TaskpointState(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1)).restore_sync(
        checkpoint
    )
    assert resume == ResumePoint(epoch=1, step=1)
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_background_saves_to_a_one_archive_per_save_store_commit_and_restore(
    tmp_path: Path,
) -> None:
    """Store format 1 is handed the bundle file, not its folder: its linked snapshot must
    outlive the scratch folder the bundle was serialised in, which goes at once."""
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", store_format=1)
    model, opt = _trained()
    state = TaskpointState(model, opt)
    for step in (1, 2, 3):
        state.save_sync(checkpoint, step=step, background=True)
        _step(model, opt)
    assert state.wait()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    state.save_sync(checkpoint, step=4, background=True)
    assert state.wait()
    assert [m.step for m in checkpoint.committed()][:1] == [4]

    fresh = nn.Linear(4, 3)
    resume = TaskpointState(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1)).restore_sync(
        taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", store_format=1)
    )
    assert resume == ResumePoint(epoch=0, step=4)
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_saves_during_an_upload_return_at_once_and_the_newest_commits_next(
    tmp_path: Path,
) -> None:
    gate = Gate()
    checkpoint, commits, _, _, state = _held_upload(tmp_path, gate)
    gate.open_in(10.0)  # a save that waited for the upload would take this long
    for epoch in (2, 3, 4):
        started = time.monotonic()
        state.save_sync(checkpoint, epoch=epoch)  # waits behind the upload; never for it
        assert time.monotonic() - started < 5, epoch
    assert commits == []
    gate.open()
    _until_committed(commits, 2)
    assert state.wait()
    # The upload in flight commits, then the newest save; 2 and 3 were replaced (coalesced).
    assert [(s.seq, s.coalesced) for s in commits] == [(0, 0), (1, 2)]
    assert [m.stats and m.stats.get("coalesced") for m in checkpoint.committed()] == [2, None]
    resume = TaskpointState(*_trained()).restore_sync(checkpoint)
    assert resume is not None and resume.epoch == 4


def test_a_wait_stops_the_upload_in_flight_for_the_newer_save_behind_it(
    tmp_path: Path,
) -> None:
    """Training waits for both saves (at its end, say): the older one, still uploading,
    stops uncommitted, and the newer one uploads at once instead of after it."""
    gate = Gate()
    checkpoint, commits, model, opt, state = _held_upload(tmp_path, gate)
    _step(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    state.save_sync(checkpoint, epoch=2)  # waits behind the upload
    gate.open_in(1.0)  # the wait has stopped the held upload by then
    assert state.wait()
    assert [(s.seq, s.coalesced) for s in commits] == [(1, 1)]
    fresh = nn.Linear(4, 3)
    resume = TaskpointState(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1)).restore_sync(
        checkpoint
    )
    assert resume is not None and resume.epoch == 2
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_when_busy_wait_makes_a_save_during_an_upload_wait_for_it(tmp_path: Path) -> None:
    gate = Gate()
    checkpoint, commits, _, _, state = _held_upload(tmp_path, gate, when_busy="wait")
    gate.open_in(1.0)
    started = time.monotonic()
    state.save_sync(checkpoint, epoch=2)  # waits for the first upload, then starts its own
    assert time.monotonic() - started >= 0.5
    assert len(commits) == 1
    state.wait()
    assert [(s.attempt, s.seq, s.coalesced) for s in commits] == [(0, 0, 0), (0, 1, 0)]
    resume = TaskpointState(*_trained()).restore_sync(checkpoint)
    assert resume is not None and resume.epoch == 2


def test_a_preemption_save_replaces_the_waiting_save_and_stops_the_upload(
    tmp_path: Path,
) -> None:
    """It goes first: the save waiting behind the upload is dropped, and the upload in
    flight (held here, so that it is certain to be in flight) stops uncommitted."""
    gate = Gate()
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", keep=5, progress=gate)
    commits: list[taskpoint.SaveStats] = []
    checkpoint.on_commit(commits.append)
    model, opt = _trained()
    state = TaskpointState(model, opt, blocking=False, save_on_preemption=True)
    try:
        assert state.restore_sync(checkpoint) is None  # starts deferring SIGTERM
        gate.close()
        state.save_sync(checkpoint, epoch=1)
        assert gate.held.wait(timeout=30)
        state.save_sync(checkpoint, epoch=2)  # waits behind the upload in flight
        preemption.relay(60.0)  # what taskpoint's SIGTERM handler does
        gate.open_in(1.0)
        with pytest.raises(taskpoint.Preempted, match="preemption save committed"):
            state.save_sync(checkpoint, epoch=3)
    finally:
        preemption.reset()
        gate.open()
    # Epoch 1's upload stopped, epoch 2 never reached the checkpoint: both coalesced.
    assert [(s.seq, s.coalesced) for s in commits] == [(1, 2)]
    assert [m.seq for m in checkpoint.committed()] == [1]
    newest = checkpoint.committed()[0]
    assert newest.preemption and newest.stats is not None and newest.stats["coalesced"] == 2
    resume = TaskpointState(*_trained()).restore_sync(checkpoint)
    assert resume is not None and resume.epoch == 3


def test_a_failed_upload_is_raised_by_the_next_save_and_the_previous_one_loads(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "parent"
    checkpoint = taskpoint.Checkpoint(f"file://{parent / 'store'}")
    model, opt = _trained()
    state = TaskpointState(model, opt, blocking=False)
    state.save_sync(checkpoint, epoch=1)
    state.wait()
    parent.rename(tmp_path / "parent.moved")
    parent.write_text("a file where the store's folder was")
    state.save_sync(checkpoint, epoch=2)  # returns; its upload fails in the background
    _until_idle(state)
    with pytest.raises(taskpoint.CheckpointStoreError, match="Not a directory"):
        state.save_sync(checkpoint, epoch=3)
    state.save_sync(checkpoint, epoch=4)  # raised once; this one fails in the background too
    _until_idle(state)
    with pytest.raises(taskpoint.CheckpointStoreError):
        state.wait()

    parent.unlink()
    (tmp_path / "parent.moved").rename(parent)
    resume = TaskpointState(*_trained()).restore_sync(
        taskpoint.Checkpoint(f"file://{parent / 'store'}")
    )
    assert resume is not None and resume.epoch == 1


def test_bad_values_are_refused_at_the_call_not_in_the_background(tmp_path: Path) -> None:
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    state = TaskpointState(nn.Linear(2, 1), blocking=False)
    with pytest.raises(TypeError, match=r"extra\['when'\]"):
        state.save_sync(checkpoint, extra={"when": object()})
    assert state.wait() and checkpoint.committed() == []


@pytest.mark.parametrize(
    ("blocking", "background", "waits"),
    [(True, None, True), (False, False, True), (False, None, False), (True, True, False)],
)
def test_blocking_is_the_default_and_each_call_can_override_it(
    tmp_path: Path, blocking: bool, background: bool | None, waits: bool
) -> None:
    gate = Gate()
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", progress=gate)
    state = TaskpointState(nn.Linear(2, 1), blocking=blocking)
    gate.close()
    gate.open_in(0.5)
    started = time.monotonic()
    state.save_sync(checkpoint, background=background)
    took = time.monotonic() - started
    assert (len(checkpoint.committed()) == 1) is waits
    assert (took >= 0.4) is waits
    state.wait()
    assert len(checkpoint.committed()) == 1


def test_the_copy_is_private_and_keeps_shared_tensors_shared() -> None:
    weight = torch.ones(3)
    value = {"a": weight, "b": [weight, (weight, 2)], "c": {"n": 1, "s": "x"}}
    copied, tensors = cpu_copy(value)
    assert len(tensors) == 1 and tensors[0] is copied["a"]
    weight.add_(1)
    assert torch.equal(copied["a"], torch.ones(3))
    assert copied["a"] is copied["b"][0] is copied["b"][1][0]
    assert copied["b"][1][1] == 2 and copied["c"] == {"n": 1, "s": "x"}
    assert isinstance(copied["b"][1], tuple)


def test_the_copy_of_a_state_dict_keeps_its_metadata() -> None:
    """A background save's bundle holds what a blocking save's does: a module's state dict
    with its ``_metadata`` (the module versions ``load_state_dict`` reads)."""
    state = torch.nn.BatchNorm1d(3).state_dict()
    copied, _ = cpu_copy({"models": {"model": state}})
    assert type(copied["models"]["model"]) is type(state)
    assert copied["models"]["model"]._metadata == state._metadata  # type: ignore[attr-defined]


def test_a_copy_writes_into_an_earlier_copys_tensors_when_they_fit() -> None:
    """The memory an earlier copy touched takes the next one (no page faults on fresh
    memory: the time training waits); a bundle whose tensors changed shape gets new ones."""
    value = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "step": 1}
    _, buffers = cpu_copy(value)
    value["w"].add_(2)
    second, again = cpu_copy(value, buffers)
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in buffers]
    assert torch.equal(second["w"], torch.full((4, 3), 2.0)) and second["step"] == 1
    assert second["w"] is not value["w"] and second["w"].data_ptr() != value["w"].data_ptr()
    grown = {"w": torch.zeros(5, 3), "b": torch.zeros(3), "step": 2}
    third, fresh = cpu_copy(grown, again)
    assert all(t.data_ptr() not in {b.data_ptr() for b in again} for t in fresh)
    assert third["w"].shape == (5, 3)


def test_coalesced_background_saves_reuse_copies_without_mixing_them(tmp_path: Path) -> None:
    """Saves 2 and 3 wait behind a held upload and are replaced in turn; save 4 copies into
    save 2's dropped tensors. The commits hold save 1's and save 4's weights exactly."""
    gate = Gate()
    url = f"file://{tmp_path / 'store'}"
    checkpoint = taskpoint.Checkpoint(url, keep=5, progress=gate)
    committed: list[torch.Tensor] = []

    def newest_weight(_: taskpoint.SaveStats) -> None:  # what the store holds at each commit
        folder = taskpoint.Checkpoint(url).load_sync(into=tmp_path / f"restored{len(committed)}")
        assert folder is not None
        bundle = torch.load(next(Path(folder).rglob("state.pt")), weights_only=True)
        (weights,) = bundle["models"].values()
        committed.append(weights["weight"])

    checkpoint.on_commit(newest_weight)
    model, opt = _trained()
    state = TaskpointState(model, opt, blocking=False)
    gate.close()
    expected = {}
    for epoch in (1, 2, 3, 4):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        expected[epoch] = model.weight.detach().clone()
        state.save_sync(checkpoint, epoch=epoch)
        if epoch == 1:
            assert gate.held.wait(timeout=30)  # save 1's upload is in flight, held
    with torch.no_grad():
        model.weight.fill_(-1.0)  # training goes on while the uploads run
    gate.open()
    _until_committed(committed, 2)
    assert state.wait()
    assert len(committed) == 2
    for weight, epoch in zip(committed, (1, 4), strict=True):
        assert torch.equal(weight, expected[epoch]), epoch


def test_a_copy_takes_the_last_copys_tensors_once_serialised_while_it_uploads(
    tmp_path: Path,
) -> None:
    """A background save's host tensors serve the next copy as soon as its bundle is
    serialised (the upload reads the file, not them); each commit holds its own weights."""
    gate = Gate()
    url = f"file://{tmp_path / 'store'}"
    checkpoint = taskpoint.Checkpoint(url, keep=5, progress=gate)
    committed: list[float] = []

    def newest_weight(_: taskpoint.SaveStats) -> None:
        folder = taskpoint.Checkpoint(url).load_sync(into=tmp_path / f"restored{len(committed)}")
        assert folder is not None
        bundle = torch.load(next(Path(folder).rglob("state.pt")), weights_only=True)
        committed.append(float(bundle["models"]["model"]["weight"].mean()))

    checkpoint.on_commit(newest_weight)
    model, opt = _trained()
    state = TaskpointState(model, opt, blocking=False)
    gate.close()
    for epoch in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        state.save_sync(checkpoint, epoch=epoch)
        if epoch == 1:
            assert gate.held.wait(timeout=30)  # save 1 is serialised; its upload is held
            assert len(state._state._free) == 1  # type: ignore[union-attr]  # its tensors
    assert not state._state._free  # type: ignore[union-attr]  # save 2 copied into them
    gate.open()
    _until_committed(committed, 2)
    assert state.wait()
    assert committed == [1.0, 2.0]


@pytest.mark.parametrize("failures", [(5,), (6, 14)], ids=lambda f: "fail-" + "-".join(map(str, f)))
def test_background_saves_resume_bitwise_equal(
    lib: ModuleType, tmp_path: Path, failures: tuple[int, ...]
) -> None:
    """In-process retries: each restore waits for the failed attempt's upload in flight."""
    reference = lib.run(lib.build())
    env = taskpoint.TaskEnvironment(name="background", root=f"file://{tmp_path / 'store'}")
    pending = set(failures)
    starts: list[int] = []

    def before_step(step: int) -> None:
        if step in pending:
            pending.discard(step)
            raise RuntimeError(f"simulated failure before step {step}")

    def on_resume(resume: Any) -> None:
        starts.append(resume.epoch if resume else 0)

    @env.task(retries=len(failures), backoff=0)
    def train() -> dict[str, Any]:
        parts = lib.build()
        return lib.run(
            parts, parts.state(), taskpoint.ctx().checkpoint, before_step=before_step,
            on_resume=on_resume, background=True,
        )

    result = train()
    assert starts == [0] + [(step - 1) // lib.STEPS_PER_EPOCH for step in failures]
    assert lib.bitwise_differences(result, reference) == []


def test_the_serialised_bundle_goes_once_its_snapshot_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a background save uploads, the temporary directory holds its snapshot only,
    not a second copy of the state as serialised: a process killed during the upload (the
    OOM killer) leaves nothing there that its upload process or the next load does not
    remove."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    gate = Gate()
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", progress=gate)
    state = TaskpointState(*_trained(), blocking=False)
    gate.close()
    state.save_sync(checkpoint, epoch=1)
    assert gate.held.wait(timeout=30)  # its upload is in flight, held
    left = sorted(p.name for p in scratch.iterdir() if "taskpoint-" in p.name)
    gate.open()
    assert state.wait()
    assert [n for n in left if n.startswith("taskpoint-pytorch-")] == [], left
    assert [n for n in left if "snapshot" in n], left
    assert sorted(p.name for p in scratch.iterdir() if "taskpoint-" in p.name) == []
