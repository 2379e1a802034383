"""Restoring the wrong thing fails clearly, naming what differs, and changes nothing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import taskpoint
import torch
from taskpoint_pytorch import (
    LAYOUT,
    StateError,
    StateLayoutError,
    StateMismatchError,
    TaskpointState,
)
from torch import nn

# What is checked is the bundle's layout and the state's shapes, the same bytes on every
# store: the file store and one object store are enough.
pytestmark = pytest.mark.stores("file", "s3")


def _mlp(hidden: int = 8, extra_layer: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1)]
    if extra_layer:
        layers.append(nn.Linear(1, 1))
    return nn.Sequential(*layers)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.fixture
def checkpoint(store_url: str) -> taskpoint.Checkpoint:
    return taskpoint.Checkpoint(store_url)


def test_first_attempt_returns_none_and_changes_nothing(checkpoint: taskpoint.Checkpoint) -> None:
    model = _mlp()
    before = _params(model)
    rng = torch.get_rng_state()
    assert TaskpointState(model).restore_sync(checkpoint) is None
    assert _unchanged(model, before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_newest_save_is_restored(checkpoint: taskpoint.Checkpoint) -> None:
    model = _mlp()
    state = TaskpointState(model)
    state.save_sync(checkpoint, epoch=1, step=10, extra={"best": 0.5})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    saved = _params(model)
    state.save_sync(checkpoint, epoch=2, step=20, extra={"best": 0.25})
    with torch.no_grad():
        model[0].weight.zero_()
    resume = state.restore_sync(checkpoint)
    assert resume is not None
    assert (resume.epoch, resume.step, resume.extra) == (2, 20, {"best": 0.25})
    assert _unchanged(model, saved)


def test_plain_torch_save_file_is_not_a_bundle(checkpoint: taskpoint.Checkpoint, tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    file = tmp_path / "training.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3}, file)
    checkpoint.save_sync(file)
    with pytest.raises(StateLayoutError) as info:
        TaskpointState(model, opt).restore_sync(checkpoint)
    message = str(info.value)
    assert "training.pt" in message and "is not a TaskpointState bundle" in message
    assert "['epoch', 'model', 'opt']" in message and "no 'layout' entry" in message


def test_bytes_checkpoint_cannot_be_loaded(checkpoint: taskpoint.Checkpoint) -> None:
    checkpoint.save_sync(b"42")
    with pytest.raises(StateLayoutError, match=r"cannot load .*checkpoint\.bin' with torch\.load\(weights_only=True\) \(UnpicklingError") as info:
        TaskpointState(_mlp()).restore_sync(checkpoint)
    assert info.value.__cause__ is not None


def test_directory_checkpoint(checkpoint: taskpoint.Checkpoint, tmp_path: Path) -> None:
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "notes.txt").write_text("hi")
    checkpoint.save_sync(empty)
    with pytest.raises(StateLayoutError, match=r"directory without 'state.pt'"):
        TaskpointState(_mlp()).restore_sync(checkpoint)

    # A directory that holds a bundle as state.pt (beside other files) restores.
    model = _mlp()
    TaskpointState(model).save_sync(checkpoint, epoch=5)
    bundle = checkpoint.load_sync()
    assert bundle is not None
    shutil.copy(bundle / "state.pt", empty / "state.pt")
    checkpoint.save_sync(empty)
    resume = TaskpointState(_mlp()).restore_sync(checkpoint)
    assert resume is not None and resume.epoch == 5


def _rewrite(checkpoint: taskpoint.Checkpoint, tmp_path: Path, **changes: object) -> None:
    path = checkpoint.load_sync()
    assert path is not None
    bundle = torch.load(path / "state.pt", weights_only=True)
    bundle.update(changes)
    target = tmp_path / "state.pt"
    torch.save(bundle, target)
    checkpoint.save_sync(target)


def test_newer_layout_version_says_upgrade(checkpoint: taskpoint.Checkpoint, tmp_path: Path) -> None:
    model = _mlp()
    TaskpointState(model).save_sync(checkpoint)
    _rewrite(checkpoint, tmp_path, version=2)
    with pytest.raises(StateLayoutError, match=r"version 2; .* reads versions 1 to 1: upgrade"):
        TaskpointState(model).restore_sync(checkpoint)


def test_other_layout_tag(checkpoint: taskpoint.Checkpoint, tmp_path: Path) -> None:
    model = _mlp()
    TaskpointState(model).save_sync(checkpoint)
    _rewrite(checkpoint, tmp_path, layout="someone-else/state")
    with pytest.raises(StateLayoutError) as info:
        TaskpointState(model).restore_sync(checkpoint)
    assert "'someone-else/state'" in str(info.value) and repr(LAYOUT) in str(info.value)


def test_bundle_missing_entries_is_a_layout_error(
    checkpoint: taskpoint.Checkpoint, tmp_path: Path
) -> None:
    model = _mlp()
    TaskpointState(model).save_sync(checkpoint)
    path = checkpoint.load_sync()
    assert path is not None
    bundle = torch.load(path / "state.pt", weights_only=True)
    del bundle["save_id"], bundle["optimizers"]
    torch.save(bundle, tmp_path / "state.pt")
    checkpoint.save_sync(tmp_path / "state.pt")
    with pytest.raises(StateLayoutError, match=r"damaged .* lacks the entries \['optimizers', 'save_id'\]"):
        TaskpointState(model).restore_sync(checkpoint)


def test_other_components_are_a_layout_error(checkpoint: taskpoint.Checkpoint) -> None:
    gen, disc = _mlp(), _mlp()
    opt = torch.optim.Adam(gen.parameters())
    TaskpointState({"gen": gen, "disc": disc}, {"gen": opt}).save_sync(checkpoint)
    with pytest.raises(StateLayoutError) as info:
        TaskpointState(gen).restore_sync(checkpoint)
    message = str(info.value)
    assert "models: checkpoint has ['disc', 'gen'], this state has ['model']" in message
    assert "optimizers: checkpoint has ['gen'], this state has []" in message
    assert "schedulers" not in message


def test_model_shape_and_key_mismatch_names_the_keys(checkpoint: taskpoint.Checkpoint) -> None:
    TaskpointState(_mlp(hidden=8)).save_sync(checkpoint)
    other = _mlp(hidden=16, extra_layer=True)
    before = _params(other)
    with pytest.raises(StateMismatchError) as info:
        TaskpointState(other).restore_sync(checkpoint)
    err = info.value
    assert err.component == "models['model']"
    assert err.missing == ["3.bias", "3.weight"]
    assert err.unexpected == []
    assert err.shapes == {
        "0.bias": ((8,), (16,)),
        "0.weight": ((8, 4), (16, 4)),
        "2.weight": ((1, 8), (1, 16)),
    }
    message = str(err)
    assert "models['model'] does not match the checkpoint" in message
    assert "in the model but not the checkpoint: ['3.bias', '3.weight']" in message
    assert "'0.weight' saved (8, 4) vs model (16, 4)" in message
    assert _unchanged(other, before)


def test_renamed_keys_are_listed_both_ways(checkpoint: taskpoint.Checkpoint) -> None:
    class Named(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.add_module(name, nn.Linear(2, 2))

    TaskpointState(Named("encoder")).save_sync(checkpoint)
    with pytest.raises(StateMismatchError) as info:
        TaskpointState(Named("backbone")).restore_sync(checkpoint)
    assert info.value.missing == ["backbone.bias", "backbone.weight"]
    assert info.value.unexpected == ["encoder.bias", "encoder.weight"]
    assert "in the checkpoint but not the model: ['encoder.bias', 'encoder.weight']" in str(info.value)


def test_long_key_lists_are_shortened(checkpoint: taskpoint.Checkpoint) -> None:
    TaskpointState(nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])).save_sync(checkpoint)
    with pytest.raises(StateMismatchError) as info:
        TaskpointState(nn.Sequential(nn.Linear(2, 2))).restore_sync(checkpoint)
    assert len(info.value.unexpected) == 14
    assert "and 4 more]" in str(info.value)


def test_optimizer_group_mismatch_is_checked_before_anything_changes(
    checkpoint: taskpoint.Checkpoint,
) -> None:
    model = _mlp()
    TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1)).save_sync(checkpoint)
    fresh = _mlp()
    before = _params(fresh)
    split = torch.optim.SGD(
        [{"params": fresh[0].parameters()}, {"params": fresh[2].parameters()}], lr=0.1
    )
    with pytest.raises(StateMismatchError, match=r"optimizers\['optimizer'\] has parameter groups of sizes \[2, 2\], the checkpoint's optimizer had \[4\]"):
        TaskpointState(fresh, split).restore_sync(checkpoint)
    assert _unchanged(fresh, before), "the model was not restored either"


def test_scaler_enabled_against_a_disabled_save(checkpoint: taskpoint.Checkpoint) -> None:
    model = _mlp()
    TaskpointState(model, scaler=torch.amp.GradScaler("cpu", enabled=False)).save_sync(checkpoint)
    with pytest.raises(StateMismatchError, match=r"scalers\['scaler'\] is enabled but was saved from a disabled"):
        TaskpointState(model, scaler=torch.amp.GradScaler("cpu")).restore_sync(checkpoint)


def test_bundle_without_rng_restores_with_a_warning(
    checkpoint: taskpoint.Checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    model = _mlp()
    TaskpointState(model, rng=False).save_sync(checkpoint, epoch=1)
    rng = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="taskpoint_pytorch"):
        resume = TaskpointState(model).restore_sync(checkpoint)
    assert resume is not None and resume.epoch == 1
    assert "saved without RNG states" in caplog.text
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"epoch": -1}, ValueError, r"epoch must be a non-negative int; got -1"),
        ({"step": True}, ValueError, r"step must be a non-negative int; got True"),
        ({"step": 1.0}, ValueError, r"step must be a non-negative int; got 1.0"),
        ({"extra": [1, 2]}, TypeError, r"extra must be a mapping"),
        ({"extra": {1: "x"}}, TypeError, r"extra keys must be strings; got 1"),
    ],
)
def test_bad_save_arguments_commit_nothing(
    checkpoint: taskpoint.Checkpoint, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TaskpointState(_mlp()).save_sync(checkpoint, **kwargs)  # type: ignore[arg-type]
    assert checkpoint.committed() == []


def test_checkpoint_must_be_checkpoint_like() -> None:
    state = TaskpointState(_mlp())
    with pytest.raises(TypeError, match=r"got NoneType \(taskpoint.ctx\(\).checkpoint is None"):
        state.save_sync(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"save_sync, load and load_sync .*; got str"):
        state.restore_sync("s3://bucket/x")  # type: ignore[arg-type]


def test_store_errors_pass_through(tmp_path: Path) -> None:
    class Broken:
        def save_sync(self, data: object) -> None:
            raise taskpoint.CheckpointStoreError("store down", url="s3://x")

        async def save(self, data: object) -> None:
            raise AssertionError

        def load_sync(self) -> None:
            raise taskpoint.CheckpointStoreError("store down", url="s3://x")

        async def load(self) -> None:
            raise AssertionError

    state = TaskpointState(_mlp())
    with pytest.raises(taskpoint.CheckpointStoreError, match="store down"):
        state.save_sync(Broken())
    with pytest.raises(taskpoint.CheckpointStoreError, match="store down"):
        state.restore_sync(Broken())


def test_errors_are_checkpoint_errors() -> None:
    assert issubclass(StateLayoutError, StateError)
    assert issubclass(StateMismatchError, StateError)
    assert issubclass(StateError, taskpoint.CheckpointError)
