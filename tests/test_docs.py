"""Every fenced code block in ``README.md`` runs here, for real.

:data:`COVERAGE` says which test runs which block: a block no entry claims (one added to
the README later), or an entry whose block is gone, fails :func:`test_every_block_is_run`.

- ``python`` blocks are executed. The names a block uses without defining them stand for
  the reader's own code; :data:`YOUR_CODE` documents each one, and every block's free names
  are checked against what its test supplies. The supplied step functions die once on
  purpose, like a reclaimed machine, so each task block really retries, and the test checks
  that the retry resumed from the checkpoint instead of starting over.
- ``sh`` blocks are run as commands (placeholders such as ``TASK/RUN`` replaced by real
  values), ``json`` is validated as a manifest, and the plain block (the store layout) is
  compared with the layout a real run writes.

Object-store URLs (``s3://``, ``gs://``, ``az://``) run against the suite's loopback
servers (``conftest.py``): skipped with the reason where one cannot start, failed with
``CI=true``. The Unsloth block runs in Unsloth's own environment (``.venv-unsloth``).
"""

from __future__ import annotations

import ast
import builtins
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
FIXTURES = Path(__file__).resolve().parent / "readme"
ENV_CONTRACT = ("TASKPOINT_ROOT", "TASKPOINT_ACTION", "TASKPOINT_RUN_ID", "TASKPOINT_ATTEMPT")
"""Variables that would send the blocks' checkpoints elsewhere; unset for every block."""

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")


# -- the README's blocks ------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced block: its info string, its text, and the README line of its opening fence."""

    lang: str
    text: str
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line} (```{self.lang})"


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md, in order.

    Raises:
        AssertionError: a fence is never closed.
    """
    blocks: list[Block] = []
    lines = README.read_text(encoding="utf-8").splitlines()
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, start=1):
        fence = re.match(r"^ {0,3}(```+)\s*(\S*)", line)
        if opened is None:
            if fence:
                opened, body = (fence.group(2), number), []
        elif fence and not fence.group(2):
            blocks.append(Block(opened[0], "\n".join(body) + "\n", opened[1]))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"README.md:{opened[1]}: a code fence is never closed"
    return blocks


@dataclass(frozen=True)
class Covered:
    """A block's language, a pattern only that block matches, and the tests that run it."""

    lang: str
    pattern: str
    tests: tuple[str, ...]


COVERAGE: list[Covered] = [
    Covered("sh", r"uv run python examples/pytorch_checkpoint\.py",
            ("test_first_screen_example_command", "test_first_screen_pytest_command")),
    Covered("python", r"def train\(steps: int = 100\)", ("test_use_it_block",)),
    Covered("python", r"from taskpoint_pytorch import TaskpointState\n\nenv = taskpoint",
            ("test_pytorch_quickstart",)),
    Covered("python", r"from taskpoint_lightning import", ("test_lightning_quickstart",)),
    Covered("python", r"from taskpoint_hf import", ("test_hf_quickstart",)),
    Covered("python", r"from taskpoint_sklearn import", ("test_sklearn_quickstart",)),
    Covered("python", r"from taskpoint_unsloth import", ("test_unsloth_quickstart",)),
    Covered("python", r'taskpoint\.Checkpoint\("s3://',
            ("test_object_store_block_constructs_checkpoints", "test_object_store_block_on_a_server")),
    Covered("", r"<root>/<task>/<run id>/", ("test_store_layout_block",)),
    Covered("json", r'"format": 1', ("test_manifest_block",)),
    Covered("python", r"flyte\.ctx\(\)\.checkpoint", ("test_flyte_adapter_block",)),
    Covered("python", r"taskpoint\.Checkpoint\.at\(f\"s3://", ("test_flyte_store_block",)),
    Covered("sh", r"^taskpoint run ", ("test_command_line_block",)),
    Covered("text", r"├── attempt 0 ", ("test_show_output_block",)),
]
"""Which tests run which README block."""


