"""Real prefork workers that a chaos run starts, signals and restarts, and the evidence of
exits it did not cause (``worker_crashes``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.delivery.procs import start_worker
from conveyor.settings import ConveyorSettings

# Timers tests/conftest.py speeds up for every other test; a chaos run uses the defaults.
TIMERS = (
    "lease_timeout",
    "heartbeat_interval",
    "relay_interval",
    "reconciler_interval",
    "worker_alive_ttl",
    "visibility_timeout",
    "republish_after",
    "default_time_limit",
    "default_soft_time_limit",
    "infra_backoff",
    "backoff_base",
)

CHILD_EXIT = re.compile(r"Process '([^']+)' pid:(\d+) exited with '([^']*)'")
CONNECTION_LOSS_CANCEL = "cannot be acknowledged after a connection loss"


def default_timer_env(**overrides: str) -> dict[str, str]:
    """``CONVEYOR_*`` values putting every timer back to its default (plus ``overrides``)."""
    env: dict[str, str] = {}
    for name in TIMERS:
        info = ConveyorSettings.model_fields.get(name)
        if info is None or info.default is None or not isinstance(info.default, (int, float)):
            continue
        env[f"CONVEYOR_{name.upper()}"] = str(info.default)
    env.update(overrides)
    return env


def child_pids(pid: int) -> set[int]:
    """Direct children of ``pid`` (the pool children of a worker's main process)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(x) for x in f.read().split())
    return out


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def wait_gone(pids: Sequence[int] | set[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


@dataclass
class Incarnation:
    """One worker process tree started for a slot."""

    slot: str
    number: int
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    signalled: str | None = None  # "group" | "sigterm" | "stop": the run ended it
    children_seen: set[int] = field(default_factory=set)

    def pids(self) -> set[int]:
        kids = child_pids(self.proc.pid)
        self.children_seen |= kids
        return {self.proc.pid, *kids}


class Cluster:
    """Named worker slots (``A``, ``B``), each running one incarnation at a time."""

    def __init__(
        self,
        settings: ConveyorSettings,
        *,
        queues: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str],
        concurrency: int,
        say: Any = print,
    ) -> None:
        self.settings = settings
        self.queues = list(queues)
        self.log_dir = log_dir
        self.env = dict(env)
        self.concurrency = concurrency
        self.say = say
        self.live: dict[str, Incarnation] = {}
        self.every: list[Incarnation] = []
        self.signalled_pids: set[int] = set()  # every pid the run sent a signal to
        self.start_failures: list[str] = []

    def start(self, slot: str, timeout: float = 90.0) -> Incarnation:
        number = len(self.every)
        log = self.log_dir / f"worker-{slot}-{number}.log"
        proc = start_worker(
            self.settings,
            queues=self.queues,
            concurrency=self.concurrency,
            log_path=log,
            extra_env=self.env,
        )
        inc = Incarnation(slot, number, proc, log, time.monotonic())
        self.every.append(inc)
        self.live[slot] = inc
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                self.start_failures.append(
                    f"worker {slot}#{number} exited with {proc.returncode} while starting"
                )
                self.say(f"worker {slot}#{number} died while starting:\n{_tail(log)}")
                raise AssertionError(f"worker {slot}#{number} exited while starting:\n{_tail(log)}")
            if log.exists() and " ready." in log.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {slot}#{number} not ready after {timeout}s:\n{_tail(log)}")
            time.sleep(0.1)
        inc.pids()
        return inc

    def watch(self) -> None:
        """Notice worker processes that exited although the run did not signal them (a
        crash): count it and start the slot again."""
        for slot, inc in list(self.live.items()):
            if inc.signalled is None:
                inc.pids()
            if inc.proc.poll() is not None and inc.signalled is None:
                inc.signalled = "crashed"
                self.say(
                    f"CRASH: worker {slot}#{inc.number} main process exited by itself with "
                    f"{inc.proc.returncode}\n{_tail(inc.log, 1500)}"
                )
                self.start(slot)

    def kill_group(self, slot: str) -> tuple[Incarnation, set[int]]:
        """SIGKILL a worker's whole process group (a machine dying); the caller restarts."""
        inc = self.live[slot]
        pids = inc.pids()
        inc.signalled = "group"
        self.signalled_pids |= pids
        os.killpg(inc.proc.pid, signal.SIGKILL)
        inc.proc.wait(timeout=10)
        wait_gone(pids)
        return inc, pids

    def kill_child(self, pid: int) -> None:
        """SIGKILL one pool child; its main process replaces it."""
        self.signalled_pids.add(pid)
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid])

    def sigterm(self, slot: str) -> Incarnation:
        """SIGTERM a worker's main process (warm, bounded shutdown); the caller waits."""
        inc = self.live[slot]
        self.signalled_pids |= inc.pids()
        inc.signalled = "sigterm"
        inc.proc.send_signal(signal.SIGTERM)
        return inc

    def stop_all(self, timeout: float = 15.0) -> None:
        for inc in self.live.values():
            if inc.proc.poll() is None:
                if inc.signalled is None:
                    inc.signalled = "stop"
                with contextlib.suppress(ProcessLookupError):
                    inc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for inc in self.live.values():
            try:
                inc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(inc.proc.pid, signal.SIGKILL)
                inc.proc.wait(timeout=10)
        for inc in self.every:  # pool children left behind by a killed group, if any
            for pid in inc.children_seen:
                if not gone(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def log_evidence(self) -> tuple[list[str], list[str]]:
        """(crashes, connection-loss cancellations): one crash per worker incarnation whose
        main process exited by itself or logged ``Unrecoverable error``, plus one per pool
        child that exited although the run signalled neither it nor its worker. Celery's
        own termination of a task it could not ack after a broker connection loss is
        listed apart (announced in the log, matched by count)."""
        crashes: list[str] = []
        cancels: list[str] = []
        for inc in self.every:
            text = inc.log.read_text(errors="replace") if inc.log.exists() else ""
            name = f"worker {inc.slot}#{inc.number}"
            reasons = [line.strip()[:300] for line in text.splitlines() if "Unrecoverable error" in line]
            if inc.signalled == "crashed":
                reasons.insert(0, f"main process exited by itself with code {inc.proc.returncode}")
            if reasons:
                crashes.append(f"{name}: " + " | ".join(reasons))
            announced = text.count(CONNECTION_LOSS_CANCEL)
            for m in CHILD_EXIT.finditer(text):
                if int(m.group(2)) in self.signalled_pids or inc.signalled == "sigterm":
                    continue
                entry = f"{name}: {m.group(0)}"
                if announced > 0:
                    announced -= 1
                    cancels.append(entry)
                else:
                    crashes.append(entry)
        return crashes, cancels

    def all_crashes(self) -> list[str]:
        crashes, _ = self.log_evidence()
        return [*self.start_failures, *crashes]


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"
