"""The code blocks of ``README.md`` and of the guides (``docs/``) run here, for real.

Every Python block of the guides is a test of its own, collected by ``docs/conftest.py``
(pytest-markdown-docs' collector, with stand-ins for the reader's code that fail once on
purpose and check that the retry resumed). This file runs the rest: every block of the
README, and the guides' blocks a plain run cannot check by itself. :data:`COVERAGE` says
which test runs which block: a README block no entry claims, or an entry whose block is
gone, fails :func:`test_every_block_is_run`.

- ``python`` blocks are executed. The names a block uses without defining them stand for
  the reader's own code; :data:`YOUR_CODE` documents each one, and every block's free names
  are checked against what its test supplies. The supplied step functions die once on
  purpose, like a reclaimed machine, so each task block really retries, and the test checks
  that the retry resumed from the checkpoint instead of starting over.
- ``sh`` blocks are run as commands (placeholders such as ``TASK/RUN`` replaced by real
  values), ``json`` is validated as a manifest, the plain block (the store layout) is
  compared with the layout a real run writes, and the ``taskpoint show`` sample and picture
  with what the command prints for the run they describe.

Object-store URLs (``s3://``, ``gs://``, ``az://``) run against the suite's loopback
servers (``conftest.py``): skipped with the reason where one cannot start, failed with
``CI=true``. The Unsloth block runs in Unsloth's own environment (``.venv-unsloth``).
"""

from __future__ import annotations

import ast
import builtins
import html
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import _servers
import pytest
import taskpoint

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
FIXTURES = Path(__file__).resolve().parent / "docs_blocks"
SHOW_PICTURE = DOCS / "assets" / "taskpoint-show.svg"
ENV_CONTRACT = ("TASKPOINT_ROOT", "TASKPOINT_ACTION", "TASKPOINT_RUN_ID", "TASKPOINT_ATTEMPT")
"""Variables that would send the blocks' checkpoints elsewhere; unset for every block."""

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")


# -- the blocks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, language, text, and the line of its opening fence."""

    page: Path
    lang: str
    text: str
    line: int
    info: str = ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line} (```{self.info})"


def _language(info: str) -> str:
    """The language of an info string: ``python`` for ``python`` and for pymdownx
    superfences' ``{.python fixture:x}``."""
    info = info.strip()
    if info.startswith("{"):
        classes = [w[1:] for w in info.strip("{}").split() if w.startswith(".")]
        return classes[0] if classes else ""
    return info.split()[0] if info else ""


def page_blocks(page: Path) -> list[Block]:
    """The fenced blocks of the Markdown file ``page``, in order.

    Raises:
        AssertionError: a fence is never closed.
    """
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, start=1):
        fence = re.match(r"^ {0,3}(```+)\s*(.*?)\s*$", line)
        if opened is None:
            if fence:
                opened, body = (fence.group(2), number), []
        elif fence and not fence.group(2):
            info = opened[0]
            blocks.append(Block(page, _language(info), "\n".join(body) + "\n", opened[1], info))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"{page}:{opened[1]}: a code fence is never closed"
    return blocks


def guide_pages() -> list[Path]:
    """The guides: every Markdown page under ``docs/`` but the generated API reference."""
    return sorted(p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts)


@dataclass(frozen=True)
class Covered:
    """A page, a block's language, a pattern only that block matches, and the tests that run it."""

    page: str
    lang: str
    pattern: str
    tests: tuple[str, ...]


COVERAGE: list[Covered] = [
    Covered("README.md", "sh", r"uv run python examples/pytorch_checkpoint\.py",
            ("test_first_screen_example_command", "test_first_screen_pytest_command")),
    Covered("README.md", "python", r"def train\(steps: int = 100\)", ("test_use_it_block",)),
    Covered("docs/getting-started.md", "sh", r"uv run python examples/pytorch_checkpoint\.py",
            ("test_first_screen_example_command",)),
    Covered("docs/getting-started.md", "text", r"^attempt 0: starting at epoch 0 \(",
            ("test_first_screen_example_command",)),
    Covered("docs/getting-started.md", "sh", r"^uv run taskpoint show ",
            ("test_getting_started_show_sample",)),
    Covered("docs/getting-started.md", "text", r"├── attempt 0 ",
            ("test_getting_started_show_sample",)),
    Covered("docs/frameworks/unsloth.md", "python", r"from taskpoint_unsloth import",
            ("test_unsloth_quickstart",)),
    Covered("docs/object-stores.md", "python", r'taskpoint\.Checkpoint\("s3://',
            ("test_object_store_block_constructs_checkpoints", "test_object_store_block_on_a_server")),
    Covered("docs/store-format.md", "", r"<root>/<task>/<run id>/", ("test_store_layout_block",)),
    Covered("docs/store-format.md", "json", r'"format": 1', ("test_manifest_block",)),
    Covered("docs/frameworks/flyte.md", "python", r"flyte\.ctx\(\)\.checkpoint",
            ("test_flyte_adapter_block",)),
    Covered("docs/frameworks/flyte.md", "python", r"taskpoint\.Checkpoint\.at\(f\"s3://",
            ("test_flyte_store_block",)),
    Covered("docs/cli.md", "sh", r"^taskpoint run ", ("test_command_line_block",)),
    Covered("docs/cli.md", "text", r"├── attempt 0 ", ("test_show_output_block",)),
]
"""Which tests run which block. The guides' other Python blocks run as tests of their own
(``docs/conftest.py``); their other blocks (install commands, YAML, sample output) are
illustrations."""


def _matches(entry: Covered, block: Block) -> bool:
    return (
        block.page == REPO / entry.page
        and entry.lang == block.lang
        and re.search(entry.pattern, block.text, re.MULTILINE) is not None
    )


