"""``TaskpointSklearnCheckpoint`` on Flyte's own checkpoint: a real local Flyte run with
retries resumes the ``partial_fit`` loop from the previous attempt's last chunk and ends
bitwise where an uninterrupted run does (sync and async tasks)."""

from __future__ import annotations

import datetime
from pathlib import Path
from types import ModuleType

import flyte
import numpy as np
import pytest
import taskpoint
from taskpoint_sklearn import PartialFitBundle, TaskpointSklearnCheckpoint

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = flyte.Backoff(base=datetime.timedelta(0))




FAIL_AT = (2, 4)
"""Attempt n fails at chunk FAIL_AT[n], after training on it and before saving it."""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_flyte_retries_resume_exactly(
    cases: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.chdir(tmp_path)
    case = cases.CASES["SGDClassifier"]
    env = flyte.TaskEnvironment(name=f"tp_sklearn_flyte_{mode}")
    retries = flyte.RetryStrategy(count=len(FAIL_AT), backoff=NO_WAIT)
    starts: list[int] = []
    bundles: list[PartialFitBundle] = []
    kinds: list[bool] = []

    def step(bundle: PartialFitBundle, i: int) -> None:
        cases.train_chunk(case, bundle.estimator, bundle.rng)
        attempt = len(starts) - 1
        if attempt < len(FAIL_AT) and i == FAIL_AT[attempt]:
            raise RuntimeError(f"simulated failure at chunk {i}")
        bundle.progress = i + 1

    if mode == "sync":

        @env.task(retries=retries)
        def train() -> int:
            flyte_ckpt = flyte.ctx().checkpoint
            kinds.append(isinstance(flyte_ckpt, taskpoint.Checkpoint))
            ckpt = TaskpointSklearnCheckpoint(flyte_ckpt)
            bundle = ckpt.resume_sync(case.make(), rng=np.random.default_rng(0))
            starts.append(bundle.progress)
            for i in range(bundle.progress, cases.N_CHUNKS):
                step(bundle, i)
                ckpt.save_sync(bundle)
            bundles.append(bundle)
            return bundle.progress

        task: object = train
    else:

        @env.task(retries=retries)
        async def atrain() -> int:
            flyte_ckpt = flyte.ctx().checkpoint
            kinds.append(isinstance(flyte_ckpt, taskpoint.Checkpoint))
            ckpt = TaskpointSklearnCheckpoint(flyte_ckpt)
            bundle = await ckpt.resume(case.make(), rng=np.random.default_rng(0))
            starts.append(bundle.progress)
            for i in range(bundle.progress, cases.N_CHUNKS):
                step(bundle, i)
                await ckpt.save(bundle)
            bundles.append(bundle)
            return bundle.progress

        task = atrain

    flyte.init()
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "flyte-raw")).run(task)

    assert run.outputs()[0] == cases.N_CHUNKS
    assert kinds == [False, False, False], "the checkpoint was Flyte's, not taskpoint's"
    assert starts == [0, *FAIL_AT], "each retry resumed where the previous attempt saved last"
    (bundle,) = bundles
    cases.assert_same_fit(case, bundle.estimator, cases.uninterrupted(case))
    reference_rng = np.random.default_rng(0)
    for _ in range(cases.N_CHUNKS):
        case.chunk(reference_rng)
    assert bundle.rng is not None
    assert bundle.rng.bit_generator.state == reference_rng.bit_generator.state
