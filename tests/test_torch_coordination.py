"""Core shares ``TorchCoordinator`` with every adapter without depending on torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_taskpoint_and_the_torch_coordinator_module_leaves_torch_unimported() -> None:
    code = (
        "import sys, taskpoint, taskpoint.torch_coordination\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_a_process_group_it_says_which_coordinator_to_use() -> None:
    import pytest
    from taskpoint.torch_coordination import TorchCoordinator

    with pytest.raises(RuntimeError, match="StoreCoordinator"):
        TorchCoordinator(timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        TorchCoordinator(timeout=0)
