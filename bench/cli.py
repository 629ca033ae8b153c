"""Start-up time of the ``conveyor`` command, beside ``celery --help`` (issue #27, item 15).

Each command runs as a fresh process from the checkout (the deployment's directory), its
output to a pipe; the three are interleaved round by round, so that every round sees the
same load from the rest of the machine, after one warm-up round (not recorded). Figures
are the median wall time of ``--rounds`` rounds (15; ``--smoke``: 3), in seconds:

* ``celery_help_s``: ``celery --help``, plain Celery without an app (no ``-A``): the
  baseline;
* ``conveyor_help_s``: ``conveyor --help``, listing every command, the deployment's
  ``files`` group too;
* ``jobs_list_s``: ``conveyor jobs list`` on the embedded default's store, a SQLite file
  holding 50 queued jobs (the default ``--limit``), attached by ``CONVEYOR_DATABASE_URL``;
  ``CONVEYOR_REDIS_URL`` names a port nothing listens on, as the command never uses Redis.

The goals: ``conveyor_help_s`` no more than ``celery_help_s``, and ``jobs_list_s`` at most
0.5 s (``help_goal_met``, ``jobs_list_goal_met``: ``yes`` or ``no``; the smoke figures mean
nothing). Nothing but the SQLite file (in a temporary directory) is created; no Redis or
Postgres is used.

Usage::

    .venv/bin/python -m bench.cli
    .venv/bin/python -m bench.cli --smoke

Progress goes to stderr; stdout carries only ``name=value`` lines: ``conveyor_help_s``,
``celery_help_s``, ``jobs_list_s``, ``help_over_celery``, ``help_goal_met``,
``jobs_list_goal_met``, ``rounds``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.common import ROOT, BenchError, log

FULL_ROUNDS = 15
SMOKE_ROUNDS = 3
JOBS = 50  # `jobs list` shows this many by default
JOBS_LIST_GOAL_S = 0.5
# Nothing listens on port 1: `jobs list` must not need Redis (the submits below go to the
# database alone, as they do when Redis is down).
NO_REDIS = "redis://127.0.0.1:1/0"
STAGE = "conveyor.demo.noop"


def script(name: str) -> str:
    """The console script ``name`` of this virtualenv (what a user runs)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise BenchError(f"{path} is missing: pip install -e '.[test]' in this virtualenv")
    return str(path)


def base_env(home: Path) -> dict[str, str]:
    """The environment without any ``CONVEYOR_*`` of the caller's, a private home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["CONVEYOR_HOME"] = str(home)
    return env


def fill_store(env: Mapping[str, str], jobs: int) -> None:
    """Create the SQLite store and submit ``jobs`` jobs to it (in a child process: the
    settings are read when the deployment's app module is imported)."""
    code = (
        "import sys\n"
        "from bench.common import open_platform\n"
        "platform = open_platform()\n"
        "for i in range(int(sys.argv[1])):\n"
        f"    platform.submit({STAGE!r}, {{'n': i}}, label=f'bench-cli-{{i}}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(jobs)], cwd=ROOT, env=dict(env), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise BenchError(f"could not fill the SQLite store:\n{done.stderr[-2000:]}")


def timed(argv: Sequence[str], env: Mapping[str, str]) -> tuple[float, str]:
    """Run ``argv`` from the checkout; its wall time in seconds and its stdout."""
    started = time.perf_counter()
    done = subprocess.run(list(argv), cwd=ROOT, env=dict(env), capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return took, done.stdout


def check_output(name: str, out: str, jobs: int) -> None:
    """What each command printed is what it should: the run did the real work."""
    if name == "jobs_list_s":
        lines = out.splitlines()
        if len(lines) != jobs + 1 or not lines[0].startswith("id\t"):
            raise BenchError(f"`conveyor jobs list` printed {len(lines)} lines, not a header and {jobs} jobs")
    elif name == "conveyor_help_s" and "jobs" not in out:
        raise BenchError("`conveyor --help` does not list its commands")
    elif name == "celery_help_s" and "worker" not in out:
        raise BenchError("`celery --help` does not list its commands")


def measure(rounds: int, home: Path) -> dict[str, list[float]]:
    """Each command's wall times, interleaved round by round after a warm-up round."""
    db = home / "conveyor.db"
    env = base_env(home)
    jobs_env = {**env, "CONVEYOR_DATABASE_URL": f"sqlite:///{db}", "CONVEYOR_REDIS_URL": NO_REDIS}
    log(f"filling {db} with {JOBS} queued jobs")
    fill_store(jobs_env, JOBS)
    conveyor = script("conveyor")
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "celery_help_s": ([script("celery"), "--help"], env),
        "conveyor_help_s": ([conveyor, "--help"], env),
        "jobs_list_s": ([conveyor, "jobs", "list"], jobs_env),
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for n in range(rounds + 1):
        for name, (argv, command_env) in commands.items():
            took, out = timed(argv, command_env)
            check_output(name, out, JOBS)
            if n:  # round 0 warms the page cache and the bytecode
                times[name].append(took)
        if n:
            log(f"  round {n}/{rounds}: " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in times.items()))
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=FULL_ROUNDS, help="timed runs of each command")
    parser.add_argument("--smoke", action="store_true", help=f"CI: {SMOKE_ROUNDS} rounds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds = SMOKE_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines."""
    args = parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="conveyor-bench-cli-"))
    try:
        times = measure(args.rounds, home)
    except BenchError as exc:
        log(f"bench.cli failed: {exc}")
        return 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"conveyor_help_s={median['conveyor_help_s']:.3f}")
    print(f"celery_help_s={median['celery_help_s']:.3f}")
    print(f"jobs_list_s={median['jobs_list_s']:.3f}")
    print(f"help_over_celery={median['conveyor_help_s'] / median['celery_help_s']:.3f}")
    print(f"help_goal_met={'yes' if median['conveyor_help_s'] <= median['celery_help_s'] else 'no'}")
    print(f"jobs_list_goal_met={'yes' if median['jobs_list_s'] <= JOBS_LIST_GOAL_S else 'no'}")
    print(f"rounds={args.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
