"""A ``Checkpoint`` pickles and deep-copies as its configuration, and copying never leaves a
background save behind."""

from __future__ import annotations

import copy
import pickle
import threading
from pathlib import Path

from taskpoint import Checkpoint, RetryPolicy


def test_a_pickled_checkpoint_equals_the_original_and_saves_as_its_attempt(
    store_url: str,
) -> None:
    ckpt = Checkpoint(store_url, keep=2, codec="none", retry=RetryPolicy(attempts=2))
    ckpt.save_sync(b"one")

    restored = pickle.loads(pickle.dumps(ckpt))

    assert restored is not ckpt and restored == ckpt and hash(restored) == hash(ckpt)
    assert restored != Checkpoint(store_url, keep=3, codec="none", retry=RetryPolicy(2))
    assert restored.url == ckpt.url and restored.attempt == ckpt.attempt is not None
    restored.save_sync(b"two")
    reader = Checkpoint(store_url)
    assert reader.load_sync().read_bytes() == b"two"  # type: ignore[union-attr]
    assert [(m.attempt, m.seq) for m in reader.committed()] == [(ckpt.attempt, 1), (ckpt.attempt, 0)]


def test_a_deep_copy_has_its_own_background_uploads(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    ckpt = Checkpoint(url)

    twin = copy.deepcopy(ckpt)
    assert twin == ckpt
    twin.save_sync(b"from the copy", background=True)
    twin.wait()

    assert (twin.attempt, ckpt.attempt) == (0, None)  # the copy claimed its attempt alone
    ckpt.wait()  # nothing of the copy's to wait for
    assert Checkpoint(url).load_sync().read_bytes() == b"from the copy"  # type: ignore[union-attr]


def test_copying_waits_for_the_background_save_in_flight(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    gate = threading.Event()
    ckpt = Checkpoint(url, progress=lambda moved: gate.wait(60))  # a thread upload, held
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "weights.bin").write_bytes(b"w" * 1000)
    ckpt.save_sync(tmp_path / "tree", background=True)
    assert Checkpoint(url).committed() == []  # the upload waits at the gate

    opener = threading.Timer(0.2, gate.set)
    opener.start()
    twin = copy.deepcopy(ckpt)
    opener.join()

    assert len(Checkpoint(url).committed()) == 1  # committed before the copy was made
    assert twin.attempt == ckpt.attempt == 0
