"""Background saves in a separate process, so the upload never holds the training loop's GIL.

Hashing, packing, compressing and the client libraries' request handling are Python work;
in a thread of the training process they take turns with the training loop for the GIL
(measured here: 0.53-0.88x of the loop's step rate while an upload ran). PyTorch's own
asynchronous checkpointing moved its upload out of the training process for the same
reason.

One upload process serves a whole Python process (a job, or one attempt of it): every
:class:`taskpoint.Checkpoint` hands its background saves to :func:`shared`'s
:class:`Worker`, which starts the child (running :func:`main`) at the first background
save, without waiting for it, and keeps it while an open checkpoint uses it: once the last
is closed (or collected) and no request is in flight, it ends after :data:`IDLE_EXIT_S`
seconds; once the last lets go of it without closing (:meth:`Worker.release` with
``at_once``, what :meth:`taskpoint.Checkpoint.release` does at the end of a fit), it ends
at once, or right after the requests in flight are answered. The next background save
starts a new one. Interpreter exit ends it too, once
its requests are answered (a fork's child starts its own). The child runs :mod:`taskpoint.checkpoint._upload_child`, which commits
each request with a :class:`~taskpoint.checkpoint._save.Saver` built from it. The child commits each request in a thread of its own, so the checkpoints
of one job never queue behind one another; each checkpoint sends one save at a time. The
child runs with the environment (credentials, endpoints) the parent had when it started
it: once the parent's storage environment (:data:`STORE_ENV_PREFIXES`: credentials,
endpoints, proxies, CA bundles) differs, the next save starts a new child and the old one
exits after answering its requests. Other variables are not compared: frameworks set
their own during training, and a new child per save would leave the saves made while it
starts to threads of the training process, lost with it.
Requests and replies are pickled frames over its standard input and output, each tagged
with its request's number; the child points its own ``sys.stdout`` at standard error
first, so nothing it prints can corrupt a frame.

The child runs at the parent's priority; each request runs on a thread of its own at the
nice increment the request carries (:func:`taskpoint.checkpoint._save.upload_nice` for a
background save no one waits for, 0 for a preemption save), and the child's start-up
imports (taskpoint, and the storage backends the parent names: a cold ``import s3fs`` took
3.6-4.2 s of CPU here) run on a thread at :func:`_save.upload_nice`'s priority before it
says it is ready, so no request pays for them: a first request that imported s3fs made a
fresh background save commit 2.6 s later than a blocking one. The child ignores SIGINT and
SIGTERM: a preempted attempt waits for the upload in flight, then ends. It exits once its standard input has closed and
its requests are answered, which is also what the parent's death does: an upload in flight
then still commits, as a zombie attempt's would, and a newer attempt's checkpoints outrank
it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from taskpoint.errors import CheckpointError
from taskpoint.store.store import RetryPolicy

__all__ = [
    "BOOTSTRAP", "CHILD_MODULE", "DEFAULT_UPLOAD_NICE", "STORE_ENV_PREFIXES", "UPLOAD_NICE_ENV",
    "Destination", "Message", "Request", "Stop", "Worker", "WorkerDied", "main", "shared",
    "upload_nice",
]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QQ")  # the request's number, the pickle's size in bytes
_READY = 0
"""The number of the child's first frame, which says it is ready; requests count from 1."""
CHILD_MODULE = "taskpoint.checkpoint._upload_child"
"""The module the upload process runs (:mod:`taskpoint.checkpoint._upload_child`): its
:func:`~taskpoint.checkpoint._upload_child.warm_up` before the child says it is ready, then
its :func:`~taskpoint.checkpoint._upload_child.run`. It is named here, not
imported: it sits above this module (it commits with :mod:`taskpoint.checkpoint._save`,
which hands requests to this one); ``tests/test_layers.py`` reads the name and checks the
code it imports."""
BOOTSTRAP = (
    "import importlib, os, sys, threading\n"
    "loaded = []\n"
    "def _load():\n"
    "    try:\n"
    "        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),\n"
    "                       min(os.getpriority(os.PRIO_PROCESS, 0) + int(sys.argv[1]), 19))\n"
    "    except OSError:\n"
    "        pass\n"
    "    loaded.append(importlib.import_module(sys.argv[2]))\n"
    "    loaded[0].warm_up(sys.argv[3:])\n"
    "_t = threading.Thread(target=_load)\n_t.start()\n_t.join()\n"
    "raise SystemExit(loaded[0].run())\n"
)
"""The child's program, given the nice increment of its start-up, :data:`CHILD_MODULE` and
the storage protocols to import before it is ready. It imports only the standard library
itself; the child's imports (a few seconds of CPU) run on a thread at that lower priority,
so they never compete with the training loop, while the main thread, which starts each
request's thread and fsspec's event loop thread (where an object store's transfers run),
keeps the parent's priority."""
UPLOAD_NICE_ENV = "TASKPOINT_UPLOAD_NICE"
"""The environment variable that sets how far below the training loop background uploads
run (a nice increment, 0 to 19; see :func:`upload_nice`)."""
DEFAULT_UPLOAD_NICE = 0
"""The nice increment of background uploads without :data:`UPLOAD_NICE_ENV`: none. An
upload is mostly waiting on the network; at nice 10 a loaded machine starved it (a 200 MB
save took 27-42 s to commit with three busy processes on two cores, 6-9 s at normal
priority), and the training loop waits for it sooner or later (the next save, a preemption,
the end of the attempt)."""

