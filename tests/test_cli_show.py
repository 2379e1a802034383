"""``taskpoint show``: a run's history drawn as a timeline, as plain text, SVG and JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import taskpoint
from click.testing import CliRunner
from taskpoint import Checkpoint
from taskpoint.cli import main

T0 = 1_760_000_000.0
"""When the hand-written run below started (2025-10-09 08:53:20 UTC)."""


def _invoke(*args: str, columns: int = 80) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={"COLUMNS": str(columns)})
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), result.exception
    return result.exit_code, result.output


def _write(path: Path, record: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


STEPS = {(0, 0): 5, (0, 1): 10, (1, 0): 15, (2, 0): 20}
"""The step of each save of :func:`contract_run`, by (attempt, seq)."""


def contract_run(root: Path, *, keep: int = 2) -> str:
    """A run written record by record as the store contract says, with fixed times.

    Attempt 0 fails after two saves (an old-style marker: no host); attempt 1 resumes from
    attempt 0's newest save, saves once in the background and dies without an end record;
    attempt 2 resumes from that and succeeds. ``keep=2`` has pruned attempt 0's saves.
    Returns the action's URL.
    """
    url = f"file://{root}/train.fit/20251009T085320Z-3f2a9c"
    folder = root / "train.fit" / "20251009T085320Z-3f2a9c"
    saves = {0: [b"1", b"22"], 1: [b"333"], 2: [b"4444"]}
    for attempt, payloads in saves.items():
        checkpoint = Checkpoint(url, attempt=attempt, keep=keep)
        for data in payloads:
            checkpoint.save_sync(data)
    stats = {
        1: {"save_s": 0.25, "upload_s": 0.2, "uploaded": 3, "reused": 0, "blocked_s": 0.01,
            "background": True},
        2: {"save_s": 0.004, "upload_s": 0.002, "uploaded": 4, "reused": 0, "blocked_s": 0.004,
            "background": False},
    }
    for manifest in (folder / "checkpoints").glob("*.manifest.json"):
        record = json.loads(manifest.read_text())
        record["created"] = T0 + 10 * record["attempt"] + record["seq"] + 1
        # the training step each save was made at, whatever this process reported before
        record["step"] = STEPS[(record["attempt"], record["seq"])]
        record.pop("preemption", None)
        if record["attempt"] in stats:
            record["stats"] = stats[record["attempt"]]
        manifest.write_text(json.dumps(record))
    attempts = folder / "attempts"
    _write(attempts / "000000", {"format": 1, "started": T0, "pid": 4100})
    _write(attempts / "000000.end.json",
           {"format": 1, "ended": T0 + 5, "outcome": "failed", "error": "RuntimeError: lost the GPU",
            "step": 12})
    _write(attempts / "000001", {"format": 1, "started": T0 + 10, "pid": 812, "host": "node-b"})
    _write(attempts / "000001.resume.json",
           {"format": 1, "at": T0 + 10.5, "checkpoint": "000000-000000001.manifest.json",
            "restore_s": 0.012, "size": 2, "step": 10})
    _write(attempts / "000002", {"format": 1, "started": T0 + 20, "pid": 97, "host": "node-c"})
    _write(attempts / "000002.resume.json",
           {"format": 1, "at": T0 + 20.5, "checkpoint": "000001-000000000.manifest.json",
            "restore_s": 1.5, "size": 3, "step": 15})
    _write(attempts / "000002.end.json",
           {"format": 1, "ended": T0 + 30, "outcome": "succeeded", "error": None, "step": 20})
    _write(folder / "status.json",
           {"format": 1, "state": "succeeded", "attempts": 3, "finished": T0 + 30.1})
    return url


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Show times in UTC, whatever the machine's zone."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


ACTION = "train.fit/20251009T085320Z-3f2a9c"


def test_show_draws_each_attempt_resume_and_checkpoint(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path / "store")
    code, out = _invoke("show", ACTION, "--root", str(tmp_path / "store"), columns=200)
    assert code == 0, out
    lines = out.splitlines()
    assert f"{ACTION}  succeeded  3 attempts  2 checkpoints kept  30.10s in all" in out
    assert "attempt 0  failed  2025-10-09 08:53:20 → 08:53:25 (5.00s)  pid 4100" in out
    assert "08:53:25 +5.00s  failed: RuntimeError: lost the GPU" in out
    assert "attempt 1  died (no record)  2025-10-09 08:53:30  node-b pid 812" in out
    assert "attempt 2  succeeded  2025-10-09 08:53:40 → 08:53:50 (10.00s)  node-c pid 97" in out
    # The resume lines name the checkpoint, even the one pruned since, and the restore.
    assert ("resumed from 000000-000000001.manifest.json · at step 10 · restored 2 B in 12ms · pruned since"
            in out)
    assert "resumed from 000001-000000000.manifest.json · at step 15 · restored 3 B in 1.50s" in out
    # Kept checkpoints: when, which attempt (the branch), kind and size, what the save cost.
    assert "08:53:31 +1.00s  checkpoint 000001-000000000.manifest.json · ok · bytes, 3 B" in out
    assert "uploaded 3 B in 200ms · save 250ms, blocked 10ms · background" in out
    assert "uploaded 4 B in 2ms · save 4ms, blocked 4ms" in out
    assert "000000-000000000.manifest.json" not in out, "pruned checkpoints are absent"
    # In time order, each under its attempt.
    order = [next(i for i, line in enumerate(lines) if needle in line) for needle in (
        "attempt 0", "failed: RuntimeError", "attempt 1", "resumed from 000000-000000001",
        "checkpoint 000001-000000000", "attempt 2", "resumed from 000001-000000000",
        "checkpoint 000002-000000000", "+10.00s  succeeded",
    )]
    assert order == sorted(order)
    assert "\x1b[" not in out, "no colour codes when stdout is not a terminal"


def test_show_wraps_between_fields_at_any_width(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path / "store")
    for columns in (40, 60, 80, 120, 200):
        code, out = _invoke("show", ACTION, "--root", str(tmp_path / "store"), columns=columns)
        assert code == 0
        assert max(len(line) for line in out.splitlines()) <= columns
        for key in ("000000-000000001.manifest.json", "000001-000000000.manifest.json",
                    "000002-000000000.manifest.json", "RuntimeError: lost the GPU"):
            assert key in out, (columns, key)


def test_show_svg_is_the_same_picture(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path / "store")
    svg = tmp_path / "run.svg"
    code, out = _invoke("show", ACTION, "--root", str(tmp_path / "store"), "--svg", str(svg))
    assert code == 0, out
    tree = ET.parse(svg)
    assert tree.getroot().tag == "{http://www.w3.org/2000/svg}svg"
    text = "".join(tree.getroot().itertext()).replace("\xa0", " ")
    words = [w for line in out.splitlines() if not line.startswith("wrote ") for w in line.split()]
    assert words and all(w in text for w in words), [w for w in words if w not in text]
    assert "taskpoint show " + ACTION in text, "the window title"
    styles = "".join(e.text or "" for e in tree.iter("{http://www.w3.org/2000/svg}style"))
    assert re.search(r"fill: #[0-9a-f]{6}", styles), "the outcomes are coloured in the picture"
    assert out.splitlines()[-1] == f"wrote {svg}"


def test_show_svg_to_an_unwritable_path_is_one_line(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path / "store")
    target = tmp_path / "no" / "such" / "dir" / "run.svg"
    code, out = _invoke("show", ACTION, "--root", str(tmp_path / "store"), "--svg", str(target))
    assert code == 1 and out.splitlines()[-1].startswith(f"Error: cannot write {target}")


def test_show_json_keeps_the_old_fields_and_adds_the_history(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path / "store")
    root = str(tmp_path / "store")
    code, out = _invoke("show", ACTION, "--root", root, "--json")
    assert code == 0, out
    data = json.loads(out)
    _, listed = _invoke("ls", root, "--json")
    (old,) = json.loads(listed)["actions"]
    for field in ("action", "task", "run_id", "url", "state", "attempts", "damaged"):
        assert data[field] == old[field], field
    assert [c["key"] for c in data["checkpoints"]] == [c["key"] for c in old["checkpoints"]]
    detail = {a["attempt"]: a for a in data["attempts_detail"]}
    assert [detail[n]["state"] for n in (0, 1, 2)] == ["failed", "died (no record)", "succeeded"]
    assert detail[1]["outcome"] is None and detail[0]["host"] is None and detail[1]["host"] == "node-b"
    assert detail[1]["resumed_from"] == "000000-000000001.manifest.json"
    assert detail[1]["resumed_from_kept"] is False and detail[2]["resumed_from_kept"] is True
    assert detail[2]["restore_s"] == 1.5 and detail[2]["duration_s"] == 10.0
    assert detail[0]["error"] == "RuntimeError: lost the GPU"
    assert detail[2]["checkpoints"] == ["000002-000000000.manifest.json"]
    events = [(e["event"], e["attempt"]) for e in data["timeline"]]
    assert events == [
        ("start", 0), ("end", 0), ("start", 1), ("resume", 1), ("checkpoint", 1),
        ("start", 2), ("resume", 2), ("checkpoint", 2), ("end", 2),
    ]
    saved = [e for e in data["timeline"] if e["event"] == "checkpoint"]
    assert saved[0]["stats"] == {"save_s": 0.25, "upload_s": 0.2, "uploaded": 3, "reused": 0,
                                 "blocked_s": 0.01, "background": True, "coalesced": 0}
    assert all(e["verified"] is True for e in saved)
    assert json.loads(json.dumps(data)) == data


def test_show_says_how_many_waiting_saves_a_save_replaced(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store/job.step/r1"
    checkpoint = Checkpoint(url, attempt=0, keep=2)
    checkpoint.save_sync(b"x")
    checkpoint._saves.note_coalesced(2)  # two saves replaced while they waited
    checkpoint.save_sync(b"y")
    code, out = _invoke("show", "job.step/r1", "--root", str(tmp_path / "store"))
    assert code == 0
    assert out.count("replaced 2 waiting saves (coalesced)") == 1, out
    code, out = _invoke("show", "job.step/r1", "--root", str(tmp_path / "store"), "--json")
    saved = [e for e in json.loads(out)["timeline"] if e["event"] == "checkpoint"]
    assert sorted(e["stats"]["coalesced"] for e in saved) == [0, 2]


def test_show_marks_the_newest_attempt_of_an_unfinished_run(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store/job.step/r1"
    Checkpoint(url, attempt=0).save_sync(b"x")
    _write(tmp_path / "store/job.step/r1/attempts/000000", {"format": 1, "started": T0})
    _write(tmp_path / "store/job.step/r1/attempts/000001", {"format": 1, "started": T0 + 9})
    code, out = _invoke("show", "job.step/r1", "--root", str(tmp_path / "store"))
    assert code == 0
    assert "job.step/r1  unfinished  2 attempts  1 checkpoint kept" in out
    assert "attempt 0  died (no record)" in out and "attempt 1  running or died" in out


def test_show_copes_with_old_empty_and_garbage_records(tmp_path: Path) -> None:
    """Attempt markers from before the history (empty), garbage, absurd values: all shown."""
    url = f"file://{tmp_path}/store/job.step/r1"
    Checkpoint(url, attempt=3).save_sync(b"x")
    folder = tmp_path / "store" / "job.step" / "r1"
    (folder / "attempts").mkdir()
    (folder / "attempts" / "000000").write_bytes(b"")
    (folder / "attempts" / "000001").write_bytes(b"\x00\xff not json")
    _write(folder / "attempts" / "000002", {"format": 1, "started": 1e300, "pid": -1, "host": 7})
    _write(folder / "attempts" / "000002.end.json", {"format": 1, "ended": -1e300, "outcome": "??"})
    _write(folder / "attempts" / "000002.resume.json", {"checkpoint": 5, "restore_s": "slow"})
    (folder / "attempts" / "000004.end.json").write_text("[" * 100_000)
    manifest = next((folder / "checkpoints").glob("*.manifest.json"))
    record = json.loads(manifest.read_text())
    record["created"] = 1e300
    record["stats"] = {"save_s": "fast", "uploaded": -5, "blocked_s": None, "background": 1}
    manifest.write_text(json.dumps(record))
    for extra in ([], ["--json"], ["--svg", str(tmp_path / "x.svg")]):
        code, out = _invoke("show", "job.step/r1", "--root", str(tmp_path / "store"), *extra)
        assert code == 0 and "Traceback" not in out, out
    code, out = _invoke("show", "job.step/r1", "--root", str(tmp_path / "store"))
    for attempt in (0, 1, 2, 3):  # attempt 4 left a (garbage) end record: it came later
        assert f"attempt {attempt}  died (no record)" in out
    assert "attempt 4  running or died" in out
    assert "000003-000000000.manifest.json · ok · bytes, 1 B" in out


# -- a real run ---------------------------------------------------------------------------


def test_show_a_real_run_that_failed_twice_then_succeeded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TASKPOINT_ROOT", raising=False)
    monkeypatch.delenv("TASKPOINT_RUN_ID", raising=False)
    root = tmp_path / "store"
    env = taskpoint.TaskEnvironment(name="cli", root=str(root), run_id="r1")

    @env.task(retries=2, backoff=0)
    def count(n: int = 6) -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        prev = context.checkpoint.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        for i in range(start, n):
            if i == 2 * (context.attempt + 1) and context.attempt < 2:
                raise RuntimeError(f"boom at step {i}")
            context.checkpoint.save_sync(str(i + 1).encode())
        return start

    assert count() == 4
    code, out = _invoke("show", "cli.count/r1", "--root", str(root), columns=200)
    assert code == 0, out
    assert "cli.count/r1  succeeded  3 attempts" in out
    lines = out.splitlines()
    heads = [line for line in lines if re.search(r"attempt \d  ", line)]
    assert [re.search(r"attempt (\d)  (\S+)", h).groups() for h in heads] == [  # type: ignore[union-attr]
        ("0", "failed"), ("1", "failed"), ("2", "succeeded"),
    ]
    assert "failed: RuntimeError: boom at step 2" in out
    assert "failed: RuntimeError: boom at step 4" in out
    assert f"pid {os.getpid()}" in heads[0]
    # Attempt 1 resumed from attempt 0's last save (step 2), attempt 2 from attempt 1's (4).
    assert re.search(r"resumed from 000000-000000001\.manifest\.json · restored 1 B in \d+ms", out)
    assert re.search(r"resumed from 000001-000000001\.manifest\.json · restored 1 B in \d+ms", out)
    assert "checkpoint 000002-000000001.manifest.json · ok · bytes, 1 B" in out
    assert re.search(r"uploaded 1 B in \d+ms · save \d+ms, blocked \d+ms", out)

    code, raw = _invoke("show", "cli.count/r1", "--root", str(root), "--json")
    data = json.loads(raw)
    detail = data["attempts_detail"]
    assert [a["outcome"] for a in detail] == ["failed", "failed", "succeeded"]
    assert [a["resumed_from"] for a in detail] == [
        None, "000000-000000001.manifest.json", "000001-000000001.manifest.json",
    ]
    assert all(a["started"] <= a["ended"] for a in detail)
    assert detail[0]["error"].startswith("RuntimeError: boom at step 2")
    times = [e["at"] for e in data["timeline"] if e["at"] is not None]
    assert times == sorted(times)


def test_show_a_process_isolated_attempt_that_crashed(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os\nimport taskpoint\n\nenv = taskpoint.TaskEnvironment(name='cli')\n\n"
        "@env.task(retries=1, backoff=0)\ndef crash() -> int:\n"
        "    ctx = taskpoint.ctx()\n    ctx.checkpoint.load_sync()\n"
        "    ctx.checkpoint.save_sync(b'x')\n"
        "    if ctx.attempt == 0:\n        os._exit(9)\n    return ctx.attempt\n"
    )
    root = tmp_path / "store"
    env = {**os.environ, "TASKPOINT_ROOT": str(root)}
    ran = subprocess.run(
        [sys.executable, "-m", "taskpoint.cli", "run", f"{script}:crash", "--run-id", "c1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    code, out = _invoke("show", "cli.crash/c1", "--root", str(root), columns=200)
    assert code == 0, out
    assert re.search(r"attempt 0  crashed", out), out
    assert re.search(r"attempt 1  succeeded", out), out
    assert "resumed from 000000-000000000.manifest.json" in out




def test_show_is_coloured_on_a_terminal(tmp_path: Path) -> None:
    import pty

    contract_run(tmp_path / "store")
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskpoint.cli", "show", ACTION, "--root", str(tmp_path / "store")],
        stdout=terminal, stderr=subprocess.DEVNULL, env=env,
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
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in out, "styled on a terminal"
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert "attempt 1  died (no record)" in plain


def test_a_resume_source_whose_manifest_is_damaged_is_called_damaged_not_pruned(
    tmp_path: Path, utc: None
) -> None:
    contract_run(tmp_path / "store")
    folder = tmp_path / "store" / "train.fit" / "20251009T085320Z-3f2a9c"
    (folder / "checkpoints" / "000001-000000000.manifest.json").write_text("{not json")
    root = str(tmp_path / "store")
    code, out = _invoke("show", ACTION, "--root", root, columns=200)
    assert code == 0, out
    line = next(x for x in out.splitlines() if "resumed from 000001-000000000" in x)
    assert line.endswith("restored 3 B in 1.50s · CORRUPT since"), line
    assert "pruned" not in line
    # The one really pruned keeps its note.
    assert "resumed from 000000-000000001.manifest.json · at step 10 · restored 2 B in 12ms · pruned since" in out
    code, out = _invoke("show", ACTION, "--root", root, "--json")
    detail = {a["attempt"]: a for a in json.loads(out)["attempts_detail"]}
    assert detail[2]["resumed_from_damaged"] is True and detail[2]["resumed_from_kept"] is False
    assert detail[1]["resumed_from_damaged"] is False


def test_show_gives_the_runs_goodput_and_its_badput_by_cause(tmp_path: Path, utc: None) -> None:
    contract_run(tmp_path)
    code, raw = _invoke("show", ACTION, "--root", str(tmp_path), "--json")
    assert code == 0, raw
    figures = json.loads(raw)["goodput"]
    # 30 s from attempt 0's start to attempt 2's end; attempt 0 reached step 12 and the next
    # resumed at 10 (2 steps lost), attempt 1 saved at 15 and the next resumed at 15.
    assert figures["wall_s"] == pytest.approx(30.0)
    assert figures["steps_lost"] == 2
    badput = figures["badput_s"]
    assert set(badput) == {"blocked", "restore", "recomputed", "restart", "other"}
    assert badput["restore"] == pytest.approx(1.512)
    assert badput["recomputed"] == pytest.approx(2 * figures["step_s"])
    assert badput["restart"] is not None and badput["restart"] > 0
    assert figures["productive_s"] == pytest.approx(20 * figures["step_s"])
    assert figures["goodput"] == pytest.approx(figures["productive_s"] / 30.0)
    assert figures["estimated"], "no record holds a step's time: the figures say so"

    code, out = _invoke("show", ACTION, "--root", str(tmp_path), columns=200)
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("goodput"))
    assert f"goodput {figures['goodput']:.0%} of 30.00s · badput: " in line
    assert "badput: " in line and "restore 1.51s" in line and "recomputed " in line
    assert "partly estimated" in line


def test_show_gives_each_attempts_save_interval_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt that saved by time (``every_s="auto"`` in the adapters) records the
    interval it chose and its inputs; ``show`` prints them under the attempt, ``--json``
    gives the record."""
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "3600")
    url = f"file://{tmp_path}/train.fit/20251009T085320Z-3f2a9c"
    checkpoint = Checkpoint(url)
    now = [0.0]
    interval = taskpoint.SaveInterval.for_checkpoint(checkpoint, "auto", clock=lambda: now[0])
    checkpoint.save_sync(b"first")
    interval.saved(blocked_s=2.0)
    now[0] += 200.0
    checkpoint.save_sync(b"second")  # commits with the interval chosen from the first
    action = "train.fit/20251009T085320Z-3f2a9c"
    code, out = _invoke("show", action, "--root", str(tmp_path), columns=200)
    assert code == 0, out
    assert (
        "save interval  every 120.0 s (young-daly: save cost 2 s, mean time between failures "
        "3600 s from 0 failure(s) in 0 s, prior 3600 s)"
    ) in out
    code, out = _invoke("show", action, "--root", str(tmp_path), "--json")
    assert code == 0, out
    (detail,) = json.loads(out)["attempts_detail"]
    assert detail["save_interval"]["every"] == "auto"
    assert detail["save_interval"]["rule"] == "young-daly"
    assert detail["save_interval"]["interval_s"] == pytest.approx(120.0)
    assert detail["save_interval"]["mtbf_s"] == pytest.approx(3600.0)
