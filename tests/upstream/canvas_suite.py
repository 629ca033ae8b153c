"""Celery's own canvas tests (``t/integration/test_canvas.py`` of the installed Celery's
sdist, from the package index) against a plain Celery worker and against ``conveyor
worker`` with Celery's task module declared as stages, one side after the other.

Nothing upstream is vendored: the sdist is downloaded into a cache and the suite's files
are copied out of it beside three shims of ours (``*_shim.py`` here), which become
``conftest.py``, ``tasks.py`` and ``sides.py`` of the upstream package ``t.integration``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.fault.conftest import wait_ready

HERE = Path(__file__).parent
UPSTREAM_FILES = {
    "t/__init__.py": "t/__init__.py",
    "t/canvas_helpers.py": "t/canvas_helpers.py",
    "t/integration/__init__.py": "t/integration/__init__.py",
    "t/integration/test_canvas.py": "t/integration/test_canvas.py",
    "t/integration/tasks.py": "t/integration/celery_tasks.py",
}
SHIMS = {
    "conftest_shim.py": "t/integration/conftest.py",
    "tasks_shim.py": "t/integration/tasks.py",
    "sides_shim.py": "t/integration/sides.py",
}
# The plugins installed for our own suite that have nothing to do with Celery's.
NO_PLUGINS = (
    "cacheprovider",
    "celery",
    "django",
    "docker_tools",
    "schemathesis",
    "cloudcoil",
    "hypothesispytest",
)


def celery_sdist(cache: Path) -> Path:
    """The installed Celery version's sdist, downloaded from the package index once."""
    version = importlib.metadata.version("celery")
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"celery-{version}.tar.gz"))
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"celery=={version}",
            "-d",
            str(cache),
        ],
        check=True,
    )
    return cache / f"celery-{version}.tar.gz"


def materialize(sdist: Path, dest: Path) -> Path:
    """The upstream suite's files and our shims in ``dest`` (the directory to put on
    ``sys.path``, holding the package ``t``)."""
    with tarfile.open(sdist) as tar:
        prefix = tar.getnames()[0].split("/", 1)[0]
        for member, target in UPSTREAM_FILES.items():
            source = tar.extractfile(f"{prefix}/{member}")
            assert source is not None, member
            path = dest / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(source.read())
    for shim, target in SHIMS.items():
        shutil.copyfile(HERE / shim, dest / target)
    return dest


@dataclass
class Outcomes:
    """One side's results by test id (``Class::test[params]``)."""

    passed: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    xfailed: set[str] = field(default_factory=set)
    seconds: float = 0.0

    def counts(self) -> str:
        """``passed=… failed=… skipped=… xfailed=…`` for a log line."""
        return (
            f"passed={len(self.passed)} failed={len(self.failed)} "
            f"skipped={len(self.skipped)} xfailed={len(self.xfailed)} seconds={self.seconds:.0f}"
        )


def read_junit(path: Path) -> Outcomes:
    """The outcomes pytest wrote to a JUnit XML file."""
    out = Outcomes()
    for case in ET.parse(path).iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            out.failed[test_id] = (failure.get("message") or "")[:300]
        elif skipped is not None:
            (out.xfailed if skipped.get("type") == "pytest.xfail" else out.skipped).add(test_id)
        else:
            out.passed.add(test_id)
    return out


def worker_command(side: str) -> list[str]:
    """The external worker of a side: Celery's own, or ``conveyor worker``."""
    common = ["worker", "-P", "prefork", "-c", "4", "-l", "INFO", "--without-mingle", "--without-gossip"]
    if side == "plain":
        return [sys.executable, "-m", "celery", "-A", "t.integration.sides", *common, "-Q", "celery"]
    return [sys.executable, "-m", "conveyor", *common, "-Q", "default"]


def run_side(
    side: str,
    tree: Path,
    *,
    env: Mapping[str, str],
    selection: Sequence[str],
    logs: Path,
    deselect: Sequence[str] = (),
    run_differences: bool = True,
    per_test_timeout: int = 90,
) -> Outcomes:
    """Start the side's worker, run the selected upstream tests against it, stop it."""
    side_env = {
        **env,
        "CONVEYOR_CANVAS_SIDE": side,
        "CONVEYOR_APP": "t.integration.sides",
        "PYTHONPATH": os.pathsep.join([str(tree), env["CONVEYOR_ROOT"]]),
        # Celery's tasks declare hard limits up to 60 s; a stage's must be below this.
        "CONVEYOR_VISIBILITY_TIMEOUT": "120",
        "CONVEYOR_CANVAS_RUN_DIFFERENCES": "1" if run_differences else "0",
    }
    worker_log = logs / f"{side}-worker.log"
    with open(worker_log, "ab") as out:
        worker = subprocess.Popen(
            worker_command(side),
            env=side_env,
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_ready(worker_log, worker, timeout=90.0)
        junit = logs / f"{side}.xml"
        started = time.monotonic()
        with open(logs / f"{side}-pytest.log", "wb") as out:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-rfE",
                    "--rootdir",
                    str(tree),
                    "-c",
                    os.devnull,
                    "-o",
                    "python_classes=test_*",
                    *(arg for name in NO_PLUGINS for arg in ("-p", f"no:{name}")),
                    f"--timeout={per_test_timeout}",
                    f"--junitxml={junit}",
                    *(f"--deselect=t/integration/test_canvas.py::{d}" for d in deselect),
                    *(
                        f"t/integration/test_canvas.py::{s}" if s else "t/integration/test_canvas.py"
                        for s in selection
                    ),
                ],
                env=side_env,
                cwd=tree,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        outcomes = read_junit(junit)
        outcomes.seconds = time.monotonic() - started
        return outcomes
    finally:
        _stop(worker)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
