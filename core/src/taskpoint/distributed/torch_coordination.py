"""The ranks of a torch job as a taskpoint coordinator, with or without a process group.

In core so that every adapter (``taskpoint_pytorch``, ``taskpoint_hf``,
``taskpoint_lightning``) shares them; torch is imported only when a coordinator is built,
so core never depends on torch (``taskpoint_pytorch`` re-exports :class:`TorchCoordinator`).

* :class:`TorchCoordinator` gathers over the default ``torch.distributed`` process group.
* :class:`TorchrunCoordinator` gathers before any process group exists, through the
  key-value store that torchrun's agent serves for its workers (the store
  ``init_process_group`` itself connects to): so a step that runs before the framework
  starts its process group (restoring the checkpoint the run resumes from) can still fail
  every rank together instead of leaving the others blocked in ``init_process_group``.
* :func:`torch_job_coordinator` picks the one that works now.

Example (every rank, after ``torch.distributed.init_process_group``)::

    import taskpoint
    from taskpoint.distributed.torch_coordination import TorchCoordinator

    coord = TorchCoordinator(timeout=300)          # a collective: every rank makes one
    ckpt = taskpoint.Checkpoint("s3://bucket/jobs/train-42")
    ckpt.save_part_sync(f"/local/rank-{coord.rank}", coordinator=coord)
    coord.close()

Example (every rank, under torchrun, before any process group)::

    from taskpoint.distributed.torch_coordination import torch_job_coordinator

    coord = torch_job_coordinator(timeout=300)   # None when the process runs alone
    if coord is not None:
        try:
            outcomes = coord.all_gather({"ok": True})
        finally:
            coord.close()

:class:`TorchCoordinator` gathers on a gloo group of its own (created with its timeout), so
it works beside an NCCL default group and never waits longer than the timeout: each gather
first passes a ``monitored_barrier``, which names the ranks that did not arrive.

:class:`TorchrunCoordinator` keeps, for round ``n`` of its session ``s``, one JSON record per
rank at ``taskpoint/<TORCHELASTIC_RUN_ID>/<s>/<n>/<rank>`` (``{"rank", "world_size",
"value"}``) in the agent's store; sessions are numbered in each process in the order its
coordinators are built (every rank builds the same ones in the same order). The agent's
store outlives the workers when torchrun restarts them (``--max-restarts``, or a node
joining or leaving), and ``TORCHELASTIC_RESTART_COUNT`` cannot tell the incarnations apart:
each agent counts its own restarts, and an agent that restarts its workers because another
node rejoined does not count it (pytorch/pytorch#135712), so keys carrying it would keep the
ranks of one incarnation apart. Rounds are removed instead: the last rank to read a complete
round removes it, and a rank that gives up waiting removes its own record. A rank killed
while it waits in a round (its node restarted meanwhile) leaves its record behind, which
the next incarnation may take for that rank's, once.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from taskpoint.distributed.coordination import (
    Coordinator,
    RankedCoordinator,
    check_rank,
    check_timeout,
)
from taskpoint.errors import CheckpointCoordinationError

__all__ = ["AnyRank", "TorchCoordinator", "TorchrunCoordinator", "torch_job_coordinator"]

log = logging.getLogger(__name__)

_MISSING_RE = re.compile(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier")
TORCHRUN_PREFIX = "taskpoint"
"""The first component of every key :class:`TorchrunCoordinator` writes to the agent's store."""
_sessions = itertools.count()


def _dist() -> Any:
    """``torch.distributed``, imported on first use (core does not depend on torch)."""
    try:
        return importlib.import_module("torch.distributed")
    except ImportError as exc:
        raise RuntimeError(
            "the torch coordinators need PyTorch: pip install torch, or use "
            "taskpoint.StoreCoordinator"
        ) from exc


def _grouped(dist: Any) -> bool:
    return bool(dist.is_available() and dist.is_initialized())