def _all_blocks() -> list[Block]:
    return [b for page in [README, *guide_pages()] for b in page_blocks(page)]


def covered_block(test: str, page: str = "", lang: str | None = None) -> Block:
    """The one block :data:`COVERAGE` assigns to the test named ``test`` (on ``page``, in
    ``lang``, for a test that runs several blocks)."""
    (entry,) = [
        e for e in COVERAGE
        if test in e.tests and (not page or e.page == page) and (lang is None or e.lang == lang)
    ]
    found = [b for b in page_blocks(REPO / entry.page) if _matches(entry, b)]
    assert len(found) == 1, f"{test}: {len(found)} blocks of {entry.page} match {entry.pattern!r}"
    return found[0]


def test_every_block_is_run() -> None:
    readme = page_blocks(README)
    assert readme, "README.md has no code blocks"
    blocks = _all_blocks()
    for block in blocks:
        claims = [e.pattern for e in COVERAGE if _matches(e, block)]
        assert len(claims) <= 1, f"{block} is claimed by several COVERAGE entries: {claims}"
        if block.page == README:
            assert claims, (
                f"{block} is run by no test: add an entry to COVERAGE in tests/test_docs.py "
                "and a test that runs it"
            )
    for entry in COVERAGE:
        matched = [b for b in blocks if _matches(entry, b)]
        assert len(matched) == 1, f"COVERAGE entry {entry.pattern!r} matches {len(matched)} blocks"
        for test in entry.tests:
            assert callable(globals().get(test)), f"COVERAGE names {test}, which does not exist"


def test_every_guide_python_block_is_collected() -> None:
    """pytest-markdown-docs runs a block whose language is ``python`` and whose info string
    does not say ``notest``; ``docs/conftest.py`` collects every guide page."""
    python = [b for b in _all_blocks() if b.page != README and b.lang in ("python", "py", "python3")]
    assert len(python) >= 20, f"only {len(python)} Python blocks in the guides"
    for block in python:
        assert "notest" not in block.info.split(), f"{block} is never run: drop `notest`"
        if block.info.startswith("{"):
            assert block.info.startswith("{.python") and block.info.endswith("}"), (
                f"{block}: write options as ```{{.python fixture:NAME}}``` (superfences syntax)"
            )
    assert not [b for b in _all_blocks() if b.lang in ("pycon", "ipython")], "untested console blocks"


