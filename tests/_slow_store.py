"""A store far away, for tests that need an upload in flight when they kill a process: the
``slow://`` file system (the local disk, each file written first waits ``$SLOW_S``
seconds) registered in every Python process started with :func:`slow_env`'s environment,
and ``slowremote://``, the same seen as an object store (every write through fsspec).

Set ``SLOW_S`` in a process before it starts its upload process, and that process's
uploads are slow; or set it from the start with ``SLOW_FLAG``, and every process's writes
turn slow once that file exists. The first slow write records its process's id in
``$SLOW_MARK``, so a test knows an upload is in flight, and from which process. Each
environment also gives its processes one temporary folder (``<tmp_path>/tmp``), shared as
on one machine.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

__all__ = ["slow_env"]

SLOW_FS = textwrap.dedent(
    """
    import os, time
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    class SlowFileSystem(LocalFileSystem):
        \"\"\"The local disk, where, in a process whose $SLOW_S is set (and once the file
        $SLOW_FLAG names exists, where it names one), every file written first takes
        $SLOW_S seconds: a store far away. The first slow write writes this process's id
        to $SLOW_MARK.\"\"\"

        protocol = ("slow",)

        def _open(self, path, mode="rb", *args, **kwargs):
            if "w" in mode:
                _slow()
            return super()._open(path, mode, *args, **kwargs)

        def put_file(self, *args, **kwargs):
            _slow()
            return super().put_file(*args, **kwargs)

    class SlowRemoteFileSystem(DirFileSystem):
        \"\"\"The same slowness, with the local disk seen as an object store:
        ``slowremote:///abs/path``. taskpoint writes to it as to S3 (whole objects through
        ``pipe_file``), where on ``slow://`` it writes some files itself, unslowed.\"\"\"

        protocol = ("slowremote",)

        def __init__(self, *args, **kwargs):
            super().__init__(path="/", fs=LocalFileSystem(auto_mkdir=True))

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, list):
                return [cls._strip_protocol(p) for p in path]
            return path.split("://", 1)[-1].lstrip("/")

        def pipe_file(self, *args, **kwargs):
            _slow()
            return super().pipe_file(*args, **kwargs)

        def put_file(self, *args, **kwargs):
            _slow()
            return super().put_file(*args, **kwargs)

        def _open(self, path, mode="rb", *args, **kwargs):
            if "w" in mode:
                _slow()
            return super()._open(path, mode, *args, **kwargs)

    def _slow():
        seconds, flag = os.environ.get("SLOW_S"), os.environ.get("SLOW_FLAG")
        if not seconds or (flag and not os.path.exists(flag)):
            return
        mark = os.environ.get("SLOW_MARK")
        if mark and not os.path.exists(mark):
            with open(mark + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(mark + ".tmp", mark)
        time.sleep(float(seconds))
    """
)
SLOW_SITE = textwrap.dedent(
    """
    import fsspec
    fsspec.register_implementation("slow", "slowfs.SlowFileSystem", clobber=True)
    fsspec.register_implementation("slowremote", "slowfs.SlowRemoteFileSystem", clobber=True)
    """
)


def slow_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """This process's environment without taskpoint's and the slow store's variables, plus
    the ``slow://`` store's registration, ``SLOW_MARK`` (``<tmp_path>/uploading``),
    ``TMPDIR`` (``<tmp_path>/tmp``) and ``variables``."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "slowfs.py").write_text(SLOW_FS)
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKPOINT_", "SLOW_"))}
    scratch = tmp_path / "tmp"  # one machine's temporary folder, shared by its processes
    scratch.mkdir(exist_ok=True)
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        SLOW_MARK=str(tmp_path / "uploading"), TMPDIR=str(scratch), **variables,
    )
    return env
