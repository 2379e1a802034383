"""The public surface: exports, the version check, constructor validation, wrappers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import taskpoint
import taskpoint_pytorch
import torch
from taskpoint_pytorch import STATE_FILE, ResumePoint, TaskpointState, _errors, state
from torch import nn


def test_public_names_are_exported() -> None:
    for module in (state, _errors):
        for name in module.__all__:
            assert name in taskpoint_pytorch.__all__, f"{module.__name__}.{name}"
    for name in taskpoint_pytorch.__all__:
        assert hasattr(taskpoint_pytorch, name), name


@pytest.mark.parametrize("version", ["2.4.0", "2.15.0+cu132", "2.6.0.dev20240901", "2.99.1"])
def test_supported_torch_versions(version: str) -> None:
    assert taskpoint.require_version(
        taskpoint_pytorch.SUPPORTED_TORCH, adapter="taskpoint-pytorch", found=version
    ) == version


@pytest.mark.parametrize("version", ["2.3.1", "1.13.1", "3.0.0", "nightly"])
def test_unsupported_torch_versions_say_what_was_requested(version: str) -> None:
    with pytest.raises(ImportError) as info:
        taskpoint.require_version(
            taskpoint_pytorch.SUPPORTED_TORCH, adapter="taskpoint-pytorch", found=version
        )
    assert f"taskpoint-pytorch requested torch>=2.4,<3 but found torch {version}" in str(info.value)
    assert "pip install 'torch>=2.4,<3'" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": [nn.Linear(1, 1)]}, TypeError, r"model must be a torch.nn.Module \(or pass a mapping of names to them\); got list"),
        ({"model": {"": nn.Linear(1, 1)}}, ValueError, r"model names must be non-empty strings; got ''"),
        ({"model": {"a": "b"}}, TypeError, r"model\['a'\] must be a torch.nn.Module"),
        ({"optimizer": nn.Linear(1, 1)}, TypeError, r"optimizer must be a torch.optim.Optimizer"),
        ({"scheduler": 3}, TypeError, r"scheduler must have state_dict\(\) and load_state_dict\(\)"),
        ({"scaler": object()}, TypeError, r"scaler must be a torch.amp.GradScaler"),
        ({"generators": torch.Generator()}, TypeError, r"generators must be a mapping of names to torch.Generator"),
        ({"generators": {"g": 1}}, TypeError, r"generators\['g'\] must be a torch.Generator"),
    ],
)
def test_constructor_validates_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TaskpointState(**kwargs)


def test_layout_and_repr_name_the_components() -> None:
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    s = TaskpointState(
        {"gen": gen, "disc": disc},
        torch.optim.SGD(gen.parameters(), lr=0.1),
        generators={"loader": torch.Generator()},
        rng=False,
    )
    assert s.layout() == {
        "models": ["disc", "gen"],
        "optimizers": ["optimizer"],
        "schedulers": [],
        "scalers": [],
        "generators": ["loader"],
    }
    assert repr(s).startswith("TaskpointState(models=['disc', 'gen'], optimizers=['optimizer']")
    assert repr(s).endswith("rng=False)")


def test_wrapped_models_save_and_restore_unwrapped(tmp_path: Path) -> None:
    """DataParallel and torch.compile wrappers are unwrapped: keys carry no prefix, and a
    wrapped save restores into a plain model. (One store kind only: torch.compile is slow
    to import.)"""
    torch.manual_seed(1)
    plain = nn.Linear(3, 2)
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path}")
    TaskpointState(nn.DataParallel(plain)).save_sync(checkpoint, epoch=1)
    path = checkpoint.load_sync()
    assert path is not None
    bundle = torch.load(path / STATE_FILE, weights_only=True)
    assert set(bundle["models"]["model"]) == {"weight", "bias"}

    fresh = nn.Linear(3, 2)
    TaskpointState(torch.compile(fresh)).restore_sync(checkpoint)
    assert torch.equal(fresh.weight, plain.weight) and torch.equal(fresh.bias, plain.bias)


def test_user_generators_are_restored(store_url: str) -> None:
    gen = torch.Generator().manual_seed(3)
    torch.rand(4, generator=gen)
    checkpoint = taskpoint.Checkpoint(store_url)
    s = TaskpointState(generators={"loader": gen}, rng=False)
    s.save_sync(checkpoint)
    expected = torch.rand(4, generator=gen)
    torch.rand(10, generator=gen)
    s.restore_sync(checkpoint)
    assert torch.equal(torch.rand(4, generator=gen), expected)


def test_explicit_map_location_and_extra_tensors(store_url: str) -> None:
    model = nn.Linear(2, 2)
    checkpoint = taskpoint.Checkpoint(store_url)
    TaskpointState(model).save_sync(checkpoint, extra={"ema": torch.ones(2)})
    resume = TaskpointState(model).restore_sync(checkpoint, map_location="cpu")
    assert isinstance(resume, ResumePoint) and (resume.epoch, resume.step) == (0, 0)
    assert resume.extra["ema"].device == torch.device("cpu")
    assert torch.equal(resume.extra["ema"], torch.ones(2))


async def test_async_save_and_restore(store_url: str) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    checkpoint = taskpoint.Checkpoint(store_url)
    await TaskpointState(model, opt).save(checkpoint, epoch=7, step=70)
    fresh = nn.Linear(2, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    resume = await TaskpointState(fresh, fresh_opt).restore(checkpoint)
    assert resume is not None and (resume.epoch, resume.step) == (7, 70)
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.stores("file", "s3")  # the chunking is the store's, the same on every store
@pytest.mark.parametrize("background", [False, True])
def test_a_save_uploads_only_the_chunks_that_changed(store_url: str, background: bool) -> None:
    """The bundle is stored as a folder kept by content: with 1 of 10 weight tensors of
    1 MiB changed, the next save sends about a tenth of the state, not all of it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(10)])
    checkpoint = taskpoint.Checkpoint(store_url, keep=2)
    stats: list[taskpoint.SaveStats] = []
    checkpoint.on_commit(stats.append)
    state = TaskpointState(model, rng=False, blocking=not background)
    state.save_sync(checkpoint, step=1)
    state.wait()  # else the second save may replace the first still waiting (coalesced)
    with torch.no_grad():
        model[3].weight.add_(1.0)
    state.save_sync(checkpoint, step=2)
    state.wait()
    first, second = stats
    assert first.uploaded >= 10 * 2**20 and first.kind == "directory"
    assert second.uploaded < 0.25 * first.uploaded, (first, second)
    fresh = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(10)])
    TaskpointState(fresh, rng=False).restore_sync(checkpoint)
    assert torch.equal(fresh[3].weight, model[3].weight)