def _matches(entry: Covered, block: Block) -> bool:
    return entry.lang == block.lang and re.search(entry.pattern, block.text, re.MULTILINE) is not None


def readme_block(test: str) -> Block:
    """The one README block :data:`COVERAGE` assigns to the test named ``test``."""
    (entry,) = [e for e in COVERAGE if test in e.tests]
    found = [b for b in readme_blocks() if _matches(entry, b)]
    assert len(found) == 1, f"{test}: {len(found)} README blocks match {entry.pattern!r}"
    return found[0]


def test_every_block_is_run() -> None:
    blocks = readme_blocks()
    assert blocks, "README.md has no code blocks"
    for block in blocks:
        claims = [e.pattern for e in COVERAGE if _matches(e, block)]
        assert claims, (
            f"{block} is run by no test: add an entry to COVERAGE in tests/test_readme.py "
            "and a test that runs it"
        )
        assert len(claims) == 1, f"{block} is claimed by several COVERAGE entries: {claims}"
    for entry in COVERAGE:
        matched = [b for b in blocks if _matches(entry, b)]
        assert len(matched) == 1, f"COVERAGE entry {entry.pattern!r} matches {len(matched)} blocks"
        for test in entry.tests:
            assert callable(globals().get(test)), f"COVERAGE names {test}, which does not exist"


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
"""Names README blocks use for the reader's own code, and what each stands for."""


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
    and tracebacks point at README.md lines.
    """
    names: list[str] = []

    def run(block: Block, **your_code: Any) -> types.ModuleType:
        check_free_names(block, set(your_code))
        name = f"readme_block_{block.line}"
        module = types.ModuleType(name)
        module.__file__ = str(README)
        module.__dict__.update(your_code)
        sys.modules[name] = module
        names.append(name)
        exec(compile("\n" * block.line + block.text, str(README), "exec"), module.__dict__)
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
        readme_block("test_use_it_block"),
        train_step=lambda step: steps.hit((attempt(), step)),
    )
    assert module.train() == 100
    assert steps.calls == [(0, s) for s in range(6)] + [(1, s) for s in range(5, 100)]


def test_pytorch_quickstart(workdir: Path, block_module: Callable[..., types.ModuleType]) -> None:
    import torch

    epochs = Recorder(crash_at=4)  # attempt 0 dies in epoch 3, after saving 3 epochs

    def train_one_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        epochs.hit(attempt())
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    module = block_module(readme_block("test_pytorch_quickstart"), train_one_epoch=train_one_epoch)
    module.train()
    assert epochs.calls == [0] * 4 + [1] * 7, "attempt 1 resumes at epoch 3 of 10"
    assert committed_attempts(workdir / ".taskpoint" / "checkpoints") == {1}


@pytest.mark.slow
def test_lightning_quickstart(workdir: Path, block_module: Callable[..., types.ModuleType]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    # 10 batches an epoch, 3 epochs: 30 steps; the block saves every 20.
    steps = Recorder(crash_at=26)  # attempt 0 dies in step 25

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            steps.hit((attempt(), self.global_step))
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def make_model() -> Tiny:
        torch.manual_seed(0)
        return Tiny()

    def make_loader() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(40, 4, generator=generator), torch.randn(40, 1, generator=generator))
        return DataLoader(data, batch_size=4)

    module = block_module(
        readme_block("test_lightning_quickstart"), make_model=make_model, make_loader=make_loader
    )
    module.train()
    assert steps.calls == [(0, s) for s in range(26)] + [(1, s) for s in range(20, 30)]
    assert (workdir / "ckpts" / "last.ckpt").exists()


@pytest.mark.slow
def test_hf_quickstart(workdir: Path, block_module: Callable[..., types.ModuleType]) -> None:
    import torch

    # 80 rows, batches of 8 (the Trainer's default), 3 epochs: 30 steps; saved every 20.
    forwards = Recorder(crash_at=26)  # attempt 0 dies in step 26

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            forwards.hit(attempt())
            return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(80, 4, generator=generator)
            self.y = torch.randn(80, generator=generator)

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    def make_model() -> Regressor:
        torch.manual_seed(0)
        return Regressor()

    module = block_module(
        readme_block("test_hf_quickstart"), make_model=make_model, make_dataset=Rows
    )
    module.train()
    assert forwards.calls == [0] * 26 + [1] * 10, "attempt 1 resumes from checkpoint-20"
    assert sorted(p.name for p in (workdir / "out").glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-30"]


def test_sklearn_quickstart(workdir: Path, block_module: Callable[..., types.ModuleType]) -> None:
    import numpy as np

    chunks = Recorder(crash_at=4)  # attempt 0 dies in chunk 3, after saving 3 chunks

    def next_chunk(rng: np.random.Generator) -> tuple[Any, Any]:
        chunks.hit(attempt())
        x = rng.standard_normal((32, 8))
        return x, (x[:, 0] > 0).astype(int)

    module = block_module(readme_block("test_sklearn_quickstart"), next_chunk=next_chunk)
    assert isinstance(module.train(), float)
    assert chunks.calls == [0] * 4 + [1] * 7, "attempt 1 resumes at chunk 3 of 10"


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
    ``tests/readme/unsloth_block.py``, which supplies the reader's code and checks nothing
    itself; the assertions are here."""
    block = readme_block("test_unsloth_quickstart")
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


