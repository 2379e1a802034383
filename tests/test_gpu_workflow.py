"""The GPU workflow runs every ``gpu``-marked test of the workspace, and nothing else skips them.

No CUDA runner runs on every change, so what the workflow selects is checked here: a gpu
test added where ``.github/workflows/gpu.yml`` does not look would never run anywhere.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "gpu.yml"
UNSLOTH_SCRIPT = REPO / "integrations" / "unsloth" / "scripts" / "gpu-tests.sh"
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def _gpu_test_files() -> list[Path]:
    return sorted(
        path.relative_to(REPO)
        for root in (REPO / "tests", REPO / "integrations")
        for path in root.rglob("test_*.py")
        if ".venv" not in path.parts and GPU_MARK.search(path.read_text())
    )


def _steps(job: str) -> list[str]:
    """The ``run:`` commands of ``job`` (one line, or a folded ``>-`` block joined)."""
    runs: list[str] = []
    in_job = folding = False
    for line in WORKFLOW.read_text().splitlines():
        if re.match(r"^  \S", line):  # a job's name, under jobs:
            in_job = line.strip() == f"{job}:"
            folding = False
            continue
        if not in_job:
            continue
        found = re.match(r"^\s+(?:- )?run: ?(.*)$", line)
        if found:
            folding = found.group(1) in (">-", ">", "|")
            runs.append("" if folding else found.group(1))
        elif folding and line.startswith(" " * 10):
            runs[-1] = f"{runs[-1]} {line.strip()}".strip()
        else:
            folding = False
    return runs


def _pytest_commands(job: str) -> list[list[str]]:
    return [
        words[words.index("pytest") + 1 :]
        for run in _steps(job)
        for words in [shlex.split(run)]
        if "pytest" in words
    ]


def test_the_workspace_job_selects_every_gpu_test_outside_unsloth() -> None:
    (args,) = _pytest_commands("workspace-gpu")
    assert args[:2] == ["-m", "gpu"]
    paths = [a for a in args[2:] if not a.startswith("-")]
    ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
    assert ignored == ["integrations/unsloth"]  # run in its own environment, below
    for test in _gpu_test_files():
        if test.parts[:2] == ("integrations", "unsloth"):
            continue
        assert any(test.is_relative_to(p) for p in paths), f"{test} is not selected"


def test_the_unsloth_job_runs_the_unsloth_gpu_tests() -> None:
    assert any("gpu-tests.sh" in run for run in _steps("unsloth-gpu"))
    script = UNSLOTH_SCRIPT.read_text()
    assert "marker=(-m gpu)" in script and 'pytest "$project/tests" "${marker[@]}"' in script
    assert any(t.parts[:2] == ("integrations", "unsloth") for t in _gpu_test_files())


def test_the_cuda_paths_have_gpu_tests() -> None:
    """Pinned-memory snapshots and CUDA random state, in the adapters that have them."""
    text = {t: (REPO / t).read_text() for t in _gpu_test_files()}
    pytorch = Path("integrations/pytorch/tests/test_gpu.py")
    assert "pin" in text[pytorch] and "cuda" in text[pytorch].lower()
    assert "test_a_background_save_keeps_the_cuda_rng_state_of_the_call" in text[pytorch]
    assert "test_cuda_random_state_resumes_exactly" in text[
        Path("integrations/lightning/tests/test_resume_exact.py")
    ]
