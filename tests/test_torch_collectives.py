"""The rank helpers every adapter shares (:mod:`taskpoint.distributed.torch_collectives`),
in one process: without a process group each is the one-rank case, and a gather-or-raise
raises this rank's own error, or the caller's error type naming the rank that failed.
Several ranks run them through the adapters' torchrun tests."""

from __future__ import annotations

import pytest
import taskpoint
from taskpoint import distributed
from taskpoint.distributed import Ranks


class AdapterError(taskpoint.CheckpointError):
    """Stands for an adapter's own error type (``taskpoint_pytorch.StateError``)."""


def test_without_a_process_group_ranks_come_from_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.current_ranks() == Ranks(0, 0, 1, False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed.current_ranks() == Ranks(3, 3, 4, False)  # local rank: the rank
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "four")  # not a number: one process
    assert distributed.current_ranks() == Ranks(3, 1, 1, False)
    # no group: no collective reaches the others, so this process is alone
    assert distributed.rank_and_size() == (0, 1)
    assert distributed.is_distributed() is False


def test_without_a_process_group_collectives_are_the_one_rank_case() -> None:
    distributed.barrier()
    assert distributed.all_gather_object({"a": 1}) == [{"a": 1}]
    assert distributed.broadcast_from_zero("x") == "x"
    assert distributed.gather_or_raise(5, None, "agree") == [5]


def test_gather_or_raise_raises_this_rank_s_own_error() -> None:
    own = ValueError("bad extra")
    with pytest.raises(ValueError, match="bad extra") as caught:
        distributed.gather_or_raise(None, own, "save the state")
    assert caught.value is own


def test_another_rank_s_failure_is_named_in_the_caller_s_error_type() -> None:
    messages = [None, None, "OSError: disk full", "ValueError: x"]
    assert distributed.describe_error(OSError("disk full")) == messages[2]
    assert distributed.describe_error(None) is None
    with pytest.raises(taskpoint.CheckpointCoordinationError) as caught:
        distributed.raise_first_failure(None, messages, "save the state")
    assert str(caught.value) == (
        "cannot save the state: rank 2 failed (OSError: disk full), so every rank stops"
    )
    assert caught.value.ranks == [2]
    with pytest.raises(AdapterError, match=r"^cannot restore: rank 2 failed \(OSError"):
        distributed.raise_first_failure(None, messages, "restore", failure=AdapterError)
    distributed.raise_first_failure(None, [None, None], "save")  # no failure: returns