def test_examples_import_taskpoint_as_itself() -> None:
    """A reader copies from the examples: each names taskpoint ``taskpoint`` (they once
    imported it ``as flyte``, which reads as if Flyte were needed)."""
    examples = sorted((REPO / "examples").glob("*.py"))
    assert len(examples) >= 9
    for example in examples:
        tree = ast.parse(example.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                renamed = [a.asname for a in node.names if a.name.startswith("taskpoint") and a.asname]
                assert not renamed, f"{example.name} imports taskpoint as {renamed}"
        assert "flyte." not in example.read_text(encoding="utf-8"), example.name


def _section(page: Path, heading: str) -> str:
    """The text of ``page`` under ``heading`` (a ``## `` line), up to the next one."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize(
    ("page", "heading"),
    [
        ("README.md", "Use it"),
        ("docs/getting-started.md", "A task that fails and resumes"),
        *[(f"docs/frameworks/{name}.md", "Quickstart")
          for name in ("pytorch", "lightning", "hf", "sklearn", "unsloth")],
    ],
)
def test_quickstarts_say_how_a_rerun_resumes(page: str, heading: str) -> None:
    """Where a user starts, the page says that re-running a script starts over, and how to
    resume after losing the whole machine: a fixed run id."""
    section = _section(REPO / page, heading)
    assert "run_id=" in section and "TASKPOINT_RUN_ID=" in section, (page, heading)
    assert re.search(r"whole\s+machine", section), (page, heading)


def test_readme_links_resolve() -> None:
    """The README's relative links (to the guides, examples and adapters) name files that exist."""
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert links, "the README links to no guide"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    assert "docs/store-format.md" in links, "the README must link the store format (the contract)"


# -- running python blocks ----------------------------------------------------------------

YOUR_CODE: dict[str, str] = {
    "train_step": "one step of the reader's work (`train_step(step)`)",
    "train_one_epoch": "one epoch of the reader's PyTorch training loop",
    "make_model": "builds the reader's model (a LightningModule for Lightning)",
    "make_loader": "the reader's training DataLoader",
    "make_dataset": "the reader's training dataset",
    "next_chunk": "the reader's next (x, y) chunk for partial_fit, drawn from an RNG",
    "load_lora_model": "FastLanguageModel.from_pretrained + get_peft_model -> (model, tokenizer)",
    "make_sft_config": "the reader's SFTConfig",
    "make_model_and_optimizer": "the reader's model and optimizer",
    "evaluate": "the reader's evaluation, returning a float",
}
"""Names blocks use for the reader's own code, and what each stands for."""


def free_names(source: str) -> set[str]:
    """Names ``source`` reads but never binds (imports, assignments, defs, arguments)."""
    tree = ast.parse(source)
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound - set(dir(builtins))


def check_free_names(block: Block, provided: set[str]) -> None:
    """The block needs exactly ``provided`` from outside, each documented in YOUR_CODE."""
    undocumented = sorted(provided - YOUR_CODE.keys())
    assert not undocumented, f"document {undocumented} in YOUR_CODE"
    assert free_names(block.text) == provided, (
        f"{block} uses {sorted(free_names(block.text))} without defining them; "
        f"the test supplies {sorted(provided)}"
    )


@pytest.fixture
def block_module() -> Iterator[Callable[..., types.ModuleType]]:
    """``run(block, **your_code)``: execute a python block as a module and return it.

    The module is importable by name while the test runs (Flyte looks its tasks up there),
    and tracebacks point at the page's lines.
    """
    names: list[str] = []

    def run(block: Block, **your_code: Any) -> types.ModuleType:
        check_free_names(block, set(your_code))
        name = f"docs_block_{block.page.stem.replace('-', '_')}_{block.line}"
        module = types.ModuleType(name)
        module.__file__ = str(block.page)
        module.__dict__.update(your_code)
        sys.modules[name] = module
        names.append(name)
        exec(compile("\n" * block.line + block.text, str(block.page), "exec"), module.__dict__)
        return module

    yield run
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, so the default root (``.taskpoint/checkpoints``) is fresh."""
    for name in ENV_CONTRACT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


class SimulatedCrash(RuntimeError):
    """What a step function raises once, on purpose, as a dying attempt would."""


class Recorder:
    """Stands in for a step of the reader's code: records a value per call, and raises
    :class:`SimulatedCrash` on call number ``crash_at`` (once)."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.calls: list[Any] = []

    def hit(self, value: Any) -> None:
        self.calls.append(value)
        if len(self.calls) == self.crash_at:
            raise SimulatedCrash(f"simulated crash at call {self.crash_at} ({value!r})")


def attempt() -> int:
    """The running taskpoint attempt's number."""
    context = taskpoint.ctx()
    assert context is not None and context.attempt is not None
    return context.attempt


def committed_attempts(root: Path) -> set[int]:
    """The attempts that committed the checkpoints left under a local root."""
    return {int(p.name[:6]) for p in root.glob("*/*/checkpoints/*.manifest.json")}


# -- Use it ---------------------------------------------------------------------------------


def test_use_it_block(workdir: Path, block_module: Callable[..., types.ModuleType]) -> None:
    steps = Recorder(crash_at=6)  # attempt 0 dies in step 5, after committing 5 steps
    module = block_module(
        covered_block("test_use_it_block"),
        train_step=lambda step: steps.hit((attempt(), step)),
    )
    assert module.train() == 100
    assert steps.calls == [(0, s) for s in range(6)] + [(1, s) for s in range(5, 100)]


def _child_env(**extra: str) -> dict[str, str]:
    """This environment minus what would point ``uv``/taskpoint elsewhere, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", *ENV_CONTRACT)
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # children would recompile torch otherwise
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unsloth_quickstart(tmp_path: Path, uv: str) -> None:
    """Runs in Unsloth's environment (its pins conflict with this one), through
    ``tests/docs_blocks/unsloth_block.py``, which supplies the reader's code and checks nothing
    itself; the assertions are here."""
    block = covered_block("test_unsloth_quickstart")
    check_free_names(block, {"load_lora_model", "make_sft_config", "make_dataset"})
    if not (REPO / ".venv-unsloth").is_dir() and not _servers.in_ci():
        pytest.skip(
            "Unsloth's environment is not installed (about 3 GB); create it with "
            "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv sync --frozen --only-group unsloth`"
        )
    source = tmp_path / "block.py"
    source.write_text("\n" * block.line + block.text)
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run(
        [uv, "run", "--frozen", "--only-group", "unsloth", "--project", str(REPO),
         "python", str(FIXTURES / "unsloth_block.py"), str(source)],
        cwd=run, env=_child_env(UV_PROJECT_ENVIRONMENT=str(REPO / ".venv-unsloth")),
        capture_output=True, text=True, timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    # 10 steps, checkpoint every 4; attempt 0 dies in step 7, attempt 1 resumes at step 4.
    assert result["forwards"] == [0] * 7 + [1] * 6
    assert result["checkpoints"] == ["checkpoint-10", "checkpoint-8"]


# -- the first screen -----------------------------------------------------------------------


def _commands(block: Block) -> list[str]:
    """The block's command lines, comments stripped."""
    return [line.split("#", 1)[0].strip() for line in block.text.splitlines() if line.strip()]


SAMPLE_HOME = "/home/me/project"
"""Where the getting-started guide's sample output says the example ran (16 characters, as
the temporary folder it ran in: the lines break where they would have)."""


@pytest.fixture(scope="module")
def first_screen_run(uv: str) -> Iterator[tuple[Path, str]]:
    """``examples/pytorch_checkpoint.py`` run as the README's first command says, in an
    empty folder of 16 characters (``/tmp/tp-XXXXXXXX``): that folder and what it printed."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    assert len(str(workdir)) == len(SAMPLE_HOME)
    try:
        # As written, from the repository root. Here from an empty directory (the example
        # writes its checkpoints under the working directory): `--project` names the
        # repository, and `--locked` fails instead of rewriting uv.lock when it is out of date.
        proc = subprocess.run(
            [uv, "run", "--locked", "--project", str(REPO),
             "python", str(REPO / "examples" / "pytorch_checkpoint.py")],
            cwd=workdir, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-8000:]
        yield workdir, proc.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.slow
def test_first_screen_example_command(first_screen_run: tuple[Path, str]) -> None:
    block = covered_block("test_first_screen_example_command", "README.md")
    assert _commands(block) == ["uv run python examples/pytorch_checkpoint.py", "uv run pytest"]
    stdout = first_screen_run[1]
    assert re.findall(r"^attempt (\d): starting at epoch (\d+)", stdout, re.MULTILINE) == [
        ("0", "0"), ("1", "3"), ("2", "6"), ("3", "9")
    ]
    assert "resumed from the checkpoint" in stdout
    assert "identical: True" in stdout
    # The getting-started guide shows the same commands, and this run's output, line for
    # line (the run id and the two predictions aside).
    guide = "docs/getting-started.md"
    assert _commands(covered_block("test_first_screen_example_command", guide, "sh")) == _commands(block)
    shown = covered_block("test_first_screen_example_command", guide, "text")

    def normal(text: str) -> list[str]:
        text = re.sub(r"\d{8}T\d{6}Z-[0-9a-f]+", "RUN", text)
        text = re.sub(r"(run:\s+)\S+", r"\1X", text)
        return [line.rstrip() for line in text.splitlines() if line.strip()]

    assert normal(shown.text) == normal(stdout), (
        f"{guide}'s sample output is not what the example prints:\n{stdout}"
    )


RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")


def _same_show(text: str) -> str:
    """``taskpoint show``'s output without what differs between two runs of the example
    (run id, dates, times, durations, host, pid, temporary names, sizes) and without the line breaks and the tree's
    lines, which move with the widths of those."""
    text = RUN_ID.sub("RUN", text)
    # a temporary folder, before the durations: its random name may end like one ("766s")
    text = re.sub(r"\b(taskpoint-\w+-)[a-z0-9_]{8}\b", r"\1TEMP", text)
    # the goodput line's share and causes: which causes pass the shown minimum varies
    text = re.sub(r"\bgoodput \d+% of (\S+)( · badput: [^·\n]*)?", r"goodput PERCENT of \1", text)
    text = re.sub(r"\d{4}-\d{2}-\d{2}", "DATE", text)
    text = re.sub(r"\d{2}:\d{2}:\d{2}", "TIME", text)
    text = re.sub(r"\+?-?(\d+(\.\d+)?(ms|s)|\d+m\d{2}s|\d+h\d{2}m)\b", "DURATION", text)
    text = re.sub(r"\S+ pid \d+", "HOST pid PID", text)
    text = re.sub(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "SIZE", text)  # pickles vary a little
    return re.sub(r"[\s│├└─·]+", "", text)


@pytest.mark.slow
def test_getting_started_show_sample(first_screen_run: tuple[Path, str]) -> None:
    """The getting-started guide's ``taskpoint show`` sample is what the command prints, piped
    (100 columns), after the guide's first command: the same lines, times and run id aside.
    ``TASKPOINT_UPDATE_DOCS=1`` writes this run's output in its place."""
    workdir, _ = first_screen_run
    exe = Path(sys.executable).with_name("taskpoint")
    guide = DOCS / "getting-started.md"
    commands = _commands(covered_block("test_getting_started_show_sample", lang="sh"))
    assert commands[0] == "uv run taskpoint ls"
    (page_run,) = RUN_ID.findall(commands[1])
    (action,) = [p.name for p in (workdir / ".taskpoint" / "checkpoints").iterdir()]
    (real_run,) = [p.name for p in (workdir / ".taskpoint" / "checkpoints" / action).iterdir()]
    assert commands[1] == f"uv run taskpoint show {action}/{page_run}"
    proc = subprocess.run(
        [str(exe), "show", f"{action}/{real_run}"], cwd=workdir,
        env=_child_env(COLUMNS="100", TZ="UTC"), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = proc.stdout.replace(str(workdir), SAMPLE_HOME).replace(real_run, page_run)
    shown = covered_block("test_getting_started_show_sample", lang="text")
    if os.environ.get("TASKPOINT_UPDATE_DOCS") == "1":
        page = guide.read_text(encoding="utf-8")
        guide.write_text(page.replace(shown.text, printed, 1), encoding="utf-8")
        shown = covered_block("test_getting_started_show_sample", lang="text")
    assert _same_show(shown.text) == _same_show(printed), (
        f"{guide}'s taskpoint show sample is out of date: rerun this test with "
        f"TASKPOINT_UPDATE_DOCS=1. It prints:\n{printed}"
    )


LINUX_311 = {
    "python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
}
"""The platform the README's package counts are for."""


def _locked_packages(uv: str, *options: str) -> int:
    """How many packages ``uv sync`` with ``options`` installs on :data:`LINUX_311`, from
    ``uv.lock`` (``uv export``, each requirement's marker evaluated)."""
    from packaging.markers import Marker

    proc = subprocess.run(
        [uv, "export", "--frozen", "--no-hashes", "--format", "requirements-txt", *options],
        cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    count = 0
    for line in proc.stdout.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "--")):
            continue
        marker = line.partition(";")[2].strip()
        if not marker or Marker(marker).evaluate(environment=LINUX_311):  # type: ignore[arg-type]
            count += 1
    return count


def test_first_screen_says_what_the_commands_install(uv: str) -> None:
    """The README's install figures are the lock's: the whole workspace, the PyTorch
    adapter alone and core alone."""
    text = " ".join(README.read_text(encoding="utf-8").split())
    whole = _locked_packages(uv)
    assert f"the whole workspace, every framework included: {whole} packages" in text
    for package in ("taskpoint-pytorch", "taskpoint"):
        count = _locked_packages(uv, "--package", package)
        assert re.search(
            rf"`uv run --package {package} python examples/\w+\.py`[^.]*? {count} packages", text
        ), (package, count)


@pytest.mark.slow
def test_first_screen_pytest_command(uv: str) -> None:
    block = covered_block("test_first_screen_pytest_command")
    assert "uv run pytest" in _commands(block)
    # `uv run pytest` would run this test again, and everything else: collecting (in-process,
    # -n 0, so pytest-xdist prints the usual "N tests collected", or "N/M" where some are
    # deselected) proves the command, environment and every test module are valid without
    # recursing.
    proc = subprocess.run(
        [uv, "run", "--locked", "pytest", "--collect-only", "-q", "-n", "0"],
        cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert re.search(r"^\d+(/\d+)? tests collected", proc.stdout, re.MULTILINE), proc.stdout[-2000:]
    assert "tests/test_docs.py::test_every_block_is_run" in proc.stdout


# -- object stores ----------------------------------------------------------------------


def _checkpoint_calls(block: Block) -> list[ast.expr]:
    """The block's top-level ``taskpoint.Checkpoint(...)`` expressions."""
    calls = [
        node.value for node in ast.parse(block.text).body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
    ]
    assert calls, f"{block} constructs no checkpoint"
    return calls


def _evaluate(call: ast.expr) -> Any:
    return eval(compile(ast.Expression(call), str(README), "eval"), {"taskpoint": taskpoint})


def test_object_store_block_constructs_checkpoints(
    block_module: Callable[..., types.ModuleType],
) -> None:
    block = covered_block("test_object_store_block_constructs_checkpoints")
    block_module(block)  # runs as written: constructing connects to nothing yet
    calls = _checkpoint_calls(block)
    urls = []
    for call in calls:
        assert isinstance(call, ast.Call)
        url = ast.literal_eval(call.args[0])
        checkpoint = _evaluate(call)
        assert isinstance(checkpoint, taskpoint.Checkpoint)
        assert checkpoint.url == url
        urls.append(url.split("://")[0])
    assert urls == ["s3", "gs", "az"]


class _Fill(ast.NodeTransformer):
    """Replaces each occurrence of a placeholder string with the next of its real values."""

    def __init__(self, values: dict[str, list[str]]) -> None:
        self.values = {k: list(v) for k, v in values.items()}

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str) and node.value in self.values:
            return ast.copy_location(ast.Constant(self.values[node.value].pop(0)), node)
        return node


def _server(request: pytest.FixtureRequest, kind: str) -> Any:
    """The suite's ``kind`` server (``conftest.py``), unless ``TASKPOINT_TEST_STORES`` leaves
    it out, as it does for every other test."""
    selected = os.environ.get("TASKPOINT_TEST_STORES", "").strip()
    if selected and kind not in [k.strip() for k in selected.split(",")]:
        pytest.skip(f"TASKPOINT_TEST_STORES={selected} leaves out {kind}")
    return request.getfixturevalue(f"{kind}_server")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_object_store_block_on_a_server(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each URL of the block on a real server: through the backend's usual environment
    variables (the fixtures set them), and for S3 through the block's own
    ``storage_options`` with its placeholders filled in."""
    server = _server(request, kind)
    scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[kind]
    block = covered_block("test_object_store_block_on_a_server")
    (call,) = [
        c for c in _checkpoint_calls(block)
        if isinstance(c, ast.Call) and ast.literal_eval(c.args[0]).startswith(f"{scheme}://")
    ]
    assert isinstance(call, ast.Call)
    url = ast.literal_eval(call.args[0])
    bucket = url.split("://")[1].split("/")[0]
    if not server.filesystem().exists(bucket):
        server.create_bucket(bucket)

    env_route = taskpoint.Checkpoint(url)
    env_route.save_sync(f"{kind} through the environment".encode())
    restored = env_route.load_sync()
    assert restored is not None and restored.read_bytes() == f"{kind} through the environment".encode()

    if kind == "s3":
        for name in server.environment():
            monkeypatch.delenv(name)
        fill = _Fill({"...": [server.key, server.secret], "https://minio.local:9000": [server.endpoint]})
        tree = ast.fix_missing_locations(fill.visit(ast.Expression(call)))
        assert all(not left for left in fill.values.values()), "the block's placeholders changed"
        options_route = _evaluate(tree.body)
        options_route.save_sync(b"s3 through storage_options")
        restored = options_route.load_sync()
        assert restored is not None and restored.read_bytes() == b"s3 through storage_options"


# -- store layout and manifest -------------------------------------------------------------


PLACEHOLDERS = {
    "<attempt:06d>": r"\d{6}",
    "<seq:09d>": r"\d{9}",
    "<token>": r"[0-9a-f]+",
    "<hash>": r"[0-9a-f]{32}",
    "<session>": r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "<round:06d>": r"\d{6}",
    "<rank:06d>": r"\d{6}",
}


def _layout_patterns(block: Block) -> tuple[str, list[re.Pattern[str]]]:
    """The block's action line, and a regex per path below it."""
    head, *rows = [line for line in block.text.splitlines() if line.strip()]
    action = re.split(r"\s{2,}", head.strip())[0]
    patterns = []
    for row in rows:
        path = re.split(r"\s{2,}", row.strip())[0]
        regex = re.escape(path)
        for placeholder, pattern in PLACEHOLDERS.items():
            regex = regex.replace(re.escape(placeholder), pattern)
        assert "<" not in regex, f"{block}: unknown placeholder in {path!r}"
        patterns.append(re.compile(regex))
    return action, patterns


def test_store_layout_block(workdir: Path) -> None:
    action_line, patterns = _layout_patterns(covered_block("test_store_layout_block"))
    assert action_line == "<root>/<task>/<run id>/"
    root = workdir / "root"

    env = taskpoint.TaskEnvironment(name="readme", root=str(root))
    crashes = Recorder(crash_at=3)

    @env.task(retries=1, backoff=0)
    def works(steps: int = 4) -> int:
        ckpt = taskpoint.ctx().checkpoint
        assert ckpt is not None
        prev = ckpt.load_sync()
        for step in range(int(prev.read_bytes()) if prev else 0, steps):
            crashes.hit(step)
            ckpt.save_sync(str(step + 1).encode())
        return steps

    @env.task(retries=1, backoff=0)
    def fails() -> None:
        ckpt = taskpoint.ctx().checkpoint
        assert ckpt is not None
        ckpt.save_sync(b"state")
        raise SimulatedCrash("every attempt fails")

    assert works() == 4
    with pytest.raises(SimulatedCrash):
        fails()
    for _ in range(2):  # outside the runtime, the store numbers the attempts
        bound = taskpoint.Checkpoint.at(root / "plain.job" / "run-1")
        bound.load_sync()
        taskpoint.SaveInterval.for_checkpoint(bound, 600)  # saves by time: its interval recorded
        bound.save_sync(b"state")
    tree = workdir / "tree"
    tree.mkdir()
    (tree / "weights.bin").write_bytes(b"w" * 1000)
    taskpoint.Checkpoint.at(root / "plain.job" / "run-1", keep=3).save_sync(tree)  # format 2
    coordinator = taskpoint.StoreCoordinator(
        str(root / "plain.job" / "run-1"), rank=0, world_size=1, session="job-7"
    )
    taskpoint.Checkpoint.at(root / "plain.job" / "run-1", keep=3).save_part_sync(
        tree, coordinator=coordinator
    )

    actions = sorted(p for p in root.glob("*/*") if p.is_dir())
    assert [a.relative_to(root).parts[0] for a in actions] == ["plain.job", "readme.fails", "readme.works"]
    seen: set[re.Pattern[str]] = set()
    states = set()
    for action in actions:
        for path in sorted(p for p in action.rglob("*") if p.is_file()):
            relative = path.relative_to(action).as_posix()
            matching = [p for p in patterns if p.fullmatch(relative)]
            assert matching, f"{relative} (in {action.relative_to(root)}) is not in the README's layout"
            seen.update(matching)
            if relative == "status.json":
                states.add(json.loads(path.read_text())["state"])
    assert seen == set(patterns), f"never written: {[p.pattern for p in set(patterns) - seen]}"
    assert states == {"succeeded", "failed"}


def test_manifest_block() -> None:
    from taskpoint.format.manifest import Manifest

    text = covered_block("test_manifest_block").text
    assert text.count("…") == 1, "the checksum is the block's only placeholder"
    data = text.replace("…", "0" * 32).encode()
    manifest = Manifest.from_json(data, url="README.md")
    tree_only = {"entries", "objects", "parts"}  # format-2 fields, described in the prose below it
    assert set(json.loads(data)) == {f.name for f in fields(Manifest)} - tree_only, "the example shows every field"
    assert Manifest.from_json(manifest.to_json(), url="README.md") == manifest
    assert re.fullmatch(r"\d{6}-\d{9}-[0-9a-f]+\.payload", manifest.payload)
    assert manifest.payload.startswith(manifest.key.removesuffix(".manifest.json"))


# -- Flyte ----------------------------------------------------------------------------------


@pytest.fixture
def flyte_local(tmp_path: Path, workdir: Path) -> Callable[..., Any]:
    """``run(task, *args)``: a real local Flyte run with Flyte's own retries; its output."""
    import flyte

    flyte.init()

    def run(task: Any, *args: Any) -> Any:
        raw = str(tmp_path / "flyte-raw")
        return flyte.with_runcontext(mode="local", raw_data_path=raw).run(task, *args).outputs()[0]

    return run


@pytest.mark.slow
def test_flyte_adapter_block(
    flyte_local: Callable[..., Any], block_module: Callable[..., types.ModuleType]
) -> None:
    import torch

    epochs = Recorder(crash_at=4)  # Flyte's attempt 1 dies in epoch 3, after saving 3

    def make_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def train_one_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        epochs.hit(None)
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    def evaluate(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(model(torch.ones(1, 4)).item())

    module = block_module(
        covered_block("test_flyte_adapter_block"),
        make_model_and_optimizer=make_model_and_optimizer,
        train_one_epoch=train_one_epoch,
        evaluate=evaluate,
    )
    assert isinstance(flyte_local(module.train), float)
    assert len(epochs.calls) == 4 + 7, "the retry resumed at epoch 3 of 10 from Flyte's checkpoint"


@pytest.mark.slow
def test_flyte_store_block(
    flyte_local: Callable[..., Any],
    block_module: Callable[..., types.ModuleType],
    request: pytest.FixtureRequest,
) -> None:
    s3_server = _server(request, "s3")
    block = covered_block("test_flyte_store_block")
    (bucket,) = re.findall(r"s3://([^/]+)/", block.text)
    s3_server.create_bucket(bucket)  # unless an earlier test made it
    steps = Recorder(crash_at=6)  # Flyte's attempt 1 dies in step 5, after saving 5
    module = block_module(block, train_step=steps.hit)
    assert flyte_local(module.train) == 1000
    assert steps.calls == list(range(6)) + list(range(5, 1000)), "the retry resumed at step 5"
    (action,) = [
        "s3://" + p for p in s3_server.filesystem().find(f"{bucket}/ckpt", withdirs=True)
        if p.endswith("/checkpoints")
    ]
    final = taskpoint.Checkpoint(action.removesuffix("/checkpoints")).load_sync()
    assert final is not None and final.read_bytes() == b"1000"


# -- the command line ---------------------------------------------------------------------

CLI_VALUES = {
    "[--root URL]": "--root .taskpoint/checkpoints",
    "[--run-id ID]": "--run-id {run}",
    "[ROOT]": ".taskpoint/checkpoints",
    "[--json]": "--json",
    "[--no-verify]": "--no-verify",
    "[--force]": "",
    "TASK/RUN": "train.train/r1",
    "DEST": "pulled",
    "--keep K": "--keep 0",
}
"""What the test puts in place of each placeholder of the command-line block."""


@pytest.mark.slow
def test_command_line_block(workdir: Path) -> None:
    shutil.copy(FIXTURES / "train.py", workdir / "train.py")
    exe = Path(sys.executable).with_name("taskpoint")
    assert exe.exists(), f"the taskpoint console script is not installed next to {sys.executable}"
    outputs: dict[str, list[str]] = {}
    for template in _commands(covered_block("test_command_line_block")):
        for placeholder, value in CLI_VALUES.items():
            template = template.replace(placeholder, value)
        assert not re.search(r"\[|\b[A-Z]{2,}\b", template), f"unfilled placeholder in {template!r}"
        runs = ["r1", "r2"] if template.startswith("taskpoint run") else ["r1"]
        for run in runs:
            command = shlex.split(template.format(run=run))
            assert command[0] == "taskpoint"
            proc = subprocess.run(
                [str(exe), *command[1:]], cwd=workdir, env=_child_env(),
                capture_output=True, text=True, timeout=120,
            )
            assert proc.returncode == 0, f"{template}\n{proc.stdout}\n{proc.stderr}"
            outputs.setdefault(command[1], []).append(proc.stdout)
    assert set(outputs) == {"run", "ls", "show", "pull", "rm", "gc"}
    for out in outputs["run"]:
        assert json.loads(out) == {"attempt": 1, "resumed_at": 3}, "attempt 1 resumed at step 3"
    listing = json.loads(outputs["ls"][0])
    assert sorted(a["action"] for a in listing["actions"]) == ["train.train/r1", "train.train/r2"]
    assert json.loads(outputs["show"][0])["state"] == "succeeded"
    assert (workdir / "pulled").read_bytes() == b"100"
    assert outputs["rm"] == ["removed train.train/r1\n"]
    assert outputs["gc"] == ["removed 1 checkpoint(s) under .taskpoint/checkpoints\n"]
    checkpoints = workdir / ".taskpoint" / "checkpoints" / "train.train"
    assert not (checkpoints / "r1").exists()
    assert not list((checkpoints / "r2").glob("checkpoints/*.manifest.json"))



def _show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *options: str, columns: int = 160
) -> str:
    """``taskpoint show`` of the run ``test_cli_show.contract_run`` writes (times in UTC,
    ``columns`` wide), its root written ``file:///data/ckpt``; returns what it printed."""
    import time

    from click.testing import CliRunner
    from taskpoint.cli import main
    from test_cli_show import ACTION, contract_run

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        root = tmp_path / "store"
        contract_run(root)
        result = CliRunner().invoke(
            main, ["show", ACTION, "--root", f"file://{root}", *options],
            env={"COLUMNS": str(columns)},
        )
    finally:
        monkeypatch.undo()
        time.tzset()
    assert result.exit_code == 0, result.output
    return result.output.replace(f"file://{root}", "file:///data/ckpt")


def test_show_output_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample ``taskpoint show`` output is what it prints for the run it describes."""
    shown = _show(tmp_path, monkeypatch)
    assert covered_block("test_show_output_block").text == shown


def offline_svg(svg: str) -> str:
    """``svg`` without its web fonts: rich's SVG export loads Fira Code from a CDN, which the
    docs site must not reach; the reader's monospace font draws it instead."""
    svg = re.sub(r"@font-face\s*\{[^}]*\}\s*", "", svg)
    assert not re.search(r"url\((?!#)|(?:src|href)=", svg), "the picture still loads something"
    return svg


def test_show_picture_is_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``docs/assets/taskpoint-show.svg`` is what ``taskpoint show --svg`` draws for the run
    the command-line guide describes. ``TASKPOINT_UPDATE_DOCS=1`` writes it anew."""
    import tempfile

    picture = tmp_path / "show.svg"
    # 100 columns keep the picture legible on a page. The header names the store: a short
    # temporary path (always 15 characters) keeps it on one line, wherever pytest's own
    # temporary folder is.
    short = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    try:
        _show(short, monkeypatch, "--svg", str(picture), columns=100)
    finally:
        shutil.rmtree(short)
    svg = offline_svg(picture.read_text(encoding="utf-8"))
    # As in the text sample, the store is file:///data/ckpt: each <text> holding the root
    # gets the length rich gives its characters (12.2 units each), and rich's id (a hash of
    # the content, temporary path included) a fixed name.
    root = f"file://{short / 'store'}"

    def relocate(found: re.Match[str]) -> str:
        text = found.group(3).replace(root, "file:///data/ckpt")
        length = 12.2 * len(html.unescape(text))
        return f'{found.group(1)}textLength="{length:g}"{found.group(2)}>{text}</text>'

    svg = re.sub(
        r'(<text [^>]*?)textLength="[^"]*"([^>]*)>([^<]*' + re.escape(root) + r"[^<]*)</text>",
        relocate, svg,
    )
    svg = re.sub(r"terminal-\d+", "terminal-taskpoint-show", svg)
    if os.environ.get("TASKPOINT_UPDATE_DOCS") == "1":
        SHOW_PICTURE.write_text(svg, encoding="utf-8")
    assert SHOW_PICTURE.read_text(encoding="utf-8") == svg, (
        "docs/assets/taskpoint-show.svg is out of date: rerun this test with TASKPOINT_UPDATE_DOCS=1"
    )


def test_benchmark_figures_are_current() -> None:
    """The benchmarks guide's table and ``docs/assets/bench-checkpoint.svg`` are what
    ``docs/_bench_plots.py`` makes of ``bench/results.json``, so a new benchmark run shows
    in the docs or fails here. ``TASKPOINT_UPDATE_DOCS=1`` rewrites the picture."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_plots", DOCS / "_bench_plots.py")
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    results = json.loads((REPO / "bench" / "results.json").read_text(encoding="utf-8"))
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert plots.table(results) in page, (
        "docs/benchmarks.md's first table is not bench/results.json's: paste "
        "docs/_bench_plots.table(results) in its place"
    )
    figure = DOCS / "assets" / "bench-checkpoint.svg"
    if os.environ.get("TASKPOINT_UPDATE_DOCS") == "1":
        figure.write_text(plots.figure(results), encoding="utf-8")
    assert figure.read_text(encoding="utf-8") == plots.figure(results), (
        "docs/assets/bench-checkpoint.svg is out of date: rerun this test with TASKPOINT_UPDATE_DOCS=1"
    )


def test_docs_site_loads_nothing_from_the_network() -> None:
    """The site works offline: no web fonts, highlighting at build time, and no Mermaid
    diagram (Material would fetch Mermaid from a CDN for one)."""
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^  font: false$", config, re.MULTILINE), "mkdocs.yml must set theme.font: false"
    assert re.search(r"use_pygments: true", config)
    assert "extra_javascript" not in config
    for page in guide_pages():
        assert not [b for b in page_blocks(page) if b.lang == "mermaid"], f"{page}: a Mermaid block"
        assert not re.search(r"<(script|iframe|link)\b", page.read_text(encoding="utf-8")), page


# -- the built site -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_site(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built as CONTRIBUTING.md says (its own environment, ``--strict``)."""
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [uv, "run", "--frozen", "--only-group", "docs", "mkdocs", "build", "--strict",
         "--site-dir", str(site)],
        cwd=REPO, env=_child_env(UV_PROJECT_ENVIRONMENT=".venv-docs", NO_MKDOCS_2_WARNING="1"),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return site


def _chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


@pytest.mark.slow
def test_site_search_works_from_disk(built_site: Path) -> None:
    """The README says to open ``site/index.html`` from disk. There the search index must be
    a script (the ``offline`` plugin) and the search worker run without a web worker (our
    ``iframe-worker.js``; Material's own shim comes from a CDN); no page loads a script from
    the network. Where Chromium is installed, a search on the page opened from file://
    finds pages."""
    index = (built_site / "search" / "search_index.js").read_text(encoding="utf-8")
    assert index.startswith("var __index = {"), "the search index is not inlined as a script"
    assert '"location":"getting-started.html' in index, "links work from disk (no directory URLs)"
    for page in built_site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"<script[^>]+src=\"(https?:)?//", text), f"{page} loads a script"
        if page.name == "index.html" and page.parent == built_site:
            assert '<script src="assets/javascripts/iframe-worker.js"' in text
    browser = _chromium()
    if browser is None:
        pytest.skip("the search was checked as files only: no Chromium to open the site with")
    proc = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu",
         "--virtual-time-budget=20000", "--dump-dom",
         f"{(built_site / 'index.html').as_uri()}?q=preemption"],
        capture_output=True, text=True, timeout=180,
    )
    found = re.search(r'md-search-result__meta">(\d+) matching documents?<', proc.stdout)
    assert found and int(found.group(1)) > 0, f"no search results from file://:\n{proc.stderr[-3000:]}"


