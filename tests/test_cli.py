"""The taskpoint command line, on a store holding several runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from taskpoint import Checkpoint
from taskpoint.cli import main


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A root with a finished run, an unfinished run and a directory checkpoint."""
    root = f"file://{tmp_path / 'store'}"
    done = Checkpoint(f"{root}/train.fit/run-a", attempt=0, keep=3)
    for i in range(3):
        done.save_sync(f"a{i}".encode())
    done.mark_finished("succeeded", attempts=1)
    live = Checkpoint(f"{root}/train.fit/run-b", attempt=1, keep=3)
    for i in range(3):
        live.save_sync(f"b{i}".encode())
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "w.bin").write_bytes(b"w" * 1000)
    Checkpoint(f"{root}/eval.score/run-c", attempt=0).save_sync(tree)
    return root


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_ls_json_round_trips(store: str) -> None:
    code, out = _invoke("ls", store, "--json")
    assert code == 0
    data = json.loads(out)
    actions = {a["action"]: a for a in data["actions"]}
    assert set(actions) == {"train.fit/run-a", "train.fit/run-b", "eval.score/run-c"}
    assert actions["train.fit/run-a"]["state"] == "succeeded"
    assert actions["train.fit/run-b"]["state"] == "unfinished"
    assert actions["train.fit/run-b"]["attempts"] == [1]
    newest = actions["train.fit/run-b"]["checkpoints"][0]
    assert newest["seq"] == 2 and newest["kind"] == "bytes" and newest["size"] == 2
    assert newest["verified"] is True and newest["age_seconds"] >= 0
    tree = actions["eval.score/run-c"]["checkpoints"][0]
    assert tree["kind"] == "directory" and tree["name"] == "tree"


def test_ls_human_and_corruption_shows(store: str, tmp_path: Path) -> None:
    for stored in (tmp_path / "store" / "eval.score" / "run-c" / "objects").iterdir():
        stored.write_bytes(b"garbage")
    code, out = _invoke("ls", store)
    assert code == 0
    assert "train.fit/run-a  [succeeded]" in out and "train.fit/run-b  [unfinished]" in out
    assert "CORRUPT" in out and out.count(" ok") == 6


def test_show_and_pull(store: str, tmp_path: Path) -> None:
    code, out = _invoke("show", "eval.score/run-c", "--root", store, "--json")
    assert code == 0 and json.loads(out)["checkpoints"][0]["verified"] is True
    dest = tmp_path / "pulled"
    code, out = _invoke("pull", "eval.score/run-c", str(dest), "--root", store)
    assert code == 0, out
    assert (dest / "sub" / "w.bin").read_bytes() == b"w" * 1000
    code, out = _invoke("pull", "train.fit/run-b", str(tmp_path / "b.bin"), "--root", store)
    assert code == 0 and (tmp_path / "b.bin").read_bytes() == b"b2"


def test_rm_protects_unfinished_runs(store: str) -> None:
    code, out = _invoke("rm", "train.fit/run-b", "--root", store)
    assert code == 1 and "unfinished" in out and "--force" in out
    code, _ = _invoke("rm", "train.fit/run-a", "--root", store)
    assert code == 0
    code, out = _invoke("rm", "train.fit/run-b", "--root", store, "--force")
    assert code == 0
    code, out = _invoke("ls", store, "--json")
    assert [a["action"] for a in json.loads(out)["actions"]] == ["eval.score/run-c"]


def test_gc(store: str) -> None:
    code, out = _invoke("gc", store, "--keep", "1")
    assert code == 0 and "removed 4" in out
    code, out = _invoke("gc", store, "--keep", "0")
    assert code == 0 and "removed 1" in out  # the finished run only
    actions = {a["action"]: a for a in json.loads(_invoke("ls", store, "--json")[1])["actions"]}
    assert len(actions["train.fit/run-b"]["checkpoints"]) == 1
    assert len(actions["eval.score/run-c"]["checkpoints"]) == 1
    code, out = _invoke("gc", store, "--keep", "0", "--force")
    assert code == 0 and "removed 2" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "s4://nope/root"], "s4://nope/root"),
        (["show", "no/such", "--root", "memory://empty-root"], "no action 'no/such'"),
        (["show", "not-an-action", "--root", "memory://empty-root"], "<task>/<run id>"),
        (["gc", "--keep", "-1"], "-1"),
    ],
)
def test_user_mistakes_are_one_line_errors(args: list[str], message: str) -> None:
    code, out = _invoke(*args)
    assert code != 0
    assert message in out
    assert "Traceback" not in out


