"""What a checkpoint root holds: tasks, their runs (actions), attempts and checkpoints.

Layout under a root (a public contract, see the README)::

    <root>/<task>/<run id>/checkpoints/<attempt>-<seq>.manifest.json
    <root>/<task>/<run id>/checkpoints/<attempt>-<seq>-<token>.payload
    <root>/<task>/<run id>/attempts/<attempt>        (attempts numbered by the store)
    <root>/<task>/<run id>/status.json               (written when the action ends)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.errors import CheckpointError, CheckpointFormatError, CheckpointStoreError
from taskpoint.format.history import (
    ATTEMPTS,
    STATUS,
    AttemptRecord,
    attempt_numbers,
    read_attempts,
)
from taskpoint.format.manifest import (
    CHECKPOINTS,
    Manifest,
    check_format,
    loads_record,
    parse_manifest_name,
)
from taskpoint.runtime.context import ENV_ROOT, root_from
from taskpoint.runtime.names import check_name
from taskpoint.store.store import Store

__all__ = [
    "ActionInfo",
    "Damage",
    "check_root",
    "default_root",
    "find_action",
    "list_actions",
    "parse_action",
]

log = logging.getLogger(__name__)


def default_root() -> str:
    """``TASKPOINT_ROOT``, else the embedded local store under the working directory."""
    return root_from(os.environ)


@dataclass(frozen=True)
class Damage:
    """A record of an action that could not be read as what its name says it is.

    Attributes:
        key: the object's name under the action (``checkpoints/<name>``, ``status.json``).
        problem: ``"corrupt"`` (not a valid record), ``"newer-format"`` (written by a newer
            taskpoint) or ``"unreadable"`` (the store failed to read it).
        detail: the error, as text.
    """

    key: str
    problem: str
    detail: str

    @property
    def label(self) -> str:
        """How listings show it: ``CORRUPT``, ``NEWER FORMAT`` or ``UNREADABLE``."""
        return {"newer-format": "NEWER FORMAT", "unreadable": "UNREADABLE"}.get(
            self.problem, "CORRUPT"
        )

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "problem": self.problem, "detail": self.detail}


@dataclass(frozen=True)
class ActionInfo:
    """One action (a run of a task) found under a root.

    Attributes:
        task: the task's name.
        run_id: the run's id.
        url: the action's checkpoint URL.
        status: what the action recorded when it ended, or ``None`` while unfinished (or
            when the record is damaged: see ``damaged``).
        attempts: the attempt numbers seen (from markers and checkpoints), ascending.
        checkpoints: committed manifests, newest first.
        damaged: records that could not be read (garbage manifests, an unreadable
            ``status.json``), by key.
        history: what each attempt recorded (start, resume, end), ascending; attempts
            known only from their checkpoints have no record here.
        storage_options: the options the action was read with.
    """

    task: str
    run_id: str
    url: str
    status: dict[str, Any] | None
    attempts: list[int]
    checkpoints: list[Manifest]
    damaged: list[Damage] = field(default_factory=list)
    history: list[AttemptRecord] = field(default_factory=list)
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def action(self) -> str:
        return f"{self.task}/{self.run_id}"

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def state(self) -> str:
        """``"succeeded"``, ``"failed"`` (as recorded) or ``"unfinished"``."""
        state = (self.status or {}).get("state")
        return state if isinstance(state, str) and state else "unfinished"

    def checkpoint(self, **options: Any) -> Checkpoint:
        """A :class:`Checkpoint` bound to this action (for loading, pruning, deleting)."""
        options.setdefault("storage_options", self.storage_options)
        return Checkpoint(self.url, **options)

    def verify(self) -> dict[str, bool]:
        """Read each checkpoint's payload through: whether it matches its size and checksum.

        A payload the store fails to read counts as not intact (it cannot be loaded
        either); the failure is logged as a warning.

        Returns:
            Manifest keys mapped to the result.
        """
        checkpoint = self.checkpoint()
        result = {}
        for m in self.checkpoints:
            try:
                result[m.key] = checkpoint.verify(m)
            except CheckpointStoreError as exc:
                log.warning("cannot verify %s/%s/%s: %s", self.url, CHECKPOINTS, m.key, exc)
                result[m.key] = False
        return result

    def to_json(self, verified: Mapping[str, bool] | None = None) -> dict[str, Any]:
        """A JSON-ready description; ``verified`` maps manifest keys to checksum results."""
        now = time.time()
        return {
            "action": self.action,
            "task": self.task,
            "run_id": self.run_id,
            "url": self.url,
            "state": self.state,
            "attempts": self.attempts,
            "checkpoints": [
                {
                    "key": m.key,
                    "attempt": m.attempt,
                    "seq": m.seq,
                    "kind": m.kind,
                    "name": m.name,
                    "codec": m.codec,
                    "size": m.size,
                    "checksum": m.checksum,
                    "created": m.created,
                    "age_seconds": round(now - m.created, 3),
                    "verified": None if verified is None else verified.get(m.key),
                }
                for m in self.checkpoints
            ],
            "damaged": [d.to_json() for d in self.damaged],
        }


def _damage(key: str, exc: CheckpointError) -> Damage:
    if isinstance(exc, CheckpointFormatError):
        return Damage(key, "newer-format", str(exc))
    if isinstance(exc, CheckpointStoreError):
        return Damage(key, "unreadable", str(exc))
    return Damage(key, "corrupt", str(exc))


def _read_manifests(store: Store, damaged: list[Damage]) -> list[Manifest]:
    """The manifests that parse, newest first; the others are added to ``damaged``."""
    names = sorted(
        (order, name)
        for name in store.list(CHECKPOINTS)
        if (order := parse_manifest_name(name)) is not None
    )
    manifests = []
    for _, name in reversed(names):
        key = f"{CHECKPOINTS}/{name}"
        try:
            manifests.append(
                Manifest.from_json(store.read_bytes(key), url=store.url_of(key), name=name)
            )
        except FileNotFoundError:
            continue  # pruned since the listing
        except CheckpointError as exc:
            damaged.append(_damage(key, exc))
    return manifests


def _read_status(store: Store, damaged: list[Damage]) -> dict[str, Any] | None:
    """The status record, or ``None`` when there is none or it is damaged."""
    try:
        data = store.read_bytes(STATUS)
    except FileNotFoundError:
        return None
    except CheckpointStoreError as exc:
        damaged.append(_damage(STATUS, exc))
        return None
    url = store.url_of(STATUS)
    try:
        record = loads_record(data)
    except ValueError as exc:
        damaged.append(Damage(STATUS, "corrupt", f"{url} is not valid JSON: {exc}"))
        return None
    try:
        check_format(record, url=url)
    except CheckpointFormatError as exc:
        damaged.append(_damage(STATUS, exc))
        return None
    if not isinstance(record, dict):
        damaged.append(Damage(STATUS, "corrupt", f"{url} is not a JSON object"))
        return None
    return record


def _read_history(store: Store, damaged: list[Damage]) -> list[AttemptRecord]:
    """The attempt records; when the store cannot read them, bare numbers from the listing."""
    try:
        records = read_attempts(store)
    except CheckpointStoreError as exc:
        damaged.append(_damage(f"{ATTEMPTS}/", exc))
        return [AttemptRecord(attempt=n) for n in attempt_numbers(store)]
    for record in records:
        damaged.extend(Damage(key, "unreadable", error) for key, error in record.unreadable)
    return records


def _describe(root: str, task: str, run_id: str, options: Mapping[str, Any]) -> ActionInfo:
    url = f"{root.rstrip('/')}/{task}/{run_id}"
    store = Store(url, options)
    damaged: list[Damage] = []
    manifests = _read_manifests(store, damaged)
    status = _read_status(store, damaged)
    history = _read_history(store, damaged)
    attempts = {r.attempt for r in history} | {m.attempt for m in manifests}
    return ActionInfo(
        task=task, run_id=run_id, url=url, status=status, attempts=sorted(attempts),
        checkpoints=manifests, damaged=sorted(damaged, key=lambda d: d.key), history=history,
        storage_options=dict(options),
    )


def _is_dir(store: Store, name: str) -> bool:
    """Whether ``name`` can hold actions: on a local disk, a directory; elsewhere, always.

    Object stores and ``memory://`` have prefixes, not directories, and list an object under
    its own name; only a local disk refuses to list inside a file.
    """
    if not store.is_local:
        return True
    return store.is_dir(name)


def check_root(root: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse a root that cannot hold checkpoints.

    A local root (a path or ``file://`` URL) must be an existing directory. On an object
    store the bucket (or container) must exist; a prefix holding nothing is an empty root.

    Raises:
        FileNotFoundError: the local root does not exist.
        NotADirectoryError: the local root is a file.
        CheckpointStoreError: the store failed, its protocol is unknown, or its bucket does
            not exist.
    """
    store = Store(root, storage_options)
    if not store.is_local:
        store.list("")  # a missing bucket raises CheckpointStoreError
        return
    if _is_dir(store, ""):
        return
    if store.exists(""):
        raise NotADirectoryError(f"checkpoint root {root} is not a directory")
    raise FileNotFoundError(
        f"checkpoint root {root} does not exist (nothing was ever saved there, or the path "
        f"is wrong: pass --root or set ${ENV_ROOT})"
    )


