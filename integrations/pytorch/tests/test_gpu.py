"""CUDA: checkpoints move between devices, and every device's RNG state comes back."""

from __future__ import annotations

import pytest
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState
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
    assert len(torch.load(path, weights_only=True)["rng"][0]["cuda"]) == len(devices)

    expected = [torch.rand(5, device=device) for device in devices]
    for device in devices:
        torch.rand(11, device=device)
    TaskpointState(nn.Linear(1, 1).cuda()).restore_sync(checkpoint)
    for device, want in zip(devices, expected, strict=True):
        assert torch.equal(torch.rand(5, device=device), want), device