STARTUP_NICE = 10
"""The nice increment of the child's start-up imports: no save waits for them (background
saves commit from a thread of the parent until the child is ready)."""


def upload_nice() -> int:
    """How far below the training loop background uploads run: :data:`UPLOAD_NICE_ENV`
    (a nice increment from 0 to 19), else :data:`DEFAULT_UPLOAD_NICE`.

    It applies to background saves in the upload process and on upload threads; a save that
    training waits on (a blocking save, a preemption save) always runs at the caller's
    priority.

    Raises:
        ValueError: the variable is set to something other than an int from 0 to 19.
    """
    raw = os.environ.get(UPLOAD_NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_UPLOAD_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(
            f"{UPLOAD_NICE_ENV} must be an int from 0 (background uploads at the training "
            f"loop's priority) to 19 (the lowest); got {raw!r}"
        )
    return value


CLOSE_WAIT_S = 30.0
"""How long :func:`close_shared` waits, by default, for the child to finish its requests."""

IDLE_EXIT_S = 10.0
"""How long an upload process that no open checkpoint uses, with no save in flight, waits
for one before it ends (seconds). A checkpoint whose background saves would go there
uses it from its construction until it is closed or collected; the next background save
after it ended starts a new one."""
RELEASED_EXIT_S = 0.0
"""How long an upload process waits for a new user once its last one let go of it without
closing (:meth:`Worker.release` with ``at_once``; seconds): none. Letting go says saving is
over for now (the end of a fit), so nothing of taskpoint's outlives it, thread or process
(test harnesses flag a thread a test left running); the next background save starts a new
one, committing from a thread until it is ready."""
IDLE_POLL_S = 0.25
"""How often the idle upload process's reader checks whether it is still wanted (seconds)."""


def _set_thread_nice(nice: int) -> None:
    """Lower the calling thread's priority ``nice`` below the process's (0: unchanged)."""
    if nice <= 0:
        return
    with contextlib.suppress(AttributeError, OSError):
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(base + nice, 19))


class WorkerDied(CheckpointError):
    """The upload process ended before it answered (killed, or out of memory)."""


@dataclass(frozen=True)
class Destination:
    """Where and how the upload process commits one checkpoint's saves: what it builds
    that checkpoint's :class:`~taskpoint.checkpoint._save.Saver` from (picklable, unless
    ``storage_options`` holds a live object: such a checkpoint uploads from a thread)."""

    url: str
    storage_options: dict[str, Any]
    retry: RetryPolicy | None
    codec: str
    store_format: int
    keep: int


@dataclass(frozen=True)
class Request:
    """One save for the child to commit: what :meth:`taskpoint.checkpoint._save.Saver.commit` needs,
    picklable."""

    destination: Destination
    attempt: int
    seq: int
    source: Any  # taskpoint.checkpoint._save.Source
    intact: frozenset[tuple[str, str]]  # (manifest key, checksum) the parent knows intact
    nice: int = 0  # how far below the parent's priority the child runs it
    stop_key: str | None = None  # what a :class:`Stop` for this save names


@dataclass(frozen=True)
class Stop:
    """Tell the child to stop the save whose :attr:`Request.stop_key` is ``key`` before it
    commits (a save training waits for replaced it); answered at once with ``None``."""

    key: str


