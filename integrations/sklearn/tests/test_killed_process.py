"""Training in a real child process that is killed resumes, in a new process, to exactly
the uninterrupted result, for every estimator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

CHILD = Path(__file__).parent / "_child_train.py"


def _run_killed(root: Path, chunk: int, name: str, how: str) -> tuple[int, dict[str, int]]:
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(root), str(chunk), name, how],
        capture_output=True, text=True, timeout=300,
    )
    starts = [line for line in proc.stdout.splitlines() if line.startswith("START ")]
    assert len(starts) == 1, f"child rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(starts[0][len("START "):])


@pytest.mark.slow
def test_killed_processes_resume_every_estimator_exactly(
    cases: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    names = list(cases.CASES)
    killed_at = names.index("MiniBatchKMeans")

    # 1st process: SIGKILLed after training MiniBatchKMeans on chunk 1, before saving it.
    rc, starts = _run_killed(root, 1, "MiniBatchKMeans", "sigkill")
    assert rc == -9
    assert starts == dict.fromkeys(names, 0)
    # 2nd process resumes every estimator from its own checkpoint, then dies by
    # os._exit(137) after training SGDClassifier on chunk 4.
    rc, starts = _run_killed(root, 4, "SGDClassifier", "exit137")
    assert rc == 137
    assert starts == {name: 2 if k < killed_at else 1 for k, name in enumerate(names)}
    # Resume once more, here, and finish.
    capsys.readouterr()
    bundles = cases.train_all(root)
    assert capsys.readouterr().out.startswith("START " + json.dumps(dict.fromkeys(names, 4)))

    for name, case in cases.CASES.items():
        assert bundles[name].progress == cases.N_CHUNKS
        cases.assert_same_fit(case, bundles[name].estimator, cases.uninterrupted(case))
        rng = np.random.default_rng(0)
        for _ in range(cases.N_CHUNKS):
            case.chunk(rng)
        assert bundles[name].rng.bit_generator.state == rng.bit_generator.state, name
