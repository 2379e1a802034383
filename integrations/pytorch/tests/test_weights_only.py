"""A bundle holding every supported kind of state loads with ``weights_only=True``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import taskpoint
import torch
from taskpoint_pytorch import STATE_FILE, TaskpointState
from torch import nn

# What is checked is the bundle's pickle, the same bytes on every store: the file store and
# one object store are enough.
pytestmark = pytest.mark.stores("file", "s3")

EXTRA: dict[str, Any] = {
    "tensor": torch.arange(6, dtype=torch.float64).reshape(2, 3),
    "int_tensor": torch.tensor([1, 2, 3], dtype=torch.int32),
    "bool_tensor": torch.tensor([True, False]),
    "bf16": torch.ones(2, dtype=torch.bfloat16),
    "scalar_tensor": torch.tensor(3.5),
    "int": 7,
    "big_int": 2**80,
    "float": 0.125,
    "nan": float("inf"),
    "complex": 1 + 2j,
    "bool": True,
    "none": None,
    "str": "héllo",
    "bytes": b"\x00\xffraw",
    "bytearray": bytearray(b"abc"),
    "list": [1, "two", 3.0, [torch.zeros(1)]],
    "tuple": (1, (2, "three")),
    "set": {1, 2, 3},
    "nested": {"a": {"b": [torch.ones(2), {"c": "deep"}]}, 5: "int key"},
    "size": torch.Size([2, 3]),
    "dtype": torch.float16,
    "device": torch.device("cpu"),
}


class WithExtraState(nn.Module):
    """A module whose ``get_extra_state`` adds non-tensor entries to its state dict."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)  # buffers, including the int64 num_batches_tracked
        self.linear = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(self.norm(x))

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "tag": "v1"}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def _everything(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    first, second = WithExtraState(), nn.Linear(4, 4)
    sgd = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.AdamW(second.parameters(), lr=0.01)
    adam_b = torch.optim.Adam(second.parameters(), lr=0.02)
    adam_b_seq = torch.optim.lr_scheduler.SequentialLR(
        adam_b,
        [torch.optim.lr_scheduler.LinearLR(adam_b), torch.optim.lr_scheduler.ExponentialLR(adam_b, 0.9)],
        milestones=[2],
    )
    return {
        "model": {"first": first, "second": second},
        "optimizer": {"sgd": sgd, "adamw": adam, "adam": adam_b},
        "scheduler": {
            "step": torch.optim.lr_scheduler.StepLR(sgd, step_size=2),
            "onecycle": torch.optim.lr_scheduler.OneCycleLR(adam, max_lr=0.1, total_steps=50),
            "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(sgd),
            "sequential": adam_b_seq,
        },
        "scaler": {"amp": torch.amp.GradScaler("cpu", growth_interval=1)},
        "generators": {"loader": torch.Generator().manual_seed(seed + 1)},
    }


def _train(objs: dict[str, Any], steps: int) -> None:
    first, second = objs["model"]["first"], objs["model"]["second"]
    scaler = objs["scaler"]["amp"]
    for _ in range(steps):
        x = torch.randn(8, 4, generator=objs["generators"]["loader"])
        loss = first(x).pow(2).mean() + second(x).pow(2).mean()
        for opt in objs["optimizer"].values():
            opt.zero_grad()
        scaler.scale(loss).backward()
        for opt in objs["optimizer"].values():
            scaler.step(opt)
        scaler.update()
        for name, sched in objs["scheduler"].items():
            sched.step(loss.item()) if name == "plateau" else sched.step()


def _states(objs: dict[str, Any]) -> dict[str, Any]:
    return {
        kind: {
            name: (o.get_state() if isinstance(o, torch.Generator) else o.state_dict())
            for name, o in group.items()
        }
        for kind, group in objs.items()
    }


def test_bundle_with_every_kind_of_state_loads_weights_only(lib: Any, store_url: str) -> None:
    objs = _everything(seed=0)
    _train(objs, steps=3)
    random.seed(5)
    random.gauss(0, 1)  # a cached Gaussian is part of Python's state
    np.random.seed(5)
    np.random.normal(size=3)  # and of NumPy's
    state = TaskpointState(**objs)
    checkpoint = taskpoint.Checkpoint(store_url)
    state.save_sync(checkpoint, epoch=4, step=12, extra=EXTRA)
    rng_at_save = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    saved = _states(objs)

    restored = checkpoint.load_sync()
    assert restored is not None and [p.name for p in restored.iterdir()] == [STATE_FILE]
    path = restored / STATE_FILE
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    bundle = torch.load(path, weights_only=True)  # the test: no error
    assert set(bundle["models"]) == {"first", "second"}
    assert bundle["models"]["first"]["_extra_state"] == {"calls": 3, "tag": "v1"}
    assert bundle["rng"][0]["numpy"]["has_gauss"] == 1
    assert bundle["rng"][0]["python"]["gauss_next"] is not None

    # Restore into fresh objects after the RNGs moved on: everything comes back.
    fresh = _everything(seed=99)
    random.random()
    np.random.normal(size=5)
    torch.rand(3)
    resume = TaskpointState(**fresh).restore_sync(checkpoint)
    assert resume is not None and (resume.epoch, resume.step) == (4, 12)
    assert lib.bitwise_differences(_states(fresh), saved) == []
    assert fresh["model"]["first"].calls == 3
    assert random.getstate() == rng_at_save[0]
    np_state, np_saved = np.random.get_state(), rng_at_save[1]
    assert np_state[0] == np_saved[0] and np.array_equal(np_state[1], np_saved[1])
    assert np_state[2:] == np_saved[2:]
    assert torch.equal(torch.get_rng_state(), rng_at_save[2])

    assert lib.bitwise_differences(resume.extra, EXTRA, "extra") == []
    for key in ("tuple", "set", "bytes", "bytearray", "size", "dtype", "device", "complex"):
        assert type(resume.extra[key]) is type(EXTRA[key]), key
    assert resume.extra["nested"][5] == "int key"


@pytest.mark.parametrize(
    ("extra", "where", "kind"),
    [
        ({"loss": np.float64(0.5)}, "extra['loss']", "numpy.float64"),
        ({"arr": np.zeros(3)}, "extra['arr']", "numpy.ndarray"),
        ({"deep": [1, {"x": Path("p")}]}, "extra['deep'][1]['x']", "PosixPath"),
        ({"fn": len}, "extra['fn']", "builtin_function_or_method"),
    ],
)
def test_values_weights_only_cannot_load_are_refused_at_save(
    store_url: str, extra: dict[str, Any], where: str, kind: str
) -> None:
    model = nn.Linear(2, 1)
    checkpoint = taskpoint.Checkpoint(store_url)
    with pytest.raises(TypeError) as info:
        TaskpointState(model).save_sync(checkpoint, extra=extra)
    assert str(info.value).startswith(f"{where} is a ")
    assert kind in str(info.value)
    assert "weights_only=True" in str(info.value)
    assert checkpoint.committed() == []


def test_model_extra_state_that_cannot_load_is_refused(store_url: str) -> None:
    class Odd(nn.Linear):
        def get_extra_state(self) -> Any:
            return object()

        def set_extra_state(self, state: Any) -> None:  # pragma: no cover
            pass

    checkpoint = taskpoint.Checkpoint(store_url)
    with pytest.raises(TypeError, match=r"^models\['model'\]\['_extra_state'\] is a object"):
        TaskpointState(Odd(2, 2)).save_sync(checkpoint)
    assert checkpoint.committed() == []


class Unit:
    """A user type registered with torch.serialization.safe_globals."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_types_registered_as_safe_globals_are_accepted(store_url: str) -> None:
    model = nn.Linear(2, 1)
    checkpoint = taskpoint.Checkpoint(store_url)
    with pytest.raises(TypeError, match="Unit"):
        TaskpointState(model).save_sync(checkpoint, extra={"unit": Unit(3)})
    with torch.serialization.safe_globals([Unit]):
        TaskpointState(model).save_sync(checkpoint, extra={"unit": Unit(3)})
        resume = TaskpointState(model).restore_sync(checkpoint)
    assert resume is not None and resume.extra["unit"].value == 3
