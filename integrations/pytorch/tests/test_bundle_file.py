"""The bundle file a save writes: ``torch.save``'s format, without the CRC-32 of each zip
record (``torch.load`` never checks it, and the checkpoint's checksums cover the file)."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest
import taskpoint
import torch
from taskpoint_pytorch import TaskpointState
from taskpoint_pytorch._bundle import _write
from torch import nn

pytestmark = pytest.mark.skipif(
    not hasattr(torch.serialization, "set_crc32_options"),
    reason="this torch always writes the CRC-32 (the switch came in 2.6)",
)


def test_the_bundle_is_written_without_crcs_and_loads(tmp_path: Path) -> None:
    bundle = {"w": torch.randn(1000), "step": 3}
    _write(bundle, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(loaded["w"], bundle["w"]) and loaded["step"] == 3
    with zipfile.ZipFile(tmp_path / "state.pt") as zf, pytest.raises(zipfile.BadZipFile, match="CRC"):
        for name in zf.namelist():
            zf.read(name)
    assert torch.serialization.get_crc32_options()  # the process-wide switch is back


def test_the_switch_is_restored_as_it_was_even_when_the_write_fails(tmp_path: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        with pytest.raises(RuntimeError, match="does not exist"):
            _write({"w": torch.zeros(3)}, tmp_path / "missing-folder" / "state.pt")
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.raises(RuntimeError, match="does not exist"):
        _write({"w": torch.zeros(3)}, tmp_path / "missing-folder" / "state.pt")
    assert torch.serialization.get_crc32_options()


def test_saves_from_two_threads_restore_exactly(tmp_path: Path) -> None:
    """Two states saving at once (each its own checkpoint) share the switch safely."""
    def save_and_check(index: int, failures: list[BaseException]) -> None:
        try:
            torch.manual_seed(index)
            model = nn.Linear(64, 64)
            checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / str(index)}")
            state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for step in range(1, 6):
                with torch.no_grad():
                    model.weight.add_(1.0)
                state.save_sync(checkpoint, step=step)
            fresh = nn.Linear(64, 64)
            resume = TaskpointState(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
            assert resume.restore_sync(checkpoint) is not None
            assert torch.equal(fresh.weight, model.weight)
        except BaseException as exc:
            failures.append(exc)

    failures: list[BaseException] = []
    threads = [threading.Thread(target=save_and_check, args=(i, failures)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    assert torch.serialization.get_crc32_options()