@pytest.mark.slow
def test_first_screen_example_command(tmp_path: Path, uv: str) -> None:
    block = readme_block("test_first_screen_example_command")
    assert _commands(block) == ["uv run python examples/pytorch_checkpoint.py", "uv run pytest"]
    # As written, from the repository root. Here from an empty directory (the example writes
    # its checkpoints under the working directory): `--project` names the repository, and
    # `--locked` fails instead of rewriting uv.lock when it is out of date.
    proc = subprocess.run(
        [uv, "run", "--locked", "--project", str(REPO),
         "python", str(REPO / "examples" / "pytorch_checkpoint.py")],
        cwd=tmp_path, env=_child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert re.findall(r"^attempt (\d): starting at epoch (\d+)", proc.stdout, re.MULTILINE) == [
        ("0", "0"), ("1", "3"), ("2", "6"), ("3", "9")
    ]
    assert "resumed from the checkpoint" in proc.stdout
    assert "identical: True" in proc.stdout


@pytest.mark.slow
def test_first_screen_pytest_command(uv: str) -> None:
    block = readme_block("test_first_screen_pytest_command")
    assert "uv run pytest" in _commands(block)
    # `uv run pytest` would run this test again, and everything else: collecting proves the
    # command, environment and every test module are valid without recursing.
    proc = subprocess.run(
        [uv, "run", "--locked", "pytest", "--collect-only", "-q"],
        cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert re.search(r"^\d+ tests collected", proc.stdout, re.MULTILINE), proc.stdout[-2000:]
    assert "tests/test_readme.py::test_every_block_is_run" in proc.stdout


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
    block = readme_block("test_object_store_block_constructs_checkpoints")
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
    block = readme_block("test_object_store_block_on_a_server")
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
    action_line, patterns = _layout_patterns(readme_block("test_store_layout_block"))
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
    from taskpoint.manifest import Manifest

    text = readme_block("test_manifest_block").text
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
        readme_block("test_flyte_adapter_block"),
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
    block = readme_block("test_flyte_store_block")
    (bucket,) = re.findall(r"s3://([^/]+)/", block.text)
    if not s3_server.filesystem().exists(bucket):
        s3_server.create_bucket(bucket)
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
    for template in _commands(readme_block("test_command_line_block")):
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



def test_show_output_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample ``taskpoint show`` output is what it prints for the run it describes."""
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
            main, ["show", ACTION, "--root", f"file://{root}"], env={"COLUMNS": "160"}
        )
    finally:
        monkeypatch.undo()
        time.tzset()
    assert result.exit_code == 0, result.output
    shown = result.output.replace(f"file://{root}", "file:///data/ckpt")
    assert readme_block("test_show_output_block").text == shown
