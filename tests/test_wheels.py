"""The published artifacts: one version scheme, complete metadata, installable extras.

Fast checks read the six ``pyproject.toml`` files and each package's ``__version__``: one
version everywhere, and every requirement between our distributions pinned to the range
``>=X,<next minor``.

Slow checks (``-m slow``) need ``uv``. They build every distribution (``uv build
--all-packages``, plus ``integrations/unsloth``, which is not a workspace member) into
wheels and sdists and read their metadata. Then, for each adapter extra, they install
``taskpoint[<extra>]`` into a fresh virtual environment from the built wheel files (passed
as direct file requirements, so no ``taskpoint*`` distribution can come from an index),
with every other dependency from the package index pinned to the versions in ``uv.lock``
(``uv export``; the ``unsloth`` group's fork for the unsloth extra), so the uv cache
serves them. In that environment a small script runs a task that saves a checkpoint,
fails on attempt 0, and resumes from it on attempt 1, through the adapter.

The environments sit on the uv cache's filesystem so uv hardlinks packages such as torch
instead of copying them; each is removed after its test. Without ``uv`` the slow checks
skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import ast
import email.parser
import email.policy
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("pytorch", "lightning", "hf", "sklearn", "unsloth")
CORE = "taskpoint"
DIST_DIRS: dict[str, Path] = {
    CORE: ROOT / "core",
    **{f"taskpoint-{name}": ROOT / "integrations" / name for name in ADAPTERS},
}
"""Each distribution's project directory, by distribution name."""
IMPORT_NAMES = {dist: dist.replace("-", "_") for dist in DIST_DIRS}
PROJECT_URLS = ("Homepage", "Documentation", "Source", "Changelog")
LICENSE = "Apache-2.0"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
"""The Python versions every distribution declares a classifier for."""
UNSLOTH_GROUP = "unsloth"
"""The root dependency group whose fork of ``uv.lock`` holds Unsloth's dependencies."""
BUILD_TIMEOUT = 300
INSTALL_TIMEOUT = 600
SCRIPT_TIMEOUT = 180


# --- the sources: pyproject.toml and __version__ -------------------------------------


def _pyproject(dist: str) -> dict[str, Any]:
    with (DIST_DIRS[dist] / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _source_version(dist: str) -> str:
    """``__version__`` as assigned in the package's ``__init__.py`` (read, not imported)."""
    init = DIST_DIRS[dist] / "src" / IMPORT_NAMES[dist] / "__init__.py"
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError(f"{init} assigns no string __version__")


def _compatible_range(version: str) -> SpecifierSet:
    """``>=version,<next minor``: the range a dependent pins one of our distributions to."""
    major, minor = Version(version).release[:2]
    return SpecifierSet(f">={version},<{major}.{minor + 1}")


def _our_requirements(project: dict[str, Any]) -> list[Requirement]:
    """The requirements (dependencies and every extra's) naming one of our distributions."""
    raw = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        raw.extend(extra)
    ours = {canonicalize_name(dist) for dist in DIST_DIRS}
    return [r for r in map(Requirement, raw) if canonicalize_name(r.name) in ours]


def test_one_version_everywhere() -> None:
    versions = {dist: _pyproject(dist)["version"] for dist in DIST_DIRS}
    sources = {dist: _source_version(dist) for dist in DIST_DIRS}
    core = versions[CORE]
    assert versions == dict.fromkeys(DIST_DIRS, core), "pyproject.toml versions differ"
    assert sources == dict.fromkeys(DIST_DIRS, core), "__version__ differs from pyproject.toml"


def test_our_distributions_pin_a_compatible_range() -> None:
    pin = _compatible_range(_pyproject(CORE)["version"])
    assert Version(_pyproject(CORE)["version"]) in pin
    for dist in DIST_DIRS:
        requirements = _our_requirements(_pyproject(dist))
        for req in requirements:
            assert req.specifier == pin, f"{dist} requires {req}; expected {req.name}{pin}"
        if dist != CORE:
            assert CORE in {r.name for r in requirements}, f"{dist} does not require {CORE}"
    extras = _pyproject(CORE)["optional-dependencies"]
    for name in ADAPTERS:
        assert [Requirement(r).name for r in extras.get(name, [])] == [f"taskpoint-{name}"], (
            f"taskpoint[{name}] should install exactly taskpoint-{name}; got {extras.get(name)}"
        )


def test_every_distribution_ships_the_license() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for dist, folder in DIST_DIRS.items():
        project = _pyproject(dist)
        assert project["license"] == LICENSE, dist
        assert project.get("license-files") == ["LICENSE"], dist
        copy = folder / "LICENSE"
        assert copy.is_file() and copy.read_text(encoding="utf-8") == text, (
            f"{copy} must be a copy of the root LICENSE"
        )


# --- uv and the built distributions --------------------------------------------------


def _run(args: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None,
         what: str) -> str:
    """Run a command; its stdout. A failure shows the command and both streams."""
    try:
        done = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} took over {timeout} s: {args}\n{exc.stdout}\n{exc.stderr}")
    if done.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {done.returncode}): {args}\n"
            f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
        )
    return done.stdout


