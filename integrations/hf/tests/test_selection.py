"""What each node restores of a checkpoint saved by several nodes without a shared disk
(issue #26): its ranks' own files and everything shared, never less than a rank reads.

Real processes: ``torchrun`` with gloo ranks on the CPU, each rank a "node" with its own
``output_dir`` (``taskpoint_hf_dcp_child.py``), a real ``dcp.save`` and ``dcp.load``. The
race with a newer commit runs in-process: two threads commit as two ranks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import taskpoint
from taskpoint_hf import _selection
from torch.distributed.checkpoint import FileSystemReader

CHILD = Path(__file__).with_name("taskpoint_hf_dcp_child.py")

SHARDED = {"weight", "exp_avg"}
"""The child's items stored as one chunk per rank; the others are replicated."""


def _torchrun(root: Path, store: str, ranks: int, *extra: str) -> list[dict[str, Any]]:
    """Every rank's result (see the child's docstring); fails the test on a crash."""
    results = root / "results"
    shutil.rmtree(results, ignore_errors=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", str(CHILD), "--store", store, "--root", str(root), *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    found = [results / f"{'save' if '--save' in extra else 'restore'}-rank{r}.json"
             for r in range(ranks)]
    assert all(p.exists() for p in found), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(p.read_text()) for p in found]


def _saved(root: Path, ranks: int) -> str:
    store = f"file://{root / 'store'}"
    saved = _torchrun(root, store, ranks, "--save")
    assert saved == [{}] * ranks, saved
    for rank in range(ranks):  # the nodes' disks are gone: a fresh machine each
        shutil.rmtree(root / f"node{rank}")
    return store


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A checkpoint two nodes saved: its root folder and store URL."""
    root = tmp_path_factory.mktemp("two-nodes")
    return root, _saved(root, 2)


def _whole(store: str, scratch: Path) -> tuple[list[str], dict[str, dict[str, set[str]]]]:
    """The newest checkpoint's files, and for each DCP folder which items each file holds."""
    tree = taskpoint.Checkpoint(store).load_sync(into=scratch)
    assert tree is not None
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    holds: dict[str, dict[str, set[str]]] = {}
    for meta in tree.rglob(".metadata"):
        storage = FileSystemReader(str(meta.parent)).read_metadata().storage_data
        folder = meta.parent.relative_to(tree).as_posix()
        holds[folder] = {}
        for index, info in storage.items():
            holds[folder].setdefault(info.relative_path, set()).add(index.fqn)
    return files, holds


@pytest.mark.slow
def test_each_node_restores_what_its_ranks_read_and_dcp_loads(
    two_nodes: tuple[Path, str], tmp_path: Path
) -> None:
    root, store = two_nodes
    files, holds = _whole(store, tmp_path / "whole")
    restored = _torchrun(root, store, 2, "--restore")
    assert all("error" not in r for r in restored), restored  # dcp.load checked every value

    own_only = set()  # files holding nothing but their writer's shards
    for folder, by_file in holds.items():
        own_only |= {f"{folder}/{name}" for name, fqns in by_file.items() if fqns <= SHARDED}
    for node, result in enumerate(restored):
        other = 1 - node
        wanted = [
            p for p in files
            if not p.endswith(f"/rng_state_{other}.pth")
            and not (p in own_only and p.rpartition("/")[2].startswith(f"__{other}_"))
        ]
        assert result["files"] == wanted, node
        assert f"checkpoint-4/optimizer_0/__{other}_0.distcp" not in result["files"]
    # the planner put the replicated items in one rank's model file: both nodes have it
    shared = [
        f"checkpoint-4/pytorch_model_fsdp_0/{name}"
        for name, fqns in holds["checkpoint-4/pytorch_model_fsdp_0"].items()
        if fqns - SHARDED
    ]
    assert shared, holds
    for result in restored:
        assert set(shared) <= set(result["files"])
        assert {"checkpoint-4/trainer_state.json", "checkpoint-4/config.json"} <= set(
            result["files"]
        )