Message = Request | Destination | Stop
"""What the parent sends the child."""


def _send(stream: IO[bytes], number: int, message: object) -> None:
    """Write ``message`` as frame ``number``; pickling it fails before anything is written."""
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(number, len(blob)))
    stream.write(blob)
    stream.flush()


def _read(stream: IO[bytes], size: int) -> bytes:
    """``size`` bytes of ``stream``, fewer only at its end (a raw stream returns what one
    read gives)."""
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = stream.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(stream: IO[bytes]) -> tuple[int, bytes]:
    """The next frame: its request's number and its pickle (unpickled by the caller, so a
    reply that does not unpickle still answers its request)."""
    header = _read(stream, _HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    number, size = _HEADER.unpack(header)
    blob = _read(stream, size)
    if len(blob) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return number, blob


def _describe(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class _Reply:
    """One request's answer, once the child (or its death) gave it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None

    def give(self, ok: bool, value: Any) -> None:
        self.ok, self.value = ok, value
        self.done.set()


class _Reader(threading.Thread):
    """The thread that starts one upload process and reads its replies (a daemon).

    :meth:`stop` is the method a test harness stopping the daemon threads a test left
    behind looks for (Lightning's does): it ends the upload process now.
    """

    def __init__(self, child: _Child) -> None:
        super().__init__(target=child.serve, name="taskpoint-upload-process", daemon=True)
        self._child = child

    def stop(self, timeout: float | None = CLOSE_WAIT_S) -> None:
        """End the upload process once its requests are answered, and this thread with
        it; waits up to ``timeout`` seconds (``None``: no limit)."""
        self._child.close(timeout)
        self.join(timeout)


class _Child:
    """One upload process: started, then read, by a thread of its own, until it ends.

    The thread starts the process, waits for its ready frame, then hands each reply to
    the request waiting for it; when the process ends, every request still waiting fails
    with :class:`WorkerDied`. While no request waits and ``wanted`` says no open
    checkpoint uses it, it ends once :attr:`idle_exit_s` seconds have passed so.
    """

    def __init__(
        self, env: dict[str, str], protocols: tuple[str, ...] = (),
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        self.env = env
        self.protocols = protocols
        self._wanted = wanted
        self._idle_since = time.monotonic()
        self.idle_exit_s = IDLE_EXIT_S
        """How long it waits, idle and unwanted, before it ends (seconds; set by
        :class:`Worker`: :data:`IDLE_EXIT_S`, or :data:`RELEASED_EXIT_S` once let go of)."""
        self.ready = threading.Event()
        self.ended = threading.Event()
        self.started = threading.Event()  # ready, or ended without starting
        self._launched = threading.Event()  # Popen returned (the child ran exec) or failed
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: dict[int, _Reply] = {}
        self._numbers = itertools.count(_READY + 1)
        self._closing = False
        self._why = "it has not started"
        self.thread = _Reader(self)
        self.thread.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self.ready.is_set() else None

    @property
    def closing(self) -> bool:
        """Whether it was told to end (it answers the requests it holds, takes no more)."""
        return self._closing

    def serve(self) -> None:
        """The reader thread's work: start the process, then answer requests until it ends."""
        replies_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(STARTUP_NICE), CHILD_MODULE, *self.protocols],
                stdin=subprocess.PIPE,
                stdout=write_fd,
                env={**self.env, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            os.close(replies_fd)
            self._failed_start(f"it could not start: {exc}")
            return
        else:
            with self._lock:
                self._proc = proc
                if self._closing:  # closed while it started: it holds no request
                    proc.kill()
        finally:
            os.close(write_fd)
            self._launched.set()
        # Unbuffered, so that select() sees every reply not yet read.
        with open(replies_fd, "rb", buffering=0) as replies:
            self._serve(proc, replies)

    def _serve(self, proc: subprocess.Popen[bytes], replies: IO[bytes]) -> None:
        try:
            _receive(replies)  # its signal handlers and priority are in place
        except (EOFError, OSError):
            status = proc.wait()
            if self._closing:
                self._end("it was closed as it started")
            else:
                self._failed_start(f"it did not start ({_describe(status)})")
            return
        self.ready.set()
        self.started.set()
        with self._lock:
            self._idle_since = time.monotonic()
        while True:
            try:
                self._await_reply(replies)
                number, blob = _receive(replies)
            except (EOFError, OSError):
                break
            try:
                ok, value = pickle.loads(blob)
            except Exception as exc:  # a reply this process cannot rebuild
                ok, value = False, CheckpointError(
                    f"the upload process's reply could not be read ({type(exc).__name__}: "
                    f"{exc})"
                )
            with self._lock:
                reply = self._pending.pop(number, None)
                if not self._pending:
                    self._idle_since = time.monotonic()
            if reply is not None:
                reply.give(ok, value)
        try:
            code: int | None = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
            proc.kill()
        self._end(_describe(code))

    def _await_reply(self, replies: IO[bytes]) -> None:
        """Wait until a reply (or the end of the process's output) can be read; meanwhile
        end the process once it has been idle, unwanted, :attr:`idle_exit_s` seconds."""
        while not select.select([replies], [], [], IDLE_POLL_S)[0]:
            with self._lock:
                if self._closing or self._pending or self._wanted():
                    if self._pending or self._wanted():
                        self._idle_since = time.monotonic()
                    continue
                if time.monotonic() - self._idle_since < self.idle_exit_s:
                    continue
            log.debug("the upload process has been idle, unused, %ss: it ends", self.idle_exit_s)
            self.close(timeout=0)  # it exits at once (no request): its output ends

    def _failed_start(self, why: str) -> None:
        log.warning("the background upload process failed: %s; background saves upload "
                    "from a thread of this process until one starts", why)
        self._end(why)

    def _end(self, why: str) -> None:
        with self._lock:
            self._why = why
            self.ended.set()
            self.started.set()
            pending, self._pending = self._pending, {}
        for reply in pending.values():
            reply.give(False, self.died())

    def died(self) -> WorkerDied:
        return WorkerDied(
            f"the background upload process died ({self._why}); the save did not commit"
        )

    def run(self, request: Message) -> Any:
        """Send ``request`` to the ready child and wait for its answer (see :meth:`Worker.run`)."""
        reply = _Reply()
        with self._lock:
            if self.ended.is_set() or self._closing:
                raise self.died()
            number = next(self._numbers)
            self._pending[number] = reply
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            with self._send_lock:
                _send(proc.stdin, number, request)
        except (OSError, ValueError) as exc:  # a closed pipe: the child is gone
            with self._lock:
                self._pending.pop(number, None)
            self.ended.wait(10)
            raise self.died() from exc
        reply.done.wait()
        if reply.ok:
            return reply.value
        raise reply.value

    def close(self, timeout: float | None) -> bool:
        """Close the child's input: it finishes its requests, then exits. One still
        starting is ended now (it holds no request).

        Returns:
            Whether it ended within ``timeout`` seconds (``None``: no limit); one that did
            not goes on, to finish its requests, and is never killed.
        """
        with self._lock:
            self._closing = True
            if not self.ended.is_set():
                self._why = "it was closed"
            proc = self._proc
            if proc is not None and not self.ready.is_set():
                proc.kill()
        if proc is None:
            # Between its fork and its exec the child holds copies of this process's
            # descriptors, the scratch folders' owner locks among them: until Popen has
            # returned (it then kills the child, seeing it closed), an exit handler would
            # find those folders held and leave them on the disk.
            if not self._launched.wait(timeout) or self._proc is None:
                return self.ended.is_set()
            proc = self._proc
        with self._send_lock, contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


STORE_ENV_PREFIXES = (
    "AWS_", "AZURE_", "GOOGLE_", "GCE_", "GCS", "CLOUDSDK_", "STORAGE_EMULATOR_HOST",
    "FSSPEC", "TASKPOINT_", "S3_", "BOTO", "ADLFS", "OBSTORE", "HTTP_PROXY", "HTTPS_PROXY",
    "NO_PROXY", "ALL_PROXY", "SSL_CERT_", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
)
"""Names (upper-cased) of the environment variables an upload depends on, by prefix."""


def _store_env(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.upper().startswith(STORE_ENV_PREFIXES)}


class Worker:
    """The parent's handle on the upload process; see :func:`shared` for the one in use.

    It knows the open checkpoints that use it (its *users*, held weakly): once none is
    left and no request is in flight, the upload process ends after :data:`IDLE_EXIT_S`
    seconds (at once after a :meth:`release` with ``at_once``), and its reader thread with
    it. A request being made (:meth:`run`, from its call on) keeps it as a user does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._users: weakref.WeakSet[object] = weakref.WeakSet()
        self._requests = 0  # run() calls not yet answered
        self._idle_exit_s = IDLE_EXIT_S  # what a child waits, idle and unwanted, to end

    def _wanted(self) -> bool:
        """Whether a user holds it or a request is being made (read without the lock: the
        reader thread asks with its child's lock held)."""
        return len(self._users) > 0 or self._requests > 0

    def _add_user(self, user: object) -> None:
        """Count ``user`` (with ``_lock`` held): the child waits :data:`IDLE_EXIT_S` again."""
        self._users.add(user)
        self._idle_exit_s = IDLE_EXIT_S
        if self._child is not None:
            self._child.idle_exit_s = IDLE_EXIT_S

    def start(self, protocols: tuple[str, ...] = (), *, user: object = None) -> None:
        """Start the upload process unless it runs or is starting with this process's
        storage environment; never waits for it. One started with another is told to exit
        once it has answered its requests.

        Args:
            protocols: the fsspec protocols of the stores it will upload to, imported
                before it says it is ready (a child already running keeps its own).
            user: the open checkpoint (its saves) that will use it, until :meth:`release`
                or until it is collected; the upload process lives while it has a user.
        """
        env = dict(os.environ)
        with self._lock:
            if user is not None:
                self._add_user(user)
            old = self._child
            if (
                old is not None and not old.ended.is_set() and not old.closing
                and _store_env(old.env) == _store_env(env)
            ):
                return
            self._child = _Child(env, protocols, self._wanted)
            self._child.idle_exit_s = self._idle_exit_s
        if old is not None and not old.ended.is_set():
            log.debug("the environment changed: a new upload process takes over")
            old.close(timeout=0)

    def add_user(self, user: object) -> None:
        """Count ``user`` (an open checkpoint's saves) among those using the upload
        process, until :meth:`release` or until it is collected; starts nothing."""
        with self._lock:
            self._add_user(user)

    def release(self, user: object, *, at_once: bool = False) -> None:
        """``user`` no longer uses the upload process. The last user gone, it ends once
        idle :data:`IDLE_EXIT_S` seconds (a checkpoint closed), or, with ``at_once`` (a
        checkpoint letting go without closing: :meth:`taskpoint.Checkpoint.release`), now
        when no request is in flight, else as soon as the last is answered
        (:data:`RELEASED_EXIT_S`). Never waits: the process and its reader thread end a
        moment later."""
        with self._lock:
            if user not in self._users:
                return  # not a user (a thread's uploads, or let go of already)
            self._users.discard(user)
            if self._users:
                return
            self._idle_exit_s = RELEASED_EXIT_S if at_once else IDLE_EXIT_S
            child = self._child
            if child is None or child.ended.is_set():
                return
            child.idle_exit_s = self._idle_exit_s
            if at_once and not self._requests:
                # Under the lock, so a start() meanwhile sees it closing and starts anew.
                log.debug("the last checkpoint let go of the upload process: it ends")
                child.close(timeout=0)  # no request: it exits at once

    @property
    def thread(self) -> threading.Thread | None:
        """The reader thread of the upload process, while one runs or starts."""
        child = self._child
        return None if child is None or child.ended.is_set() else child.thread

    @property
    def ready(self) -> bool:
        """Whether the upload process has started, is running, and has this process's
        storage environment."""
        child = self._child
        return (
            child is not None and child.ready.is_set() and not child.ended.is_set()
            and not child.closing and _store_env(child.env) == _store_env(os.environ)
        )

    @property
    def pid(self) -> int | None:
        """The running upload process's id; ``None`` while none is ready."""
        child = self._child
        return child.pid if child is not None and not child.ended.is_set() else None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Start the upload process if needed and wait until it is ready.

        Returns:
            Whether it is ready; ``False`` if ``timeout`` seconds ran out or it failed
            to start.
        """
        self.start()
        child = self._child
        assert child is not None
        child.started.wait(timeout)
        return self.ready

    def run(self, request: Message) -> Any:
        """Have the child commit ``request`` (or open a :class:`Destination`'s store); what
        it returned, or raise what it raised.

        Starts the child first if none runs, and waits for it. Requests from several
        threads run in the child at once.

        Raises:
            WorkerDied: the child ended without an answer, or did not start (the request
                is lost; a new child starts at the next call).
            Exception: what the save raised in the child.
        """
        with self._lock:
            self._requests += 1  # wanted from here on: no idle end before it is sent
        try:
            self.start()
            child = self._child
            assert child is not None
            child.started.wait()
            return child.run(request)
        finally:
            with self._lock:
                self._requests -= 1

    def stop(self, key: str) -> None:
        """Tell the running child to stop the save it commits under ``key`` (a
        :class:`Stop`); waits only for its answer. Starts no child: where none runs, or it
        has ended, the save went with it."""
        with self._lock:
            child = self._child
            if child is None or child.ended.is_set() or not child.started.is_set():
                return
            self._requests += 1
        try:
            with contextlib.suppress(CheckpointError):
                child.run(Stop(key))
        finally:
            with self._lock:
                self._requests -= 1

    def open_store(self, destination: Destination) -> None:
        """Have the child open ``destination``'s store and client ahead of its first save
        (its import and service model: a tenth of a second or more), from a daemon thread;
        never waits, never fails (a save reports what fails)."""

        def send() -> None:
            try:
                self.run(destination)
            except Exception as exc:
                log.debug("opening %s in the upload process failed: %s", destination.url, exc)

        threading.Thread(target=send, name="taskpoint-upload-open", daemon=True).start()

    def close(self, timeout: float | None = CLOSE_WAIT_S) -> bool:
        """Let the child finish its requests and exit, waiting for that up to ``timeout``
        seconds (``None``: no limit). A later :meth:`start` starts a new child.

        Returns:
            Whether no child runs any more; one still running after ``timeout`` finishes
            its requests on its own.
        """
        with self._lock:
            child, self._child = self._child, None
        return True if child is None else child.close(timeout)


_shared: Worker | None = None
_shared_pid = 0
_shared_lock = threading.Lock()


def shared() -> Worker:
    """This process's upload process handle, one per process: every checkpoint's."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():  # a fork's child starts its own
            _shared, _shared_pid = Worker(), os.getpid()
        return _shared


def close_shared(timeout: float | None = CLOSE_WAIT_S) -> bool:
    """End this process's upload process once its requests are answered (see
    :meth:`Worker.close`); called at interpreter exit."""
    with _shared_lock:
        worker = _shared if _shared_pid == os.getpid() else None
    return True if worker is None else worker.close(timeout)


def _after_fork() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)
# A save made after the exit's settling (see taskpoint.checkpoint._settle):
atexit.register(close_shared)


def main(handle: Callable[[Message], Any]) -> int:
    """The child's loop: ``handle`` each request in a thread of its own, answer
    ``(ok, value)``; exit at end of input once every request is answered.

    Args:
        handle: answers one request (commits a save, or opens a destination's store) and
            returns what the parent's :meth:`Worker.run` returns
            (:func:`taskpoint.checkpoint._upload_child.handle`).
    """
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to standard error, never into a reply
    requests = sys.stdin.buffer
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    lock = threading.Lock()
    try:
        _send(replies, _READY, (True, "ready"))
    except OSError:  # the parent ended before the child was ready: nothing to serve
        return 0
    running: list[threading.Thread] = []
    while True:
        try:
            number, blob = _receive(requests)
        except EOFError:
            break
        thread = threading.Thread(
            target=_answer, args=(handle, number, blob, replies, lock),
            name=f"taskpoint-upload-{number}",
        )
        thread.start()
        running = [t for t in running if t.is_alive()] + [thread]
    for thread in running:
        thread.join()
    return 0


def _answer(
    handle: Callable[[Message], Any], number: int, blob: bytes, replies: IO[bytes],
    lock: threading.Lock,
) -> None:
    """Commit one request in the child and send its answer; a parent gone is no error."""
    try:
        request = pickle.loads(blob)
        _set_thread_nice(getattr(request, "nice", 0))
        result: tuple[bool, Any] = (True, handle(request))
    except Exception as exc:  # sent back and raised in the parent
        result = (False, exc)
    try:
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an error that does not pickle: its type and message do
        result = (False, CheckpointError(f"{type(result[1]).__name__}: {result[1]}"))
    with lock, contextlib.suppress(OSError):  # the parent gone; the save committed anyway
        _send(replies, number, result)
