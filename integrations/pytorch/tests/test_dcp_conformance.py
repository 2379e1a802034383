"""``TaskpointStorageWriter``/``TaskpointStorageReader`` behave as DCP's file-system pair does.

Each test holds one behaviour ``dcp.save``/``dcp.load`` show with ``FileSystemWriter`` and
``FileSystemReader`` (PyTorch's own tests check them; ``upstream/dcp_swap.py`` runs those
with the taskpoint classes swapped in). The one-process tests run against every store kind;
the multi-rank ones run two real torchrun jobs (gloo) against a local store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import torch
import torch.distributed.checkpoint as dcp
from taskpoint_pytorch import TaskpointStorageReader, TaskpointStorageWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

WORKER = Path(__file__).parent / "tp_torch_dcp_worker.py"
GLOBAL = torch.arange(24, dtype=torch.float32).reshape(4, 6)  # as in the worker
PLAIN = torch.linspace(-1.0, 1.0, 5)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(url: str, state: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=TaskpointStorageWriter(taskpoint.Checkpoint(url)))


def _load(url: str, state: dict[str, Any]) -> None:
    dcp.load(state, storage_reader=TaskpointStorageReader(taskpoint.Checkpoint(url)))


def test_an_empty_state_dict_saves_and_loads(store_url: str) -> None:
    # Nothing to write still writes this rank's (empty) shard file beside .metadata.
    _save(store_url, {})
    _load(store_url, {})
    restored = taskpoint.Checkpoint(store_url).load_sync()
    assert restored is not None
    assert {p.name: p.stat().st_size for p in restored.iterdir() if p.suffix == ".distcp"} == {
        "__0_0.distcp": 0
    }


def test_each_save_records_the_location_and_its_own_save_id(store_url: str) -> None:
    writer = TaskpointStorageWriter(taskpoint.Checkpoint(store_url))
    reader = TaskpointStorageReader(taskpoint.Checkpoint(store_url))
    ids = []
    for value in (1.0, 2.0):  # one writer, two saves, as with FileSystemWriter
        dcp.save({"w": PLAIN * value}, storage_writer=writer)
        meta = reader.read_metadata().storage_meta
        assert meta is not None and meta.checkpoint_id == writer.checkpoint_id
        ids.append(meta.save_id)
        reader.reset()
    assert None not in ids and ids[0] != ids[1]


class _Trainer:
    """A model and its optimizer as one stateful object (``state_dict``/``load_state_dict``)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.model(torch.randn(5, 3)).square().sum().backward()
        self.optimizer.step()
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.loaded += 1


def test_a_stateful_object_loads_in_place(lib: Any, store_url: str) -> None:
    saved = _Trainer(seed=0)
    _save(store_url, {"trainer": saved})
    fresh = _Trainer(seed=1)
    state = {"trainer": fresh}
    _load(store_url, state)
    assert state["trainer"] is fresh and fresh.loaded == 1
    assert lib.bitwise_differences(fresh.model.state_dict(), saved.model.state_dict()) == []
    assert lib.bitwise_differences(
        fresh.optimizer.state_dict(), saved.optimizer.state_dict()
    ) == []


def test_plain_values_load_into_the_state_dict(store_url: str) -> None:
    _save(store_url, {
        "w": GLOBAL, "nested": {"b": PLAIN, "ints": [1, 2, 3]}, "name": "run-7", "step": 12,
    })
    state: dict[str, Any] = {
        "w": torch.zeros_like(GLOBAL), "nested": {"b": torch.zeros_like(PLAIN), "ints": []},
        "name": "", "step": 0,
    }
    tensor = state["w"]
    _load(store_url, state)
    assert state["w"] is tensor and torch.equal(tensor, GLOBAL)  # tensors load in place
    assert torch.equal(state["nested"]["b"], PLAIN)
    assert (state["nested"]["ints"], state["name"], state["step"]) == ([1, 2, 3], "run-7", 12)


def test_a_checkpoint_restored_through_taskpoint_converts_to_and_from_torch_save(
    store_url: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    _save(store_url, {"model": model.state_dict(), "extra": PLAIN})
    restored = taskpoint.Checkpoint(store_url).load_sync(into=tmp_path / "dcp")
    assert restored is not None
    dcp_to_torch_save(restored, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert full.keys() == {"model", "extra"} and torch.equal(full["extra"], PLAIN)
    assert all(torch.equal(full["model"][k], v) for k, v in model.state_dict().items())

    # And back: torch_save_to_dcp's folder loads with DCP's own reader.
    torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "again")
    state = {"model": torch.nn.Linear(6, 3).state_dict(), "extra": torch.zeros_like(PLAIN)}
    dcp.load(state, checkpoint_id=tmp_path / "again")
    assert torch.equal(state["extra"], PLAIN)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


# --- several ranks: real torchrun jobs ---------------------------------------------------


def _torchrun(env: dict[str, str], nproc: int, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
         f"--nproc_per_node={nproc}", "--monitor-interval=0.2", str(WORKER), *args],
        env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, child_env: dict[str, str]) -> Path:
    """Two ranks save (and load); then one rank loads what they saved. Returns the folder."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp("dcp-ranks")
    url = f"file://{out / 'store'}"
    _torchrun(child_env, 2, "save", url, str(out))
    _torchrun(child_env, 1, "load", url, str(out))
    return out


def _seen(out: Path, mode: str, world: int, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{mode}-{world}-rank{rank}.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_save_where_a_rank_has_no_shards_commits_and_loads(ranks: Path) -> None:
    for rank in (0, 1):
        seen = _seen(ranks, "save", 2, rank)
        assert seen["replicated-save"] == "ok"
        assert seen["replicated-load"] == {"a": (PLAIN * 2).tolist()}
    restored = taskpoint.Checkpoint(f"file://{ranks / 'store'}-replicated").load_sync()
    assert restored is not None
    sizes = {p.name: p.stat().st_size for p in restored.iterdir() if p.suffix == ".distcp"}
    # One tensor held alike by both ranks: one rank writes it, the other an empty file.
    assert sizes.keys() == {"__0_0.distcp", "__1_0.distcp"}
    assert sorted(size == 0 for size in sizes.values()) == [False, True]


@pytest.mark.slow
def test_dtensors_saved_sharded_reshard_on_load_on_the_same_ranks(ranks: Path) -> None:
    for rank in (0, 1):
        seen = _seen(ranks, "save", 2, rank)
        assert seen["save"] == "ok"
        for placement in ("replicate", "shard1"):
            assert seen[placement] == {"dtensor": GLOBAL.tolist(), "plain": PLAIN.tolist()}


@pytest.mark.slow
def test_dtensors_saved_by_two_ranks_load_on_one(ranks: Path) -> None:
    seen = _seen(ranks, "load", 1, 0)
    for placement in ("replicate", "shard1", "tensor"):
        assert seen[placement] == {"dtensor": GLOBAL.tolist(), "plain": PLAIN.tolist()}
