"""CUDA: checkpoints move between devices, every device's RNG state comes back, and a
background save copies the state to pinned memory when it is called."""

from __future__ import annotations

import pytest
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState
from taskpoint_pytorch._bundle import cpu_copy
from torch import nn

pytestmark = pytest.mark.gpu


def _trained(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4, device=device)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _assert_same(model: nn.Module, opt: torch.optim.Optimizer, saved: nn.Module, saved_opt: torch.optim.Optimizer) -> None:
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key
    for index, entry in saved_opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][index][key].cpu(), value.cpu()), key


@pytest.mark.parametrize(("saved_on", "restored_on"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_resumes_on_the_model_current_device(
    store_url: str, saved_on: str, restored_on: str
) -> None:
    model, opt = _trained(saved_on)
    checkpoint = taskpoint.Checkpoint(store_url)
    TaskpointState(model, opt).save_sync(checkpoint, epoch=1, extra={"t": torch.ones(1, device=saved_on)})

    fresh = nn.Linear(4, 3).to(restored_on)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    resume = TaskpointState(fresh, fresh_opt).restore_sync(checkpoint)
    assert resume is not None
    assert resume.extra["t"].device.type == restored_on
    assert all(p.device.type == restored_on for p in fresh.parameters())
    for entry in fresh_opt.state.values():
        assert entry["exp_avg"].device.type == restored_on
    _assert_same(fresh, fresh_opt, model, opt)
    # The restored optimizer keeps working on the new device.
    fresh(torch.randn(2, 4, device=restored_on)).sum().backward()
    fresh_opt.step()


def test_every_cuda_device_rng_state_is_restored(store_url: str) -> None:
    torch.cuda.manual_seed_all(0)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for device in devices:
        torch.rand(7, device=device)
    checkpoint = taskpoint.Checkpoint(store_url)
    TaskpointState(nn.Linear(1, 1).cuda()).save_sync(checkpoint)
    path = checkpoint.load_sync()
    assert path is not None
    assert len(torch.load(path / "state.pt", weights_only=True)["rng"][0]["cuda"]) == len(devices)

    expected = [torch.rand(5, device=device) for device in devices]
    for device in devices:
        torch.rand(11, device=device)
    TaskpointState(nn.Linear(1, 1).cuda()).restore_sync(checkpoint)
    for device, want in zip(devices, expected, strict=True):
        assert torch.equal(torch.rand(5, device=device), want), device


def test_a_background_save_copies_to_pinned_memory_at_the_call(store_url: str) -> None:
    model, opt = _trained("cuda")
    copied, _ = cpu_copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    tensors = [*copied["model"].values()] + [
        v for entry in copied["optimizer"]["state"].values() for v in entry.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    assert tensors and all(t.device.type == "cpu" and t.is_pinned() for t in tensors)

    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    checkpoint = taskpoint.Checkpoint(store_url)
    state = TaskpointState(model, opt, blocking=False)
    state.save_sync(checkpoint, epoch=1)
    for _ in range(3):  # the training tensors change in place while the save uploads
        opt.zero_grad()
        model(torch.randn(5, 4, device="cuda")).pow(2).mean().backward()
        opt.step()
    assert state.wait()

    fresh = nn.Linear(4, 3).cuda()
    resume = TaskpointState(fresh, torch.optim.Adam(fresh.parameters(), lr=0.01)).restore_sync(
        checkpoint
    )
    assert resume is not None and resume.epoch == 1
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key].cpu(), value), key


def test_a_background_save_keeps_the_cuda_rng_state_of_the_call(store_url: str) -> None:
    torch.cuda.manual_seed_all(0)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for device in devices:
        torch.rand(7, device=device)
    checkpoint = taskpoint.Checkpoint(store_url)
    state = TaskpointState(nn.Linear(1, 1).cuda(), blocking=False)
    state.save_sync(checkpoint)
    expected = [torch.rand(5, device=device) for device in devices]  # while it uploads
    assert state.wait()

    TaskpointState(nn.Linear(1, 1).cuda()).restore_sync(checkpoint)
    for device, want in zip(devices, expected, strict=True):
        assert torch.equal(torch.rand(5, device=device), want), device