class TorchCoordinator(RankedCoordinator):
    """A :class:`taskpoint.Coordinator` on the default ``torch.distributed`` process group.

    Constructing one is a collective (it creates a gloo group): every rank must.
    :meth:`close` destroys that group (each rank on its own, once it is done gathering).

    Args:
        timeout: default seconds a gather waits for the other ranks (at the start of a
            save, and after each rank's upload).

    Raises:
        RuntimeError: no process group is initialised (use :class:`TorchrunCoordinator`
            or :class:`taskpoint.StoreCoordinator` then).
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(self, *, timeout: float = 600.0) -> None:
        self._timeout = check_timeout(timeout)
        dist = self._dist = _dist()
        if not _grouped(dist):
            raise RuntimeError(
                "TorchCoordinator needs an initialised torch.distributed process group; "
                "without one, use taskpoint.distributed.torch_coordination.TorchrunCoordinator (under "
                "torchrun) or taskpoint.StoreCoordinator"
            )
        self._rank = int(dist.get_rank())
        self._world = int(dist.get_world_size())
        self._group: Any = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self._timeout)
        ) if self._world > 1 else None
        self._closed = False

    def __repr__(self) -> str:
        return f"TorchCoordinator(rank={self._rank}, world_size={self._world})"

    def close(self) -> None:
        """Destroy this coordinator's gloo group (a local call, not a collective).

        Idempotent; the coordinator cannot gather afterwards. A group whose default
        process group was already destroyed is left alone.
        """
        group, self._group, self._closed = self._group, None, True
        if group is not None and _grouped(self._dist):
            self._dist.destroy_process_group(group)

    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._group is None:
            return [value]
        limit = self._timeout if timeout is None else check_timeout(timeout)
        dist = self._dist
        try:
            dist.monitored_barrier(
                group=self._group, timeout=timedelta(seconds=limit), wait_all_ranks=True
            )
            gathered: list[Any] = [None] * self._world
            dist.all_gather_object(gathered, value, group=self._group)
        except RuntimeError as exc:  # DistBackendError and gloo's timeouts
            text = str(exc)
            match = _MISSING_RE.search(text)
            missing = [int(r) for r in re.findall(r"\d+", match.group(1))] if match else []
            who = (
                f"rank(s) {missing} of {self._world} never arrived within {limit:g}s"
                if missing
                else f"another rank failed or did not arrive within {limit:g}s"
            )
            raise CheckpointCoordinationError(
                f"rank {self._rank}: {who} ({text.splitlines()[0] if text else type(exc).__name__})",
                ranks=missing,
            ) from exc
        return list(gathered)


class AnyRank:
    """Whether a flag is set on any rank: the agreement a preemption stop needs, since a
    SIGTERM may reach one rank, or the ranks of one node, only.

    Call it on every rank at the same point of each step (a step boundary); all get the
    same answer, so all stop at the same step. Constructing one is a collective: it creates
    a gloo group of its own, so the reduction is a small CPU message that never waits on
    the GPU's stream. Without an initialised process group, or with one rank, it is the
    flag itself.

    Args:
        timeout: seconds a reduction waits for the other ranks before it raises.

    Raises:
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(self, *, timeout: float = 600.0) -> None:
        self._timeout = check_timeout(timeout)
        self._group: Any = None
        try:
            dist = _dist()
        except RuntimeError:
            return
        if _grouped(dist) and int(dist.get_world_size()) > 1:
            self._dist = dist
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def __call__(self, flag: bool) -> bool:
        """``flag`` or'ed across the ranks.

        Raises:
            CheckpointCoordinationError: another rank did not arrive within the timeout.
        """
        if self._group is None:
            return bool(flag)
        torch = importlib.import_module("torch")
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        try:
            self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as exc:
            raise CheckpointCoordinationError(
                f"the ranks could not agree on stopping within {self._timeout:g}s: "
                f"{_first_line(exc)}"
            ) from exc
        return bool(value.item())

    def any(self, flag: bool) -> bool:
        """``flag`` or'ed across the ranks (the same as calling the vote).

        Raises:
            CheckpointCoordinationError: another rank did not arrive within the timeout.
        """
        return self(flag)

    def least(self, values: Sequence[float]) -> list[float]:
        """The element-wise minimum of ``values`` across the ranks (every rank passes as
        many); ``values`` themselves without a group.

        Raises:
            CheckpointCoordinationError: another rank did not arrive within the timeout.
        """
        if self._group is None:
            return [float(v) for v in values]
        torch = importlib.import_module("torch")
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        try:
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)
        except RuntimeError as exc:
            raise CheckpointCoordinationError(
                f"the ranks could not agree within {self._timeout:g}s: {_first_line(exc)}"
            ) from exc
        return [float(v) for v in tensor.tolist()]

    def close(self) -> None:
        """Destroy the gloo group (a local call); idempotent."""
        group, self._group = self._group, None
        if group is not None and _grouped(self._dist):
            self._dist.destroy_process_group(group)


