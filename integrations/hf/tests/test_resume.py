"""restore_last_checkpoint / last_complete_checkpoint on real Trainer checkpoints."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint, CheckpointError, TaskpointWarning
from taskpoint_hf import (
    INCOMPLETE_MARKER,
    TRAINER_STATE,
    checkpoint_step,
    last_complete_checkpoint,
    restore_last_checkpoint,
)


def _copy(trained_dir: Path, dest: Path, steps: list[int]) -> Path:
    dest.mkdir(parents=True)
    for step in steps:
        shutil.copytree(trained_dir / f"checkpoint-{step}", dest / f"checkpoint-{step}")
    return dest


def _break(path: Path, how: str) -> None:
    """Make ``path`` look like a checkpoint-N whose writing was cut short."""
    state = path / TRAINER_STATE
    if how == "no_state":
        state.unlink()
    elif how == "marker":
        (path / INCOMPLETE_MARKER).write_text("Checkpoint started at step 12 and in progress...")
    else:
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def _names(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.glob("checkpoint-*")), key=lambda n: int(n[11:]))


def test_checkpoint_step_reads_the_number() -> None:
    assert checkpoint_step("out/checkpoint-120") == 120
    assert checkpoint_step(Path("checkpoint-7")) == 7
    assert checkpoint_step("checkpoint-7.tmp") is None
    assert checkpoint_step("runs") is None


def test_newest_is_chosen_by_number_not_by_name(trained_dir: Path, tmp_path: Path) -> None:
    out = _copy(trained_dir, tmp_path / "out", [3, 9, 12])
    # "checkpoint-9" sorts after "checkpoint-12" as a string
    assert last_complete_checkpoint(out) == out / "checkpoint-12"


@pytest.mark.parametrize("how", ["no_state", "marker", "truncated_state"])
def test_partial_newest_is_skipped_with_a_warning(
    trained_dir: Path, tmp_path: Path, how: str
) -> None:
    out = _copy(trained_dir, tmp_path / "out", [6, 9, 12])
    _break(out / "checkpoint-12", how)
    with pytest.warns(TaskpointWarning, match="checkpoint-12"):
        assert last_complete_checkpoint(out) == out / "checkpoint-9"


def test_nothing_complete_gives_none(tmp_path: Path) -> None:
    assert last_complete_checkpoint(tmp_path / "missing") is None
    (tmp_path / "checkpoint-4").mkdir()
    with pytest.warns(TaskpointWarning, match="checkpoint-4"):
        assert last_complete_checkpoint(tmp_path) is None


@pytest.mark.parametrize("how", [
    # One way of breaking it on every store; how checkpoint-12 was broken is read from the
    # restored folder, the same whatever the store, so the file store and one object store
    # are enough for the other (each case trains a Trainer to the end).
    "no_state", pytest.param("marker", marks=pytest.mark.stores("file", "s3")),
])
def test_partial_newest_in_store_resumes_from_previous_good_one(
    trained_dir: Path,
    tmp_path: Path,
    store_url: str,
    how: str,
    reference: Callable[..., kit.Result],
) -> None:
    tree = _copy(trained_dir, tmp_path / "tree" / "out", [6, 9, 12])
    _break(tree / "checkpoint-12", how)
    checkpoint = Checkpoint(store_url)
    checkpoint.save_sync(tree)

    out = tmp_path / "out"
    with pytest.warns(TaskpointWarning, match="skipping checkpoint-12"):
        resumed = restore_last_checkpoint(checkpoint, out)
    assert resumed == out / "checkpoint-9"
    assert _names(out) == ["checkpoint-6", "checkpoint-9"]

    with pytest.warns(TaskpointWarning, match="skipping checkpoint-12"):
        result = kit.run_classifier(checkpoint, out)
    assert result.resumed_from == str(out / "checkpoint-9")
    kit.assert_same_run(result, reference("classifier"))


def test_restored_mtimes_keep_rotation_right(
    trained_dir: Path, tmp_path: Path, reference: Callable[..., kit.Result]
) -> None:
    tree = _copy(trained_dir, tmp_path / "tree" / "out", [3, 6])
    ahead = time.time() + 3600  # written on a machine whose clock runs an hour ahead
    for offset, name in enumerate(["checkpoint-6", "checkpoint-3"]):
        os.utime(tree / name, (ahead + offset, ahead + offset))
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    checkpoint.save_sync(tree)

    out = tmp_path / "out"
    assert restore_last_checkpoint(checkpoint, out) == out / "checkpoint-6"
    mtimes = [(out / name).stat().st_mtime for name in ["checkpoint-3", "checkpoint-6"]]
    assert mtimes[0] < mtimes[1] < time.time()

    result = kit.run_classifier(checkpoint, out)  # save_total_limit=2, saves at 9 and 12
    assert _names(out) == ["checkpoint-9", "checkpoint-12"]
    kit.assert_same_run(result, reference("classifier"))


def test_output_dir_is_made_to_match_the_store(trained_dir: Path, tmp_path: Path) -> None:
    tree = _copy(trained_dir, tmp_path / "tree" / "out", [3, 6])
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    checkpoint.save_sync(tree)
    # Left in output_dir by an earlier attempt or run: a newer complete checkpoint that never
    # reached the store, a partial one, an interrupted restore's staging folder, other files.
    out = _copy(trained_dir, tmp_path / "out", [9, 12])
    _break(out / "checkpoint-12", "no_state")
    (out / ".taskpoint-restore-old").mkdir()
    (out / "notes.txt").write_text("kept")

    assert restore_last_checkpoint(checkpoint, str(out)) == out / "checkpoint-6"
    assert _names(out) == ["checkpoint-3", "checkpoint-6"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6", "notes.txt"]
    assert sorted(p.name for p in (out / "checkpoint-6").iterdir()) == sorted(
        p.name for p in (trained_dir / "checkpoint-6").iterdir()
    )


def test_empty_store_gives_none_and_clears_stale_checkpoints(
    trained_dir: Path, tmp_path: Path, store_url: str
) -> None:
    out = _copy(trained_dir, tmp_path / "out", [12])
    assert restore_last_checkpoint(Checkpoint(store_url), out) is None
    assert _names(out) == []


def test_store_without_complete_checkpoint_starts_over(tmp_path: Path) -> None:
    tree = tmp_path / "tree" / "out"
    (tree / "checkpoint-3").mkdir(parents=True)
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    checkpoint.save_sync(tree)
    with pytest.warns(TaskpointWarning) as record:
        assert restore_last_checkpoint(checkpoint, tmp_path / "out") is None
    messages = [str(w.message) for w in record]
    assert any("skipping checkpoint-3" in m for m in messages)
    assert any("no complete checkpoint-N" in m for m in messages)


def test_a_stored_file_is_refused(tmp_path: Path) -> None:
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    checkpoint.save_sync(b"42")
    with pytest.raises(CheckpointError, match="not a Trainer output directory"):
        restore_last_checkpoint(checkpoint, tmp_path / "out")


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="CheckpointLike"):
        restore_last_checkpoint("file:///tmp/x", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TrainingArguments \(with an output_dir\); got int"):
        restore_last_checkpoint(Checkpoint(f"file://{tmp_path}"), 3)  # type: ignore[arg-type]


def test_distributed_job_without_process_group_needs_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="pass them instead of the output_dir"):
        restore_last_checkpoint(Checkpoint(f"file://{tmp_path / 'store'}"), tmp_path / "out")


def test_a_stored_checkpoint_directory_on_its_own_is_restored(
    trained_dir: Path, tmp_path: Path
) -> None:
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    checkpoint.save_sync(trained_dir / "checkpoint-9")
    out = tmp_path / "out"
    assert restore_last_checkpoint(checkpoint, out) == out / "checkpoint-9"
    assert _names(out) == ["checkpoint-9"]


def test_an_output_dir_named_like_a_checkpoint_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint-5"
    (out / "logs").mkdir(parents=True)
    assert restore_last_checkpoint(Checkpoint(f"file://{tmp_path / 'store'}"), out) is None
    assert (out / "logs").is_dir()
