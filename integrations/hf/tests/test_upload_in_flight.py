"""A Trainer killed while its last checkpoint uploads: the retry resumes from that one.

A ``Trainer`` (tiny BERT built from a config; 4 steps an epoch, saved every epoch) runs in
``@env.task(isolation="process")`` and is SIGKILLed at step 10, while the upload of
``checkpoint-8`` is in flight in its upload process, which outlives it and goes on to
commit. The retry starts at once. It waits for that upload (at most the grace period) and
resumes from ``checkpoint-8``, losing 2 steps, not 6. When the upload takes longer than the
grace period, the retry resumes from ``checkpoint-4`` but keeps the local ``checkpoint-8``,
which that upload may still commit.

The store is the local disk seen as a remote store through a ``slow://`` file system (a ``sitecustomize`` on
the children's path registers it): in the upload process, the first write after the flag
file appears (made at step 6, once ``checkpoint-4`` has committed) marks that the upload is
in flight, then holds until the retry is about to restore, plus ``HOLD_S`` seconds. So the
upload is in flight when the kill lands and when the retry starts, on any machine load.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

SLOW_FS = textwrap.dedent(
    """
    import os, sys, time
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    class SlowFileSystem(DirFileSystem):
        \"\"\"``slow://PATH``: ``$SLOW_ROOT/PATH`` on the local disk, seen as a remote store
        (taskpoint writes to it as to an object store, through the file system); see
        :func:`_hold` for what makes it slow.\"\"\"

        protocol = ("slow",)

        def __init__(self, *args, **kwargs):
            super().__init__(path=os.environ["SLOW_ROOT"], fs=LocalFileSystem(auto_mkdir=True))

        def pipe_file(self, path, value, *args, **kwargs):
            _hold()
            return super().pipe_file(path, value, *args, **kwargs)

        def put_file(self, lpath, rpath, *args, **kwargs):
            _hold()
            return super().put_file(lpath, rpath, *args, **kwargs)

        def open(self, path, mode="rb", *args, **kwargs):
            if "w" in mode or "x" in mode:
                _hold()
            return super().open(path, mode, *args, **kwargs)

    def _hold():
        \"\"\"In an upload process (started as ``python -c``), the first write once
        $SLOW_FLAG exists (one write in all: it takes the flag) creates $SLOW_MARK, waits
        until $RETRY_LOADING exists, then $HOLD_S seconds more.\"\"\"
        flag = os.environ["SLOW_FLAG"]
        if sys.argv[0] != "-c" or not os.path.exists(flag):
            return
        try:
            os.rename(flag, flag + ".taken")
        except FileNotFoundError:  # another write took it
            return
        open(os.environ["SLOW_MARK"], "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.environ["RETRY_LOADING"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(float(os.environ["HOLD_S"]))
    """
)
SLOW_SITE = textwrap.dedent(
    """
    import fsspec
    fsspec.register_implementation("slow", "slowfs.SlowFileSystem", clobber=True)
    """
)
TASK = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    import taskpoint
    import torch
    import taskpoint_hf_testkit as kit
    from taskpoint.checkpoint import _uploader
    from taskpoint.integration import settle_uploads
    from taskpoint_hf import TaskpointTrainerCallback, last_complete_checkpoint, restore_last_checkpoint
    from transformers import TrainerCallback

    env = taskpoint.TaskEnvironment(name="hf", root=os.environ["STORE"], run_id="r1")
    WORK = Path(os.environ["WORK"])
    EPOCHS = {"save_strategy": "epoch", "per_device_train_batch_size": 8}  # 4 steps an epoch


    class FirstAttempt(TrainerCallback):
        \"\"\"At step 6 (checkpoint-4 committed, the upload process ready): make the next
        upload slow. At step 10, once checkpoint-8's upload is in flight: SIGKILL.\"\"\"

        def on_step_end(self, args, state, control, **kw):
            if taskpoint.ctx().attempt != 0:
                return
            if state.global_step == 6:
                settle_uploads()
                # The next save goes to the upload process (one still starting, as under
                # load, would leave it to a thread of this process, dying with it).
                assert _uploader.shared().wait_ready(300), "the upload process did not start"
                Path(os.environ["SLOW_FLAG"]).touch()
            if state.global_step == 10:
                deadline = time.monotonic() + 120
                while not Path(os.environ["SLOW_MARK"]).exists():
                    assert time.monotonic() < deadline, "checkpoint-8's upload never started"
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)


    @env.task(retries=1, backoff=0.0, isolation="process")
    def train() -> dict:
        torch.set_num_threads(1)
        attempt = taskpoint.ctx().attempt
        ckpt = taskpoint.ctx().checkpoint
        out = WORK / "out-epoch"
        args = kit._classifier_args(out, **EPOCHS)
        if attempt > 0:
            Path(os.environ["RETRY_LOADING"]).touch()
        resume = restore_last_checkpoint(ckpt, args)
        local = sorted(p.name for p in out.glob("checkpoint-*")) if out.is_dir() else []
        (WORK / f"restored-{attempt}.json").write_text(json.dumps({
            "resume": resume.name if resume else None, "local": local,
            "complete": str(last_complete_checkpoint(out)) if out.is_dir() else None,
        }))
        trainer = kit.classifier_trainer(
            out, callbacks=[FirstAttempt(), TaskpointTrainerCallback(ckpt, args.output_dir)],
            **EPOCHS,
        )
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        return {"step": trainer.state.global_step}


    if __name__ == "__main__":
        print(json.dumps(train()), flush=True)
    """
)