def _torchrun_variables() -> dict[str, str] | None:
    """torchrun's variables that :class:`TorchrunCoordinator` needs, or ``None`` when this
    process was not started by a torchrun agent that serves its store to the workers."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    found = {name: os.environ.get(name, "") for name in names}
    if not all(found.values()):
        return None
    found["TORCHELASTIC_RUN_ID"] = os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    return found


def _env_int(variables: dict[str, str], name: str) -> int:
    try:
        return int(variables[name])
    except ValueError:
        raise ValueError(f"torchrun's {name} must be an integer; got {variables[name]!r}") from None


class TorchrunCoordinator(RankedCoordinator):
    """A :class:`taskpoint.Coordinator` for the ranks of a torchrun job, before any process
    group exists.

    torchrun's agent serves a TCP key-value store at ``MASTER_ADDR:MASTER_PORT`` and tells
    its workers so with ``TORCHELASTIC_USE_AGENT_STORE=True`` (both the static rendezvous,
    ``--master_addr``/``--master_port``, and the c10d one, ``--rdzv-backend=c10d`` or
    ``--standalone``); ``init_process_group`` later connects to the same store. This
    coordinator connects to it as a client and gathers through keys under
    ``taskpoint/<TORCHELASTIC_RUN_ID>/`` (see the module docstring), so it never touches the
    process group's keys. ``RANK`` and ``WORLD_SIZE`` give its rank and world size.

    Every rank must build one, in the same order as its other :class:`TorchrunCoordinator`
    objects, but building one does not wait for the others. Values are JSON, never pickles.

    Args:
        timeout: default seconds a gather waits for the other ranks; also bounds connecting
            to the store.

    Raises:
        RuntimeError: the process was not started by torchrun with its agent's store (another
            launcher, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), or PyTorch is missing.
        ValueError: ``timeout`` is not a positive number, or torchrun's variables are not
            integers.
        CheckpointCoordinationError: the store could not be reached within ``timeout``.
    """

    def __init__(self, *, timeout: float = 600.0) -> None:
        self._timeout = check_timeout(timeout)
        variables = _torchrun_variables()
        if variables is None:
            raise RuntimeError(
                "TorchrunCoordinator needs a process started by torchrun (torch.distributed."
                "run) with its agent's store: TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR, "
                "MASTER_PORT, RANK and WORLD_SIZE; under another launcher use "
                "taskpoint.StoreCoordinator, or TorchCoordinator once a process group is up"
            )
        self._rank, self._world = check_rank(
            _env_int(variables, "RANK"), _env_int(variables, "WORLD_SIZE")
        )
        self._address = f"{variables['MASTER_ADDR']}:{variables['MASTER_PORT']}"
        self._prefix = f"{TORCHRUN_PREFIX}/{variables['TORCHELASTIC_RUN_ID']}/{next(_sessions)}"
        self._round = 0
        dist = _dist()
        try:
            self._store: Any = dist.TCPStore(
                variables["MASTER_ADDR"], _env_int(variables, "MASTER_PORT"),
                world_size=None, is_master=False, timeout=timedelta(seconds=self._timeout),
                wait_for_workers=False,
            )
        except RuntimeError as exc:  # DistNetworkError, DistStoreError
            raise CheckpointCoordinationError(
                f"rank {self._rank} could not reach torchrun's store at {self._address} "
                f"within {self._timeout:g}s ({_first_line(exc)}); is the launcher of node 0 "
                "still running?"
            ) from exc

    def __repr__(self) -> str:
        return (
            f"TorchrunCoordinator(rank={self._rank}, world_size={self._world}, "
            f"store={self._address!r}, prefix={self._prefix!r})"
        )

    def close(self) -> None:
        """Drop the connection to the store; idempotent. The coordinator cannot gather
        afterwards."""
        self._store = None

    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        store = self._store
        if store is None:
            raise RuntimeError(f"{self!r} is closed")
        limit = self._timeout if timeout is None else check_timeout(timeout)
        try:
            record = json.dumps(
                {"rank": self._rank, "world_size": self._world, "value": value},
                allow_nan=False,
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(f"TorchrunCoordinator gathers JSON values only: {exc}") from exc
        folder = f"{self._prefix}/{self._round}"
        self._round += 1
        keys = [f"{folder}/{rank}" for rank in range(self._world)]
        try:
            store.set(keys[self._rank], record)
            try:
                store.wait(keys, timedelta(seconds=limit))
            except RuntimeError as exc:  # DistStoreError: the wait timed out
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                if missing:
                    store.delete_key(keys[self._rank])  # never read by a later incarnation
                    raise CheckpointCoordinationError(
                        f"rank {self._rank} waited {limit:g}s in torchrun's store at "
                        f"{self._address} ({folder}) and rank(s) {missing} of "
                        f"{self._world} never arrived (they failed, hang, or gather in "
                        "another order)",
                        ranks=missing,
                    ) from exc
            raw = _get_all(store, keys)
        except RuntimeError as exc:  # the connection broke (DistNetworkError)
            raise CheckpointCoordinationError(
                f"rank {self._rank} lost torchrun's store at {self._address} while gathering "
                f"({_first_line(exc)}); did the launcher of node 0 exit?"
            ) from exc
        self._tidy(folder, keys)
        return [self._value(rank, data) for rank, data in enumerate(raw)]

    def _tidy(self, folder: str, keys: list[str]) -> None:
        """Count this rank as having read the round; the last one to read removes it.

        Best effort: the values are read already, and node 0's launcher (which serves the
        store) may be exiting once its own rank has them.
        """
        try:
            if self._store.add(f"{folder}/read", 1) == self._world:
                for key in (*keys, f"{folder}/read"):
                    self._store.delete_key(key)
        except RuntimeError as exc:
            log.debug("could not remove round %s from torchrun's store: %s", folder, exc)

    def _value(self, rank: int, data: bytes) -> Any:
        """The value in ``rank``'s record, after checking that it agrees on the world."""
        try:
            parsed = json.loads(data)
        except ValueError as exc:
            raise CheckpointCoordinationError(
                f"rank {rank}'s record in torchrun's store at {self._address} is not JSON: {exc}",
                ranks=[rank],
            ) from exc
        if not isinstance(parsed, dict) or parsed.get("rank") != rank:
            raise CheckpointCoordinationError(
                f"the record under rank {rank}'s key in torchrun's store at {self._address} "
                "is not that rank's (another program writes there?)",
                ranks=[rank],
            )
        if parsed.get("world_size") != self._world:
            raise CheckpointCoordinationError(
                f"ranks disagree about the world size: rank {rank} says "
                f"{parsed.get('world_size')!r} and rank {self._rank} says {self._world}",
                ranks=sorted({rank, self._rank}),
            )
        return parsed.get("value")