def test_api_reference_names_no_private_base_or_dunder(built_site: Path) -> None:
    """The API pages show what a user calls: no ``Bases:`` naming a class from a private
    module (``Checkpoint`` is made of ``Loading``, ``Records`` ... in ``_``-modules), and no
    ``__dunder__`` member in the text or the table of contents."""
    pages = sorted((built_site / "api").glob("*.html"))
    assert len(pages) >= 6
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for bases in re.findall(r"Bases: (.*?)</p>", text, re.DOTALL):
            private = re.findall(r'title="\s*(?:\w+ \()?([\w.]*\._\w[\w.]*)', bases)
            assert not private, f"{page.name} names private bases {private}"
        dunders = re.findall(r'id="((?:taskpoint\w*\.)[\w.]*\.__\w+__)"', text)
        assert not dunders, f"{page.name} documents {dunders}"
    checkpoint = (built_site / "api" / "taskpoint.html").read_text(encoding="utf-8")
    for inherited in ("save_sync", "load_sync", "prune", "mark_started"):
        assert f'id="taskpoint.Checkpoint.{inherited}"' in checkpoint, "inherited methods stay"


FITS = """<script>
addEventListener("load", () => {
  const page = document.querySelector(".md-content__inner");
  const wide = [...page.querySelectorAll("table")]
    .filter((table) => table.scrollWidth > page.clientWidth)
    .map((table) => table.rows[0].cells.length + " columns, " + table.scrollWidth + "px");
  document.body.setAttribute("data-page-width", String(page.clientWidth));
  document.body.setAttribute("data-too-wide", JSON.stringify(wide));
});
</script></body>"""
"""Measures, in the browser, each table of a page against the page's text column."""


@pytest.mark.slow
def test_benchmark_tables_fit_the_page(built_site: Path) -> None:
    """Every table of the benchmarks page fits the text column of a 1280-pixel-wide window
    (the first one has ten columns)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("needs Chromium to lay the page out")
    page = built_site / "benchmarks.html"
    probe = built_site / "benchmarks-probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", FITS, 1), encoding="utf-8")
    proc = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000",
         "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    width = re.search(r'data-page-width="(\d+)"', proc.stdout)
    found = re.search(r'data-too-wide="([^"]*)"', proc.stdout)
    assert width and found, f"the page did not load:\n{proc.stderr[-3000:]}"
    assert json.loads(html.unescape(found.group(1))) == [], (
        f"tables wider than the {width.group(1)}px column: {html.unescape(found.group(1))}"
    )