def _run(tmp_path: Path, *, hold_s: float, grace: float) -> tuple[dict[str, object], str]:
    """Run :data:`TASK` (attempt 0 killed at step 10, attempt 1 finishing); what attempt 1
    found after its restore, and the output."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "slowfs.py").write_text(SLOW_FS)
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    (tmp_path / "task.py").write_text(TASK)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        STORE="slow://store", SLOW_ROOT=str(tmp_path), WORK=str(work), HOLD_S=str(hold_s),
        SLOW_FLAG=str(tmp_path / "slow"), SLOW_MARK=str(tmp_path / "uploading"),
        RETRY_LOADING=str(tmp_path / "retry-loading"), TASKPOINT_GRACE_PERIOD=str(grace),
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
    )
    out = tmp_path / "out.txt"
    with out.open("w") as output:  # a file: upload processes may outlive the run
        run = subprocess.Popen(
            [sys.executable, str(tmp_path / "task.py")], cwd=tmp_path, stdout=output,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            run.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)  # an upload process still running
            run.wait()
    log = out.read_text()
    assert run.returncode == 0, log[-5000:]
    assert (tmp_path / "uploading").exists(), log[-5000:]  # checkpoint-8's upload was slow
    assert '{"step": 12}' in log, log[-5000:]
    return json.loads((work / "restored-1.json").read_text()), log


@pytest.mark.slow
def test_a_retry_waits_for_the_killed_attempts_upload_and_resumes_from_it(
    tmp_path: Path,
) -> None:
    """SIGKILLed at step 10 with checkpoint-8 uploading: the retry resumes at 8, and the
    local checkpoint-8 is there."""
    restored, log = _run(tmp_path, hold_s=3.0, grace=300.0)
    assert restored["resume"] == "checkpoint-8", log[-5000:]
    assert "checkpoint-8" in restored["local"], log[-5000:]  # type: ignore[operator]
    assert str(restored["complete"]).endswith("checkpoint-8"), log[-5000:]
    assert "checkpoint-8: it is not part of the checkpoint being restored" not in log, log[-5000:]


@pytest.mark.slow
def test_a_restore_keeps_a_newer_local_checkpoint_whose_upload_may_still_commit(
    tmp_path: Path,
) -> None:
    """The upload outlasts the grace period: the retry resumes from checkpoint-4 but keeps
    the complete local checkpoint-8, which that upload may still commit."""
    restored, log = _run(tmp_path, hold_s=60.0, grace=3.0)
    assert restored["resume"] == "checkpoint-4", log[-5000:]
    assert "checkpoint-8" in restored["local"], log[-5000:]  # type: ignore[operator]
    assert "keeping" in log and "may yet commit it" in log, log[-5000:]
    assert "checkpoint-8: it is not part of the checkpoint being restored" not in log, log[-5000:]