def _get_all(store: Any, keys: list[str]) -> list[bytes]:
    multi_get = getattr(store, "multi_get", None)
    if multi_get is not None:
        return list(multi_get(keys))
    return [store.get(key) for key in keys]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def torch_job_coordinator(*, timeout: float = 600.0) -> Coordinator | None:
    """The coordinator that spans this torch job's ranks now, or ``None``.

    * A ``torch.distributed`` process group of several ranks is up: a
      :class:`TorchCoordinator` (building it is a collective: every rank must call this).
    * No process group, but torchrun started this process with its agent's store and
      ``WORLD_SIZE`` > 1: a :class:`TorchrunCoordinator`.
    * Otherwise ``None``: the process runs alone, or was started by a launcher without a
      store the workers can reach before a process group exists (``srun``, ``mpirun``,
      Lightning's own launcher), where a caller can only act on its own rank.

    The caller owns the coordinator and should :meth:`~taskpoint.Coordinator.close` it.

    Args:
        timeout: the coordinator's default seconds a gather waits for the other ranks.

    Raises:
        ValueError: ``timeout`` is not a positive number.
        CheckpointCoordinationError: torchrun's store could not be reached.
    """
    check_timeout(timeout)
    try:
        dist = importlib.import_module("torch.distributed")
    except ImportError:  # no torch: no process group, and no torchrun either
        return None
    if _grouped(dist):
        return TorchCoordinator(timeout=timeout) if dist.get_world_size() > 1 else None
    variables = _torchrun_variables()
    if variables is None or _env_int(variables, "WORLD_SIZE") < 2:
        return None
    return TorchrunCoordinator(timeout=timeout)