@pytest.mark.slow
def test_another_systems_checkpoint_restores_whole_on_every_node(
    two_nodes: tuple[Path, str], tmp_path: Path
) -> None:
    root, store = two_nodes
    for rank in (0, 1):
        shutil.rmtree(root / f"node{rank}", ignore_errors=True)
    files, _ = _whole(store, tmp_path / "whole")
    restored = _torchrun(root, store, 2, "--restore", "--flyte-like")
    assert all("error" not in r for r in restored), restored
    assert [r["files"] for r in restored] == [files, files]
    assert {"checkpoint-4/rng_state_0.pth", "checkpoint-4/rng_state_1.pth"} <= set(files)


@pytest.mark.slow
def test_a_job_of_another_size_restores_whole_and_reshards(tmp_path: Path) -> None:
    store = _saved(tmp_path, 3)
    files, _ = _whole(store, tmp_path / "whole")
    assert "checkpoint-4/optimizer_0/__2_0.distcp" in files
    restored = _torchrun(tmp_path, store, 2, "--restore")  # 3 ranks saved, 2 restore
    assert all("error" not in r for r in restored), restored  # dcp.load resharded 3 to 2
    assert [r["files"] for r in restored] == [files, files]


def _commit(root: Path, url: str, files: dict[int, dict[str, str]]) -> None:
    """Two ranks (threads, each with its own folder) commit ``files[rank]`` as one checkpoint."""
    session = uuid.uuid4().hex[:12]

    def one(rank: int) -> None:
        folder = root / uuid.uuid4().hex / "out"
        for name, text in files[rank].items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        coordinator = taskpoint.StoreCoordinator(
            str(root / "meet"), rank=rank, world_size=2, session=session, timeout=20, poll=0.02
        )
        taskpoint.Checkpoint(url).save_part_sync(folder, coordinator=coordinator)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(one, (0, 1)))


class _Racing(taskpoint.Checkpoint):
    """A checkpoint another job commits to right after the selection was made."""

    newer: dict[int, dict[str, str]]
    root: Path

    def load_sync(self, **kwargs: Any) -> Path | None:  # type: ignore[override]
        if kwargs.get("paths") is not None and getattr(self, "newer", None):
            newer, self.newer = self.newer, {}
            _commit(self.root, self.url, newer)
        return super().load_sync(**kwargs)


@pytest.mark.parametrize("newer_holds_the_paths", [True, False], ids=["same_paths", "others"])
def test_a_commit_racing_the_selection_restores_the_newest_whole(
    tmp_path: Path, newer_holds_the_paths: bool
) -> None:
    url = f"file://{tmp_path / 'store'}"
    _commit(tmp_path, url, {
        0: {"checkpoint-2/trainer_state.json": "{}", "checkpoint-2/rng_state_0.pth": "a0"},
        1: {"checkpoint-2/rng_state_1.pth": "a1"},
    })
    name = "checkpoint-2" if newer_holds_the_paths else "checkpoint-4"
    newer = {
        0: {f"{name}/trainer_state.json": "{}", f"{name}/rng_state_0.pth": "b0",
            f"{name}/model.bin": "m"},
        1: {f"{name}/rng_state_1.pth": "b1"},
    }
    racing = _Racing(url)
    racing.root, racing.newer = tmp_path, newer
    selection = _selection.select(racing, ranks=(1,), world_size=2)
    assert selection is not None
    assert selection.left_out == ("checkpoint-2/rng_state_0.pth",)

    tree = _selection.load(racing, ranks=(1,), world_size=2)

    assert racing.newer == {}, "the newer checkpoint was committed during the load"
    assert tree is not None
    got = {p.relative_to(tree).as_posix(): p.read_text() for p in tree.rglob("*") if p.is_file()}
    assert got == {**newer[0], **newer[1]}  # the newest, whole: never a mix of the two
