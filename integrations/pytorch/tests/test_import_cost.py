"""What importing the adapter costs a restarted job: every restart pays it before its restore."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_adapter_leaves_dcp_unloaded_until_a_sharded_save_needs_it() -> None:
    # torch.distributed.checkpoint takes seconds to import; a job that saves a plain state
    # bundle must not pay that on every restart, and the DCP names still resolve on use.
    code = (
        "import sys, taskpoint_pytorch\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
        "from taskpoint_pytorch import TaskpointStorageWriter\n"
        "print('torch.distributed.checkpoint' in sys.modules, TaskpointStorageWriter.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "TaskpointStorageWriter"]
