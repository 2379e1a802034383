"""The ``taskpoint`` command: run tasks, and inspect, pull and clean up checkpoints.

User mistakes (a bad root, an unknown action) print one line and exit non-zero.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from taskpoint import _scratch
from taskpoint.errors import CheckpointError
from taskpoint.inspect import timeline
from taskpoint.inspect.inventory import ActionInfo, default_root, find_action, list_actions
from taskpoint.inspect.timeline import age, human_size
from taskpoint.runtime._isolation import FILE_MODULE

__all__ = ["main"]

PROGRESS_MIN_BYTES = 8 * 1024 * 1024
"""Transfers smaller than this never show a progress bar."""


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except (CheckpointError, ValueError, FileNotFoundError, NotADirectoryError) as exc:
        raise click.ClickException(str(exc)) from exc


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], object] | None]:
    """A progress callback drawing a bar on a terminal, for transfers worth one."""
    if total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def _root(root: str | None, positional: str | None = None) -> str:
    """The root given as ``--root`` or as the ROOT argument (``ls``, ``gc``), else the
    default; both, naming different roots, is a usage error, and a bad root a one-line
    error."""
    if root is not None and positional is not None and root != positional:
        raise click.UsageError(
            f"ROOT {positional!r} and --root {root!r} name different roots: give one of them"
        )
    chosen = root if root is not None else positional
    with _errors():
        return chosen if chosen is not None else default_root()


root_option = click.option(
    "--root", default=None, metavar="URL",
    help="Checkpoint root (default: $TASKPOINT_ROOT, else ./.taskpoint/checkpoints).",
)
"""Every command takes ``--root``; ``ls`` and ``gc``, whose only argument is the root, also
take it as ROOT (:data:`root_argument`)."""

root_argument = click.argument("root_arg", metavar="[ROOT]", required=False)
"""The root written as the argument: ``taskpoint ls ROOT`` is ``taskpoint ls --root ROOT``."""


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log what taskpoint does.")
@click.version_option(package_name="taskpoint")
def main(verbose: bool) -> None:
    """Intra-task checkpoints: run tasks that resume, and manage what they saved."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _load_task(target: str) -> Any:
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise click.UsageError(f"TARGET is path/to/file.py:task_name; got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise click.UsageError(f"no such file: {path_text}")
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(FILE_MODULE, path)
    if spec is None or spec.loader is None:
        raise click.UsageError(f"cannot import {path_text}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[FILE_MODULE] = module
    spec.loader.exec_module(module)
    task = getattr(module, name, None)
    runner = getattr(task, "__taskpoint_runner__", None)
    if runner is None:
        raise click.UsageError(f"{path_text} has no @env.task function named {name!r}")
    return runner


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("target")
@click.option("--retries", type=click.IntRange(min=0), default=None, help="Override the task's retries.")
@root_option
@click.option("--run-id", default=None, help="Attach to this run (resume its checkpoints).")
@click.option(
    "--isolation", type=click.Choice(["process", "inline"]), default="process", show_default=True,
    help="Run each attempt in a fresh process (survives crashes) or in this one.",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    target: str, retries: int | None, root: str | None, run_id: str | None, isolation: str,
    args: tuple[str, ...],
) -> None:
    """Run TARGET (path/to/file.py:task) with retries; ARGS after -- go to the task.

    An ARG written key=value is a keyword argument, anything else positional; values are
    parsed as JSON when they are valid JSON, else passed as strings. Prints the result as
    JSON and exits 0, or prints the last attempt's error and exits 1.
    """
    runner = _load_task(target)
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.isidentifier():
            keywords[key] = _parse_value(value)
        else:
            positional.append(_parse_value(arg))
    with _errors():
        configured = runner.with_options(
            retries=retries, isolation=isolation, root=root, run_id=run_id
        )
    try:
        result = configured(*positional, **keywords)
    except Exception as exc:
        click.echo(f"error: {configured.task} failed: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    try:
        click.echo(json.dumps(result))
    except TypeError:
        click.echo(repr(result))


@main.command("ls")
@root_argument
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--no-verify", is_flag=True, help="Skip reading payloads to check checksums.")
def ls_command(root_arg: str | None, root: str | None, as_json: bool, no_verify: bool) -> None:
    """List tasks, runs, attempts and committed checkpoints under ROOT (or --root)."""
    root = _root(root, root_arg)
    with _errors():
        actions = list(list_actions(root))
        verified = {a.action: _verify(a, no_verify) for a in actions}
    if as_json:
        payload = {
            "root": root,
            "actions": [a.to_json(verified[a.action]) for a in actions],
        }
        click.echo(json.dumps(payload, indent=2))
        return
    if not actions:
        click.echo(f"no checkpoints under {root}")
        return
    for action in actions:
        _print_action(action, verified[action.action])


def _verify(action: ActionInfo, skip: bool) -> dict[str, bool] | None:
    return None if skip else action.verify()


def _print_action(action: ActionInfo, verified: dict[str, bool] | None) -> None:
    attempts = ",".join(map(str, action.attempts)) or "-"
    click.echo(f"{action.action}  [{action.state}]  attempts: {attempts}")
    now = time.time()
    for m in action.checkpoints:
        check = "unverified" if verified is None else ("ok" if verified[m.key] else "CORRUPT")
        label = m.name or "(bytes)"
        click.echo(
            f"  {m.key:<32} {m.kind:<9} {label:<24} {human_size(m.size):>10}  "
            f"{age(now - m.created):>4} ago  {check}"
        )
    for damage in action.damaged:
        click.echo(f"  {damage.key:<32} {damage.label}: {damage.detail}")


def _require(root: str, action: str) -> ActionInfo:
    info = find_action(root, action)
    if info is None:
        raise click.ClickException(
            f"no action {action!r} under {root} (run `taskpoint ls {root}` to see them)"
        )
    return info


@main.command()
@click.argument("action")
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--svg", "svg", type=click.Path(dir_okay=False, writable=True, path_type=Path), default=None,
    metavar="FILE", help="Also write the timeline to FILE as an SVG picture.",
)
@click.option("--no-verify", is_flag=True, help="Skip reading payloads to check checksums.")
@click.option("--verbose", is_flag=True, help="Show the traceback of each failed attempt.")
def show(
    action: str, root: str | None, as_json: bool, svg: Path | None, no_verify: bool,
    verbose: bool,
) -> None:
    """Show ACTION (<task>/<run id>): its attempts, resumes and checkpoints, in time order.

    Each attempt with its outcome, host and process, the checkpoint it resumed from and how
    long the restore took; each kept checkpoint with its size, what its save cost and
    whether its payload is intact (read through and checked against its checksum). With
    --verbose, the traceback each failed attempt's record keeps (--json always has it).
    """
    root = _root(root)
    with _errors():
        info = _require(root, action)
        verified = _verify(info, no_verify)
    if as_json:
        click.echo(json.dumps({**info.to_json(verified), **timeline.to_json(info, verified)},
                              indent=2))
        return
    console = Console(record=svg is not None, highlight=False)
    console.print(timeline.render(info, verified, verbose=verbose))
    if svg is not None:
        try:
            console.save_svg(str(svg), title=f"taskpoint show {info.action}")
        except OSError as exc:
            raise click.ClickException(f"cannot write {svg}: {exc.strerror or exc}") from exc
        click.echo(f"wrote {svg}", err=True)


@main.command()
@click.argument("action")
@click.argument("dest", type=click.Path(path_type=Path))
@root_option
@click.option("--tar", "as_tar", is_flag=True, help="Write one .tar.gz archive to DEST instead.")
def pull(action: str, dest: Path, root: str | None, as_tar: bool) -> None:
    """Restore ACTION's newest intact checkpoint to DEST (verified against its checksum)."""
    root = _root(root)
    if dest.exists():
        raise click.ClickException(f"{dest} already exists; pull into a new path")
    with _errors():
        info = _require(root, action)
        size = info.checkpoints[0].size if info.checkpoints else 0
        # Owned, so a pull killed mid-restore leaves its copy to the next process's sweep.
        tmp = _scratch.scratch_folder()
        try:
            with _progress(size, "pulling") as progress:
                restored = info.checkpoint(workdir=str(tmp), progress=progress).load_sync()
                if restored is None:
                    raise click.ClickException(f"{action} has no committed checkpoint")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if as_tar:
                    _write_tar(restored, dest)
                else:
                    shutil.move(str(restored), str(dest))
        finally:
            _scratch.remove(tmp)
    click.echo(f"pulled {action} to {dest}")


def _write_tar(restored: Path, dest: Path) -> None:
    """``restored`` as one gzip-compressed tar at ``dest``: a tree's entries, or the file."""
    import tarfile

    from taskpoint.format.archive import pack_directory

    with open(dest, "wb") as out:
        if restored.is_dir():
            pack_directory(restored, out, "gzip")
        else:
            with tarfile.open(fileobj=out, mode="w:gz") as tar:
                tar.add(str(restored), arcname=restored.name)


@main.command()
@click.argument("action")
@root_option
@click.option("--force", is_flag=True, help="Also remove an unfinished run's checkpoints.")
def rm(action: str, root: str | None, force: bool) -> None:
    """Remove ACTION and everything it stored."""
    root = _root(root)
    with _errors():
        info = _require(root, action)
        if not info.finished and info.checkpoints and not force:
            raise click.ClickException(
                f"{action} is unfinished and would resume from its checkpoints; "
                "pass --force to remove it anyway"
            )
        info.checkpoint().delete()
    click.echo(f"removed {action}")


@main.command()
@root_argument
@root_option
@click.option("--keep", type=click.IntRange(min=0), required=True, help="Checkpoints kept per action.")
@click.option("--force", is_flag=True, help="Let --keep 0 empty unfinished runs too.")
def gc(root_arg: str | None, root: str | None, keep: int, force: bool) -> None:
    """Prune every action under ROOT (or --root) to its newest KEEP checkpoints, then free
    the content objects no checkpoint references any more.

    An unfinished run always keeps the checkpoint it would resume from, unless --force.
    """
    root = _root(root, root_arg)
    removed = objects = freed = 0
    busy: list[str] = []
    with _errors():
        for info in list_actions(root):
            floor = keep if (info.finished or force) else max(keep, 1)
            checkpoint = info.checkpoint()
            if len(info.checkpoints) > floor:
                removed += checkpoint.prune(floor)
            collected = checkpoint.collect()
            objects += collected.objects
            freed += collected.bytes
            if collected.skipped:
                busy.append(f"{info.action} ({collected.skipped})")
    click.echo(f"removed {removed} checkpoint(s) under {root}")
    if objects:
        click.echo(f"freed {objects} object(s), {human_size(freed)}")
    for action in busy:
        click.echo(f"not collected now: {action}")


if __name__ == "__main__":
    main()