@dataclass(frozen=True)
class Built:
    """The built artifacts, by distribution name."""

    folder: Path
    wheels: dict[str, Path]
    sdists: dict[str, Path]

    def metadata(self, dist: str) -> Message:
        return _wheel_metadata(self.wheels[dist])


def _wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode("utf-8")
    return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def _build_into(uv: str, out: Path) -> None:
    """Every distribution's sdist and wheel (built from the sdist), into ``out``."""
    common = ["--out-dir", str(out), "--no-sources"]
    _run([uv, "build", "--all-packages", *common], cwd=ROOT, timeout=BUILD_TIMEOUT,
         what="uv build --all-packages")
    # Not a workspace member (see the root pyproject.toml), so built on its own.
    _run([uv, "build", *common, str(DIST_DIRS["taskpoint-unsloth"])], cwd=ROOT,
         timeout=BUILD_TIMEOUT, what="uv build integrations/unsloth")


@pytest.fixture(scope="module")
def built(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Every distribution built by ``uv build`` (sdist, then the wheel from the sdist).

    Under pytest-xdist the workers of one run share one build: the first worker to need it
    builds into the run's common temporary folder while holding a lock, and the others wait
    for that lock and use the same files (the tests only read them). A failed build leaves
    no completion mark, so the next worker tries again and reports its own failure.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        out = tmp_path_factory.mktemp("dists")
        _build_into(uv, out)
    else:
        import fcntl

        out = tmp_path_factory.getbasetemp().parent / f"dists-{run}"
        out.mkdir(exist_ok=True)
        with open(out.with_name(f"{out.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            complete = out.with_name(f"{out.name}.complete")
            if not complete.exists():
                _build_into(uv, out)
                complete.touch()
    wheels: dict[str, Path] = {}
    sdists: dict[str, Path] = {}
    for path in sorted(out.iterdir()):
        if path.name.endswith(".whl"):
            name = str(parse_wheel_filename(path.name)[0])
            assert name not in wheels, f"two wheels of {name}: {wheels[name]}, {path}"
            wheels[name] = path
        elif path.name.endswith(".tar.gz"):
            name = str(parse_sdist_filename(path.name)[0])
            assert name not in sdists, f"two sdists of {name}: {sdists[name]}, {path}"
            sdists[name] = path
    return Built(out, wheels, sdists)


@pytest.mark.slow
def test_every_distribution_builds(built: Built) -> None:
    expected = sorted(DIST_DIRS)
    assert sorted(built.wheels) == expected, sorted(p.name for p in built.folder.iterdir())
    assert sorted(built.sdists) == expected, sorted(p.name for p in built.folder.iterdir())
    version = _pyproject(CORE)["version"]
    for dist in DIST_DIRS:
        assert str(parse_wheel_filename(built.wheels[dist].name)[1]) == version, dist
        assert str(parse_sdist_filename(built.sdists[dist].name)[1]) == version, dist
        assert built.metadata(dist)["Version"] == version, dist
    extras = set(built.metadata(CORE).get_all("Provides-Extra") or [])
    assert set(ADAPTERS) <= extras, f"the core wheel lacks extras {set(ADAPTERS) - extras}"


@pytest.mark.slow
@pytest.mark.parametrize("dist", sorted(DIST_DIRS))
def test_distribution_metadata(built: Built, dist: str) -> None:
    meta = built.metadata(dist)
    version = meta["Version"]
    assert meta["Name"] == dist
    assert (meta["License-Expression"] or meta["License"]) == LICENSE
    assert meta.get_all("License-File") == ["LICENSE"]

    requires_python = SpecifierSet(meta["Requires-Python"] or "")
    assert meta["Requires-Python"], f"{dist} declares no Requires-Python"
    classifiers = meta.get_all("Classifier") or []
    for needed in ("Typing :: Typed", "Development Status :: 3 - Alpha",
                   "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert needed in classifiers, f"{dist} lacks the classifier {needed!r}"
    pythons = [c.rsplit(" :: ", 1)[1] for c in classifiers
               if c.startswith("Programming Language :: Python :: 3.")]
    assert pythons == list(PYTHONS), f"{dist} Python classifiers: {pythons}"
    assert all(Version(p) in requires_python for p in pythons), (meta["Requires-Python"], pythons)
    assert Version("3.9") not in requires_python, meta["Requires-Python"]

    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    for label in PROJECT_URLS:
        assert urls.get(label, "").startswith("https://"), f"{dist} Project-URL {label}: {urls}"
    assert meta["Keywords"], f"{dist} declares no keywords"
    assert meta["Summary"] and meta["Description-Content-Type"] == "text/markdown"

    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    pin = _compatible_range(version)
    for req in requires:
        if req.name.startswith("taskpoint"):
            assert req.specifier == pin and Version(version) in req.specifier, (dist, str(req))
    if dist != CORE:
        assert any(r.name == CORE and not r.marker for r in requires), requires

    package = IMPORT_NAMES[dist]
    with zipfile.ZipFile(built.wheels[dist]) as zf:
        names = set(zf.namelist())
    assert f"{package}/py.typed" in names, f"{dist} wheel lacks {package}/py.typed"
    assert f"{package}/__init__.py" in names
    license_file = f"{package}-{version}.dist-info/licenses/LICENSE"
    assert license_file in names, sorted(n for n in names if ".dist-info/" in n)

    with tarfile.open(built.sdists[dist]) as tf:
        members = set(tf.getnames())
    top = f"{package}-{version}"
    for needed in ("PKG-INFO", "LICENSE", "README.md", "pyproject.toml",
                   f"src/{package}/py.typed"):
        assert f"{top}/{needed}" in members, f"{dist} sdist lacks {needed}"


# --- installing each extra from the wheels -------------------------------------------

PRELUDE = '''
import json
import sys
from importlib import metadata
from pathlib import Path

import taskpoint

WORK = Path(sys.argv[1])
env = taskpoint.TaskEnvironment(name="wheels", root=str(WORK / "store"))
seen = []


class Stop(Exception):
    """The planned failure of attempt 0."""


def report(adapter, result):
    dists = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"].startswith("taskpoint"):
            direct = dist.read_text("direct_url.json")
            dists[dist.metadata["Name"]] = json.loads(direct) if direct else None
    print("RESULT " + json.dumps({
        "taskpoint": [taskpoint.__version__, taskpoint.__file__],
        "adapter": [adapter.__version__, adapter.__file__],
        "dists": dists,
        "seen": seen,
        "result": result,
    }))
'''
"""Shared by the scripts: a task environment on a local store, and the report line."""


@dataclass(frozen=True)
class Resume:
    """A script resuming through one adapter, and what it must report."""

    script: str
    seen: list[Any]
    """What each attempt recorded, in order."""
    check: Callable[[Any], None]
    """Asserts on the task's return value."""


def _check_pytorch(result: Any) -> None:
    assert result == {"weight": [[0.25, 0.25, 0.25]], "bias": -1.5, "extra": {"note": "a0"}}


def _check_sklearn(result: Any) -> None:
    assert result["progress"] == 4
    assert result["coef"] == result["uninterrupted"], "the resumed run differs"


RESUMES: dict[str, Resume] = {
    "pytorch": Resume(
        script='''
import taskpoint_pytorch as adapter
import torch
from taskpoint_pytorch import TaskpointState


@env.task(retries=1, backoff=0)
def train():
    attempt, ckpt = taskpoint.ctx().attempt, taskpoint.ctx().checkpoint
    model = torch.nn.Linear(3, 1)
    state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    resume = state.restore_sync(ckpt)
    seen.append([attempt, resume.epoch if resume else None])
    if resume is None:
        with torch.no_grad():
            model.weight.fill_(0.25)
            model.bias.fill_(-1.5)
        state.save_sync(ckpt, epoch=3, extra={"note": "a0"})
        raise Stop("planned failure")
    return {"weight": model.weight.tolist(), "bias": model.bias.item(), "extra": resume.extra}


report(adapter, train())
''',
        seen=[[0, None], [1, 3]],
        check=_check_pytorch,
    ),
    "sklearn": Resume(
        script='''
import numpy as np
import taskpoint_sklearn as adapter
from sklearn.linear_model import SGDRegressor
from taskpoint_sklearn import TaskpointSklearnCheckpoint

CHUNKS = 4


def chunk(rng):
    x = rng.standard_normal((16, 2))
    return x, x @ np.array([2.0, -1.0])


def fresh():
    return SGDRegressor(max_iter=1, tol=None, random_state=0)


@env.task(retries=1, backoff=0)
def train():
    attempt = taskpoint.ctx().attempt
    ckpt = TaskpointSklearnCheckpoint(taskpoint.ctx().checkpoint)
    bundle = ckpt.resume_sync(fresh(), rng=np.random.default_rng(0))
    seen.append([attempt, bundle.progress])
    for i in range(bundle.progress, CHUNKS):
        bundle.partial_fit(*chunk(bundle.rng))
        bundle.progress = i + 1
        ckpt.save_sync(bundle)
        if attempt == 0 and bundle.progress == 2:
            raise Stop("planned failure")
    return bundle.progress, bundle.estimator.coef_.tolist()


reference, rng = fresh(), np.random.default_rng(0)
for _ in range(CHUNKS):
    reference.partial_fit(*chunk(rng))
progress, coef = train()
report(adapter, {"progress": progress, "coef": coef, "uninterrupted": reference.coef_.tolist()})
''',
        seen=[[0, 0], [1, 2]],
        check=_check_sklearn,
    ),
    "lightning": Resume(
        script='''
import lightning as L
import taskpoint_lightning as adapter
import torch
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.started_at = -1

    def on_train_start(self):
        self.started_at = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@env.task(retries=1, backoff=0)
def train():
    attempt, ckpt = taskpoint.ctx().attempt, taskpoint.ctx().checkpoint
    dirpath = WORK / "ckpts"
    resume = resume_ckpt_path(ckpt, dirpath=dirpath)
    torch.manual_seed(0)
    x = torch.randn(4, 2)
    model = Tiny()
    trainer = L.Trainer(
        max_steps=2 if attempt == 0 else 4, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=WORK,
        callbacks=[TaskpointModelCheckpoint(ckpt, dirpath=dirpath, save_last=True,
                                            every_n_train_steps=1)],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
                ckpt_path=resume)
    seen.append([attempt, Path(resume).name if resume else None, model.started_at,
                 trainer.global_step])
    if attempt == 0:
        raise Stop("planned failure")
    return trainer.global_step


report(adapter, train())
''',
        seen=[[0, None, 0, 2], [1, "last.ckpt", 2, 4]],
        check=lambda result: _equal(result, 4),
    ),
    "hf": Resume(
        script='''
import taskpoint_hf as adapter
import torch
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
from transformers import Trainer, TrainingArguments


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = torch.tensor([float(i % 4), 1.0])
        return {"x": x, "labels": x.sum(0, keepdim=True)}


@env.task(retries=1, backoff=0)
def train():
    attempt, ckpt = taskpoint.ctx().attempt, taskpoint.ctx().checkpoint
    args = TrainingArguments(
        output_dir=str(WORK / "out"), max_steps=2 if attempt == 0 else 4,
        save_strategy="steps", save_steps=1, save_total_limit=2,
        per_device_train_batch_size=4, report_to="none", use_cpu=True, disable_tqdm=True,
    )
    resume = restore_last_checkpoint(ckpt, args)
    torch.manual_seed(0)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(),
                      callbacks=[TaskpointTrainerCallback(ckpt, args.output_dir)])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seen.append([attempt, resume.name if resume else None, trainer.state.global_step])
    if attempt == 0:
        raise Stop("planned failure")
    return trainer.state.global_step


report(adapter, train())
''',
        seen=[[0, None, 2], [1, "checkpoint-2", 4]],
        check=lambda result: _equal(result, 4),
    ),
    # Unsloth LoRA training is too slow here: import the adapter (and Unsloth, on CPU),
    # then resume a Trainer output directory through taskpoint_hf, which it builds on.
    "unsloth": Resume(
        script='''
import taskpoint_unsloth as adapter  # imports Unsloth first, as it requires
from taskpoint_hf import restore_last_checkpoint


@env.task(retries=1, backoff=0)
def train():
    attempt, ckpt = taskpoint.ctx().attempt, taskpoint.ctx().checkpoint
    out = WORK / "out"
    resume = restore_last_checkpoint(ckpt, out)
    seen.append([attempt, resume.name if resume else None])
    if resume is None:
        (out / "checkpoint-2").mkdir(parents=True)
        (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
        ckpt.save_sync(out)
        raise Stop("planned failure")
    return json.loads((resume / "trainer_state.json").read_text())["global_step"]


report(adapter, {"global_step": train(), "lora_record": adapter.LORA_RECORD})
''',
        seen=[[0, None], [1, "checkpoint-2"]],
        check=lambda result: _equal(
            result, {"global_step": 2, "lora_record": "taskpoint-lora.json"}
        ),
    ),
}


def _equal(got: Any, want: Any) -> None:
    assert got == want


def _our_closure(built: Built, extra: str) -> dict[str, str]:
    """Our distributions ``taskpoint[extra]`` installs, each as a direct wheel requirement."""
    found = {CORE: f"{CORE}[{extra}]"}
    todo = [(CORE, {extra})]
    while todo:
        dist, extras = todo.pop()
        for raw in built.metadata(dist).get_all("Requires-Dist") or []:
            req = Requirement(raw)
            req.name = str(canonicalize_name(req.name))
            if req.name not in DIST_DIRS:
                continue
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                continue
            if req.name not in found:
                found[req.name] = req.name
                todo.append((req.name, set(req.extras)))
    return {dist: f"{spec} @ {built.wheels[dist].as_uri()}" for dist, spec in found.items()}


def _constraints(uv: str, extra: str, folder: Path) -> Path:
    """``uv.lock``'s versions for the extra's environment, as a constraints file."""
    groups = ["--only-group", UNSLOTH_GROUP] if extra == "unsloth" else []
    text = _run(
        [uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-header",
         "--no-annotate", *groups],
        cwd=ROOT, timeout=60, what="uv export",
    )
    keep = [
        line for line in text.splitlines()
        if line.strip() and not line.startswith(("-e", ".", "/", "file:"))
        and not line.startswith("taskpoint")
    ]
    assert len(keep) > 20, f"uv export gave too few pins:\n{text}"
    path = folder / "constraints.txt"
    path.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return path


def _device(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return path.stat().st_dev


@pytest.fixture
def workdir(uv: str, tmp_path: Path) -> Iterator[Path]:
    """A scratch folder on the uv cache's filesystem (so installs hardlink), removed after."""
    cache = Path(_run([uv, "cache", "dir"], cwd=tmp_path, timeout=30, what="uv cache dir").strip())
    if _device(tmp_path) == _device(cache):
        folder = Path(tempfile.mkdtemp(prefix="wheels-", dir=tmp_path))
    else:
        parent = cache.parent if cache.parent.exists() else cache
        folder = Path(tempfile.mkdtemp(prefix="taskpoint-wheels-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _child_env() -> dict[str, str]:
    """This environment minus what would leak the workspace into the fresh one."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("TASKPOINT_")
        and k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT"}
    }
    env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("extra", ADAPTERS)
def test_extra_installs_from_wheels_and_resumes(
    uv: str, built: Built, workdir: Path, extra: str
) -> None:
    env = _child_env()
    venv = workdir / "venv"
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], cwd=workdir,
         timeout=120, env=env, what="uv venv")
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    ours = _our_closure(built, extra)
    assert CORE in ours and f"taskpoint-{extra}" in ours, ours
    _run(
        [uv, "pip", "install", "--python", str(python),
         "--constraints", str(_constraints(uv, extra, workdir)), *ours.values()],
        cwd=workdir, timeout=INSTALL_TIMEOUT, env=env, what=f"installing taskpoint[{extra}]",
    )

    resume = RESUMES[extra]
    script = workdir / f"resume_{extra}.py"
    script.write_text(PRELUDE + textwrap.dedent(resume.script), encoding="utf-8")
    output = _run([str(python), str(script), str(workdir)], cwd=workdir,
                  timeout=SCRIPT_TIMEOUT, env=env, what=f"the taskpoint[{extra}] resume")
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-4000:]
    report = json.loads(lines[0].removeprefix("RESULT "))

    version = _pyproject(CORE)["version"]
    for key in ("taskpoint", "adapter"):
        got_version, file = report[key]
        assert got_version == version, report[key]
        assert Path(file).resolve().is_relative_to(venv.resolve()), f"{key} imported from {file}"
    installed = {canonicalize_name(name): url for name, url in report["dists"].items()}
    assert set(installed) == {canonicalize_name(d) for d in ours}, report["dists"]
    for dist in ours:
        url = installed[canonicalize_name(dist)]
        assert url is not None and url["url"] == built.wheels[dist].as_uri(), (dist, url)
        assert "dir_info" not in url, f"{dist} is an editable install: {url}"
    assert report["seen"] == resume.seen, report
    resume.check(report["result"])