def _is_action(store: Store, task: str, run_id: str) -> bool:
    if not _is_dir(store, f"{task}/{run_id}"):
        return False
    names = store.list(f"{task}/{run_id}")
    return any(n in (CHECKPOINTS, ATTEMPTS, STATUS) for n in names)


def list_actions(
    root: str, storage_options: Mapping[str, Any] | None = None
) -> Iterator[ActionInfo]:
    """Every action under ``root``, by task then run id.

    The root is checked at once (see :func:`check_root`); the actions are read as the
    iterator reaches them.

    Raises:
        FileNotFoundError: the local root does not exist.
        NotADirectoryError: the local root is a file.
        CheckpointStoreError: the store failed or the root cannot be opened.
    """
    options = dict(storage_options or {})
    check_root(root, options)
    return _actions(root, options)


def _actions(root: str, options: dict[str, Any]) -> Iterator[ActionInfo]:
    store = Store(root, options)
    for task in store.list(""):
        if not _is_dir(store, task):
            continue
        for run_id in store.list(task):
            if parse_manifest_name(run_id) is None and _is_action(store, task, run_id):
                yield _describe(root, task, run_id, options)


def parse_action(action: str) -> tuple[str, str]:
    """Split ``"<task>/<run id>"`` into its task and run id, checked as the API checks them.

    Both parts must be names :func:`taskpoint.runtime.names.check_name` accepts, so an action can
    never reach outside its root: no ``..`` or ``.``, no absolute path, no empty part, no
    backslash.

    Raises:
        ValueError: ``action`` is not two such names joined by one ``/``.
    """
    parts = action.split("/") if isinstance(action, str) else []
    if len(parts) != 2:
        raise ValueError(
            f"an action is written <task>/<run id> (as `taskpoint ls` shows); got {action!r}"
        )
    task, run_id = parts
    return check_name("task", task), check_name("run id", run_id)


def find_action(
    root: str, action: str, storage_options: Mapping[str, Any] | None = None
) -> ActionInfo | None:
    """The action ``"<task>/<run id>"`` under ``root``, or ``None`` if it holds nothing.

    Raises:
        ValueError: ``action`` is not a valid action name (see :func:`parse_action`).
        FileNotFoundError: the local root does not exist.
        NotADirectoryError: the local root is a file.
        CheckpointStoreError: the store failed or the root cannot be opened.
    """
    task, run_id = parse_action(action)
    options = dict(storage_options or {})
    check_root(root, options)
    if not _is_action(Store(root, options), task, run_id):
        return None
    return _describe(root, task, run_id, options)