RUN_TASK = textwrap.dedent(
    """
    import os
    import taskpoint

    env = taskpoint.TaskEnvironment(name="cli")

    @env.task(retries=0)
    def count(n: int, fail_first: bool = False) -> int:
        ctx = taskpoint.ctx()
        prev = ctx.checkpoint.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        for i in range(start, n):
            if fail_first and ctx.attempt == 0 and i == 2:
                os._exit(9)
            ctx.checkpoint.save_sync(str(i + 1).encode())
        return start
    """
)


def test_run_command(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(RUN_TASK)
    cmd = [sys.executable, "-m", "taskpoint.cli"]
    env = {**os.environ, "TASKPOINT_ROOT": f"file://{tmp_path / 'store'}"}
    ok = subprocess.run(
        [*cmd, "run", f"{script}:count", "--retries", "2", "--run-id", "cli-1", "--",
         "5", "fail_first=true"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "2", "attempt 1 resumed from the step attempt 0 reached"
    assert "exited with code 9" in ok.stderr
    failed = subprocess.run(
        [*cmd, "run", f"{script}:count", "--retries", "0", "--", "5", "fail_first=true"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1].startswith("error: cli.count failed")
    bad = subprocess.run([*cmd, "run", f"{script}:nope"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no @env.task function named 'nope'" in bad.stderr


def _pull_with_stderr_on_a_terminal(root: str, action: str, dest: Path) -> tuple[int, str]:
    """Run ``taskpoint pull`` with stderr on a pseudo-terminal; return its code and stderr."""
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskpoint.cli", "pull", action, str(dest), "--root", root],
        stdout=subprocess.DEVNULL, stderr=terminal, env={**os.environ, "COLUMNS": "100"},
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_pull_draws_a_progress_bar_only_on_a_terminal_and_for_large_transfers(
    tmp_path: Path,
) -> None:
    root = f"file://{tmp_path / 'store'}"
    Checkpoint(f"{root}/train.fit/big", attempt=0).save_sync(os.urandom(12 * 2**20))
    Checkpoint(f"{root}/train.fit/small", attempt=0).save_sync(os.urandom(2**20))

    code, err = _pull_with_stderr_on_a_terminal(root, "train.fit/big", tmp_path / "big")
    assert code == 0 and (tmp_path / "big").stat().st_size == 12 * 2**20
    assert "pulling" in err and "100%" in err

    code, err = _pull_with_stderr_on_a_terminal(root, "train.fit/small", tmp_path / "small")
    assert code == 0 and "pulling" not in err  # under 8 MiB: not worth a bar

    piped = subprocess.run(
        [sys.executable, "-m", "taskpoint.cli", "pull", "train.fit/big", str(tmp_path / "again"),
         "--root", root],
        capture_output=True, text=True,
    )
    assert piped.returncode == 0 and "pulling" not in piped.stderr  # not a terminal


@pytest.mark.parametrize("command", ["rm", "rm --force", "show", "pull"])
@pytest.mark.parametrize(
    "action",
    [
        "../outside",
        "train.fit/../../outside",
        "train.fit/../run-a",
        "./run-a",
        "train.fit/.",
        "train.fit/..",
        "..",
        "/abs/path",
        "ABSOLUTE",
        "train.fit/run-a/",
        "/train.fit/run-a",
        "train.fit//run-a",
        "train.fit/run-a/checkpoints",
        "train.fit\\run-a",
        "train.fit/run-a\\..\\..",
        "train.fit/run a",
        "",
        "/",
    ],
)
def test_action_names_are_checked_like_the_api_and_nothing_is_deleted(
    store: str, tmp_path: Path, command: str, action: str
) -> None:
    """`rm ../x` once deleted a directory outside the root; every bad name is refused."""
    outside = tmp_path / "outside"
    (outside / "checkpoints").mkdir(parents=True)
    (outside / "checkpoints" / "sentinel").write_text("keep me")
    (outside / "status.json").write_text('{"format": 1, "state": "succeeded"}')
    if action == "ABSOLUTE":
        action = str(outside)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    name, *flags = command.split()
    extra = [str(tmp_path / "dest")] if name == "pull" else []
    code, out = _invoke(name, action, *extra, "--root", store, *flags)
    assert code != 0, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert "<task>/<run id>" in out or "must be a non-empty string" in out, out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (outside / "checkpoints" / "sentinel").read_text() == "keep me"


@pytest.mark.parametrize("spelling", ["path", "file-url"])
@pytest.mark.parametrize(
    "command",
    [
        ["ls", "{root}"],
        ["ls", "{root}", "--json"],
        ["gc", "{root}", "--keep", "1"],
        ["show", "train.fit/run-a", "--root", "{root}"],
        ["pull", "train.fit/run-a", "{dest}", "--root", "{root}"],
        ["rm", "train.fit/run-a", "--root", "{root}", "--force"],
    ],
)
def test_a_missing_local_root_is_an_error_not_an_empty_listing(
    tmp_path: Path, command: list[str], spelling: str
) -> None:
    missing = tmp_path / "no" / "such-root"
    root = str(missing) if spelling == "path" else f"file://{missing}"
    args = [a.format(root=root, dest=tmp_path / "dest") for a in command]
    code, out = _invoke(*args)
    assert code == 1, out
    assert out.strip() == f"Error: checkpoint root {root} does not exist (nothing was ever " \
        "saved there, or the path is wrong: pass --root or set $TASKPOINT_ROOT)"
    assert not missing.exists() and not (tmp_path / "dest").exists()


def test_the_default_root_missing_is_an_error_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TASKPOINT_ROOT", raising=False)
    code, out = _invoke("ls")
    assert code == 1 and "does not exist" in out
    assert str(tmp_path / ".taskpoint" / "checkpoints") in out
    (tmp_path / ".taskpoint" / "checkpoints").mkdir(parents=True)
    code, out = _invoke("ls")
    assert code == 0
    assert out.strip() == f"no checkpoints under {tmp_path / '.taskpoint' / 'checkpoints'}"


def test_a_root_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("not a directory")
    code, out = _invoke("ls", str(tmp_path / "root"))
    assert code == 1 and out.strip() == f"Error: checkpoint root {tmp_path / 'root'} is not a directory"


def test_an_existing_empty_root_has_no_checkpoints(store_url: str) -> None:
    """On a local disk an empty directory; on an object store an empty prefix of a bucket."""
    code, out = _invoke("ls", store_url)
    assert (code, out.strip()) == (0, f"no checkpoints under {store_url}")
    code, out = _invoke("ls", store_url, "--json")
    assert code == 0 and json.loads(out) == {"root": store_url, "actions": []}
    code, out = _invoke("gc", store_url, "--keep", "0")
    assert (code, out.strip()) == (0, f"removed 0 checkpoint(s) under {store_url}")
    code, out = _invoke("show", "train.fit/run-a", "--root", store_url)
    assert code == 1 and "no action 'train.fit/run-a'" in out


def test_a_missing_bucket_is_an_error(s3_server: Any) -> None:
    root = s3_server.url(f"absent-{uuid.uuid4().hex[:12]}", "jobs")
    for args in (["ls", root], ["gc", root, "--keep", "1"],
                 ["show", "train.fit/run-a", "--root", root]):
        code, out = _invoke(*args)
        assert code == 1 and "does not exist" in out and "Traceback" not in out, out
        assert len(out.strip().splitlines()) == 1


def test_a_stray_file_in_the_root_is_not_an_action(store: str, tmp_path: Path) -> None:
    (tmp_path / "store" / "README").write_text("notes")
    (tmp_path / "store" / "train.fit" / "notes.txt").write_text("notes")
    code, out = _invoke("ls", store, "--no-verify")
    assert code == 0, out
    assert "train.fit/run-a" in out and "README" not in out and "notes" not in out


def _damage(store_dir: Path) -> None:
    """Garbage where manifests, payloads, attempt markers and status records go."""
    run_a = store_dir / "train.fit" / "run-a"
    checkpoints = run_a / "checkpoints"
    (checkpoints / "000000-000000007.manifest.json").write_bytes(b"\xff\x00garbage")
    (checkpoints / "000000-000000008.manifest.json").write_text('{"format": 1, "kind": "bytes"}')
    (checkpoints / "000000-000000009.manifest.json").mkdir()  # unreadable
    (checkpoints / "000000-000000010.manifest.json").write_text('{"format": 99}')
    (checkpoints / "000000-000000011.manifest.json").write_text("[" * 100_000)
    (checkpoints / "000000-000000012.manifest.json").write_text("null")
    (checkpoints / "000000-000000099-feed.payload").write_bytes(b"orphan")
    (checkpoints / "junk").write_bytes(b"\x00")
    attempts = run_a / "attempts"
    attempts.mkdir()
    (attempts / "000003").write_bytes(b"\xffgarbage")
    (attempts / "000004").mkdir()
    (attempts / "000005").write_text('{"format": 1, "started": "yesterday", "pid": "x"}')
    (attempts / "000005.end.json").write_text("{")
    (attempts / "junk").write_text("{}")
    (run_a / "status.json").unlink()
    (run_a / "status.json").mkdir()  # unreadable
    (store_dir / "train.fit" / "run-b" / "status.json").write_text('["not", "a", "record"')
    run_c = store_dir / "eval.score" / "run-c" / "checkpoints"
    payload = next((run_c.parent / "objects").iterdir())  # run-c is a format-2 tree
    payload.unlink()
    payload.mkdir()  # an object the store cannot read


def test_ls_and_show_never_crash_over_a_damaged_store(store: str, tmp_path: Path) -> None:
    _damage(tmp_path / "store")
    code, out = _invoke("ls", store)
    assert code == 0, out
    assert "Traceback" not in out
    for key in ("07", "08", "09", "11", "12"):
        assert f"checkpoints/000000-0000000{key}.manifest.json CORRUPT" in out.replace(
            "UNREADABLE", "CORRUPT"), key
    assert "checkpoints/000000-000000010.manifest.json NEWER FORMAT" in out
    assert "status.json" in out and "train.fit/run-b  [unfinished]" in out
    assert out.count(" ok") == 6  # run-a's and run-b's three intact checkpoints each
    assert out.count("CORRUPT") >= 5  # run-c's unreadable payload too

    code, out = _invoke("ls", store, "--json")
    assert code == 0, out
    actions = {a["action"]: a for a in json.loads(out)["actions"]}
    damaged = {d["key"]: d["problem"] for d in actions["train.fit/run-a"]["damaged"]}
    assert damaged == {
        "checkpoints/000000-000000007.manifest.json": "corrupt",
        "checkpoints/000000-000000008.manifest.json": "corrupt",
        "checkpoints/000000-000000009.manifest.json": "unreadable",
        "checkpoints/000000-000000010.manifest.json": "newer-format",
        "checkpoints/000000-000000011.manifest.json": "corrupt",
        "checkpoints/000000-000000012.manifest.json": "corrupt",
        "status.json": "unreadable",
        "attempts/000004": "unreadable",  # a directory: that record alone cannot be read
    }
    assert [c["verified"] for c in actions["train.fit/run-a"]["checkpoints"]] == [True] * 3
    assert actions["eval.score/run-c"]["checkpoints"][0]["verified"] is False
    assert actions["train.fit/run-b"]["damaged"][0]["key"] == "status.json"

    for action in ("train.fit/run-a", "train.fit/run-b", "eval.score/run-c"):
        for extra in ([], ["--json"]):
            code, out = _invoke("show", action, "--root", store, *extra)
            assert code == 0 and "Traceback" not in out, out


def test_pull_tar_writes_one_archive_tar_reads(store: str, tmp_path: Path) -> None:
    dest = tmp_path / "tree.tar.gz"
    code, out = _invoke("pull", "eval.score/run-c", str(dest), "--root", store, "--tar")
    assert code == 0, out
    import tarfile

    with tarfile.open(dest) as tar:
        assert tar.extractfile("sub/w.bin").read() == b"w" * 1000  # type: ignore[union-attr]


def test_gc_reports_the_objects_and_bytes_it_freed(tmp_path: Path) -> None:
    root = f"file://{tmp_path / 'store'}"
    ckpt = Checkpoint(f"{root}/train.fit/run-d", attempt=0, keep=3)
    tree = tmp_path / "t"
    tree.mkdir()
    for i in range(3):
        (tree / "w.bin").write_bytes(bytes([i]) * 300_000)
        ckpt.save_sync(tree)
    ckpt.mark_finished("succeeded", attempts=1)
    code, out = _invoke("gc", root, "--keep", "1")
    assert code == 0, out
    assert "removed 2 checkpoint(s)" in out and "freed 2 object(s)" in out
    restored = Checkpoint(f"{root}/train.fit/run-d").load_sync()
    assert restored is not None and (restored / "w.bin").read_bytes() == bytes([2]) * 300_000


# -- one way to name the root --------------------------------------------------------------


def test_every_command_takes_root_as_an_option() -> None:
    """`--root` is spelled the same in every command (the error for a missing root says
    "pass --root", whichever command printed it)."""
    for name, command in main.commands.items():
        options = {opt for param in command.params for opt in param.opts}
        assert "--root" in options, f"taskpoint {name} has no --root"
        code, out = _invoke(name, "--help")
        assert code == 0 and "--root URL" in out, (name, out)


@pytest.mark.parametrize("spelling", ["option", "argument"])
def test_ls_and_gc_take_the_root_either_way(store: str, spelling: str) -> None:
    root = ["--root", store] if spelling == "option" else [store]
    code, out = _invoke("ls", *root, "--json")
    assert code == 0, out
    assert json.loads(out)["root"] == store
    assert len(json.loads(out)["actions"]) == 3
    code, out = _invoke("gc", *root, "--keep", "1")
    assert code == 0, out
    assert out.splitlines()[0] == f"removed 4 checkpoint(s) under {store}"


def test_the_root_twice_must_agree(store: str, tmp_path: Path) -> None:
    code, out = _invoke("ls", store, "--root", store, "--json")
    assert code == 0 and len(json.loads(out)["actions"]) == 3
    other = f"file://{tmp_path}"
    for command in (["ls"], ["gc", "--keep", "1"]):
        code, out = _invoke(*command, store, "--root", other)
        assert code == 2, out
        assert f"ROOT {store!r} and --root {other!r} name different roots" in out
    assert len(json.loads(_invoke("ls", store, "--json")[1])["actions"]) == 3, "nothing was pruned"


# -- show, piped ---------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [40, 60, 80, 100])
def test_show_piped_breaks_a_long_url_between_segments(tmp_path: Path, columns: int) -> None:
    """Piped (80 columns unless $COLUMNS says), the run's URL and the header break after a
    `/`, so the run id stays whole; each line fits the width."""
    from test_cli_show import ACTION, contract_run

    root = tmp_path / "a-folder-with-a-rather-long-name" / "store"
    url = contract_run(root)
    result = CliRunner().invoke(
        main, ["show", ACTION, "--root", str(root)], env={"COLUMNS": str(columns)}
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= columns
    run_id = ACTION.partition("/")[2]
    whole = [line for line in lines if run_id in line]
    assert len(whole) == 2, f"the run id is cut:\n{result.output}"  # the URL and the header
    # The URL's lines, joined, are the URL: each but the last ends at a `/`.
    head = lines[: lines.index(whole[0]) + 1]
    assert "".join(line.strip() for line in head) == url.removeprefix("file://")
    assert all(line.endswith("/") for line in head[:-1])
