"""A save that training waits for goes first: it stops the background upload in flight.

A blocking save (the adapters' preemption save and save at an exception are ones) asked
for while a background save still uploads holds the newer state; under
``when_busy="coalesce"`` the older upload stops between its pack objects, uncommitted and
counted as coalesced, instead of making training wait for it too. So does a newer
background save waiting behind the upload when training waits for the saves: ``wait()``,
and the interpreter's exit. Against a store far away (``slowremote://``: every object
written takes ``SLOW_S`` seconds), in both places a background save uploads from."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import taskpoint
from _slow_store import slow_env

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import taskpoint
    from taskpoint.checkpoint import _uploader

    url, work, mode, when_busy, how = sys.argv[1:6]
    tree = Path(work) / "tree"
    tree.mkdir()
    for i in range(12):  # 96 MiB of new content: 12 pack objects, two rounds of 8 workers
        (tree / f"w{i}.bin").write_bytes(os.urandom(8 * 2**20))
    ckpt = taskpoint.Checkpoint(
        url, attempt=0, keep=5, background_upload=mode, when_busy=when_busy
    )
    if mode == "process":
        ckpt.load_sync()  # a job loads first: the upload process starts
        assert _uploader.shared().wait_ready(120), "the upload process did not start"
    commits = Path(work) / "commits.jsonl"

    def record(commit):  # read by the test after the exit, which commits too
        with commits.open("a") as fh:
            fh.write(json.dumps([commit.kind, commit.coalesced]) + "\\n")

    ckpt.on_commit(record)
    Path(os.environ["SLOW_FLAG"]).touch()  # from here on every write is slow
    ckpt.save_sync(tree, background=True)
    mark = Path(os.environ["SLOW_MARK"])
    while not mark.exists():  # its first pack is being written
        time.sleep(0.01)
    began = time.monotonic()
    if how == "blocking":
        ckpt.save_sync(b"the newer state")  # training waits for this one
    else:  # a newer save waits behind the upload; training waits for both, or exits
        ckpt.save_sync(b"the newer state", background=True)
        if how == "wait":
            ckpt.wait()
    print(json.dumps({
        "blocked": time.monotonic() - began, "at": time.time(),
        "uploader": int(mark.read_text()), "pid": os.getpid(),
    }), flush=True)
    if how == "blocking":
        ckpt.wait()
    """
)


def _run(
    tmp_path: Path, mode: str, when_busy: str = "coalesce", how: str = "blocking"
) -> dict[str, object]:
    work = tmp_path / "work"
    work.mkdir()
    env = slow_env(tmp_path, SLOW_S="2", SLOW_FLAG=str(tmp_path / "slow-now"))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, f"slowremote://{tmp_path / 'store'}", str(work), mode,
         when_busy, how],
        capture_output=True, text=True, env=env, timeout=600,
    )
    exited = time.time()
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["exit_s"] = exited - float(result["at"])  # type: ignore[arg-type]
    lines = (work / "commits.jsonl").read_text().splitlines()
    result["commits"] = [json.loads(line) for line in lines]
    result["log"] = done.stderr
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("how", ["blocking", "wait"])
def test_a_save_training_waits_for_stops_the_older_upload_and_commits_alone(
    tmp_path: Path, mode: str, how: str
) -> None:
    """``blocking``: a blocking save; ``wait``: a background save waiting behind the
    upload, then ``wait()``."""
    result = _run(tmp_path, mode, how=how)
    assert (result["uploader"] != result["pid"]) == (mode == "process"), result
    # Only the newer save committed, and it counts the stopped one as coalesced.
    assert result["commits"] == [["bytes", 1]], result
    restored = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None and restored.read_bytes() == b"the newer state"
    # Training waited for the older upload's write in flight to end (2 s at most), then for
    # the newer save's two writes (payload and manifest, 2 s each); the older upload's
    # writes left (its second round of packs and its manifest: 4 s at least) never ran.
    assert result["blocked"] < 7.5, result


@pytest.mark.slow
def test_an_exit_stops_the_older_upload_for_the_newer_save_behind_it(tmp_path: Path) -> None:
    """The interpreter's exit waits for the saves in flight and queued: the newest first."""
    result = _run(tmp_path, "process", how="exit")
    assert result["blocked"] < 1, result  # the save itself did not wait
    assert result["commits"] == [["bytes", 1]], result
    restored = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None and restored.read_bytes() == b"the newer state"
    assert result["exit_s"] < 7.5, result


@pytest.mark.slow
@pytest.mark.parametrize("how", ["blocking", "wait"])
def test_with_when_busy_wait_every_save_commits_in_order(tmp_path: Path, how: str) -> None:
    result = _run(tmp_path, "process", when_busy="wait", how=how)
    assert result["commits"] == [["directory", 0], ["bytes", 0]], result


ADAPTER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import taskpoint
    import torch
    from taskpoint import preemption
    from taskpoint.checkpoint import _uploader
    from taskpoint_pytorch import TaskpointState

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 6144, bias=False)  # 96 MiB of weights: 12 pack objects
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = taskpoint.Checkpoint(sys.argv[1], attempt=0, keep=5)
    state = TaskpointState(model, opt, blocking=False, save_on_preemption=True)
    assert state.restore_sync(ckpt) is None  # the upload process starts; SIGTERM is deferred
    assert _uploader.shared().wait_ready(120), "the upload process did not start"
    commits = []
    ckpt.on_commit(commits.append)
    Path(os.environ["SLOW_FLAG"]).touch()
    state.save_sync(ckpt, step=1)  # in the background
    mark = Path(os.environ["SLOW_MARK"])
    while not mark.exists():  # its upload is in flight
        time.sleep(0.01)
    with torch.no_grad():
        model.weight.add_(1.0)  # step 2
    preemption.relay(300.0)  # what taskpoint's SIGTERM handler does
    try:
        state.save_sync(ckpt, step=2)
    except taskpoint.Preempted:
        pass
    print(json.dumps({"commits": [[c.seq, c.coalesced, c.background] for c in commits]}))
    """
)


@pytest.mark.slow
def test_the_pytorch_adapters_preemption_save_stops_its_background_upload(
    tmp_path: Path,
) -> None:
    """The adapter hands its background save to the checkpoint and the preemption save
    (a background one here, waited for) waits only for that hand-over: the older upload
    stops, and the preemption save is the one commit. Before, it waited for the whole
    older upload and committed after it."""
    env = slow_env(tmp_path, SLOW_S="1", SLOW_FLAG=str(tmp_path / "slow-now"))
    done = subprocess.run(
        [sys.executable, "-c", ADAPTER, f"slowremote://{tmp_path / 'store'}"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["commits"] == [[1, 1, True]], done.stderr
    newest = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}").committed()
    assert [m.step for m in newest] == [2] and newest[0].preemption
