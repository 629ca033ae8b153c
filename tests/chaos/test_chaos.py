"""Chaos: a steady stream of jobs through two real prefork workers while the run SIGKILLs
worker process groups and pool children, SIGTERMs a worker (bounded shutdown) and restarts
Redis empty, at random times. Afterwards :func:`tests.chaos.checker.check` must find every
accepted job terminal with exactly one effect, and takeovers within 15 s at p95.

The workers run every timer at its default (lease 8 s, heartbeat 2 s, reconciler 2 s,
relay 1 s...), not the fast timers of the other tests; only the soft-shutdown timeout is
short. The schedule is drawn from a seed printed first (``CHAOS_SEED=<n>`` replays it;
``CHAOS_JOBS`` changes the number of jobs). Run with ``-s`` to watch it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conveyor.delivery.procs import service_env
from conveyor.runfile import local_node
from tests.chaos.checker import (
    ChaosResult,
    ClaimLog,
    ExpectedJob,
    Kill,
    Outage,
    Shutdown,
    check,
    db_now,
    running_jobs,
    running_on,
)
from tests.chaos.cluster import Cluster, default_timer_env, wait_gone
from tests.fault.servers import PrivateRedis, private_redis

pytestmark = [pytest.mark.fault]

HOST = local_node()  # how lease owners name this host (see conveyor.runfile)
ROOT = Path(__file__).resolve().parents[2]
SOFT_SHUTDOWN = 3.0  # CONVEYOR_SOFT_SHUTDOWN_TIMEOUT of the chaos workers
SHUTDOWN_SLACK = 7.0  # a SIGTERMed worker must be gone within SOFT_SHUTDOWN + this
RECOVERY_P95_BOUND = 15.0
MIN_SAMPLES = 20
DRAIN_TIMEOUT = 180.0
CONCURRENCY = 4  # per worker: a group kill cuts several attempts short at once
EFFECT = "conveyor.demo.effect"
RECEIVED = re.compile(r"Task [\w.]+\[([0-9a-f-]{36})\] received")


@dataclass
class Item:
    kind: str  # "single" | "chain"
    ids: list[str]
    notes: list[str]
    sleeps: list[float]


def make_items(
    rng: random.Random, tag: str, n_jobs: int, *, sleep: tuple[float, float], long_share: float
) -> list[Item]:
    """Single jobs and two-link chains totalling ``n_jobs`` job rows. Each sleeps a while
    (so that every worker slot is busy at every fault); ``long_share`` of them run long
    enough to outlast a bounded shutdown."""

    def draw() -> float:
        if rng.random() < long_share:
            return round(rng.uniform(6.0, 10.0), 2)
        return round(rng.uniform(*sleep), 3)

    items: list[Item] = []
    jobs = 0
    while jobs < n_jobs:
        i = len(items)
        if n_jobs - jobs >= 2 and rng.random() < 0.4:
            ids = [str(uuid.uuid4()), str(uuid.uuid4())]
            items.append(Item("chain", ids, [f"{tag}-{i}a", f"{tag}-{i}b"], [draw(), draw()]))
            jobs += 2
        else:
            items.append(Item("single", [str(uuid.uuid4())], [f"{tag}-{i}"], [draw()]))
            jobs += 1
    return items


def expected_jobs(items: list[Item]) -> list[ExpectedJob]:
    out: list[ExpectedJob] = []
    for item in items:
        if item.kind == "single":
            out.append(ExpectedJob(item.ids[0], item.notes[0], "single"))
        else:
            out.append(ExpectedJob(item.ids[0], item.notes[0], "head"))
            out.append(ExpectedJob(item.ids[1], item.notes[1], "tail", head=item.ids[0]))
    return out


# Rough seconds each fault takes (restarting the worker, waiting for its exit): only used
# to pace the submissions so that the stream lasts as long as the schedule.
FAULT_COST = {"group": 5.0, "child": 0.5, "sigterm": SOFT_SHUTDOWN + 5.0, "redis": 2.5}


@dataclass
class Schedule:
    """Fault kinds in a random order with random gaps (seconds before each)."""

    events: list[tuple[float, str]]

    @classmethod
    def draw(
        cls, rng: random.Random, counts: dict[str, int], gap: tuple[float, float], warmup: tuple[float, float]
    ) -> Schedule:
        kinds = [k for k, n in counts.items() for _ in range(n)]
        rng.shuffle(kinds)
        gaps = [rng.uniform(*warmup)] + [rng.uniform(*gap) for _ in kinds[1:]]
        return cls(list(zip(gaps, kinds, strict=True)))

    def remaining(self, index: int) -> float:
        return sum(g + FAULT_COST[k] for g, k in self.events[index:])


@dataclass
class Run:
    """One chaos run: the workers, the private Redis, the submitter and what was done."""

    platform: Any
    tag: str
    seed: int
    tmp: Path
    redis: PrivateRedis
    cluster: Cluster
    claim_log: ClaimLog
    rng: random.Random  # run-time choices (which worker, which child), apart from the schedule's
    t0: float = field(default_factory=time.monotonic)
    kills: list[Kill] = field(default_factory=list)
    shutdowns: list[Shutdown] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    accepted: set[int] = field(default_factory=set)
    submitter: subprocess.Popen[str] | None = None
    submitter_done: threading.Event = field(default_factory=threading.Event)

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}s] {msg}", flush=True)

    @property
    def engine(self) -> Any:
        return self.platform.engine

    # -- the client -------------------------------------------------------------------

    def start_submitter(self, items: list[Item], *, cap: int, deadline: float) -> None:
        plan = self.tmp / "plan.json"
        plan.write_text(
            json.dumps(
                {
                    "items": [vars(i) for i in items],
                    "cap": cap,
                    "deadline": deadline,
                }
            )
        )
        with open(self.tmp / "submitter.err", "w") as err:
            self.submitter = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.submitter", str(plan)],
                cwd=ROOT,
                env=service_env(self.cluster.settings),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        threading.Thread(target=self._read_submitter, daemon=True).start()

    def _read_submitter(self) -> None:
        assert self.submitter is not None and self.submitter.stdout is not None
        for line in self.submitter.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "OK":
                self.accepted.add(int(rest))
            elif word == "DONE":
                self.submitter_done.set()
        self.submitter_done.set()

    def move_deadline(self, seconds_from_now: float) -> None:
        if self.submitter is None or self.submitter.stdin is None or self.submitter.poll() is not None:
            return
        try:
            self.submitter.stdin.write(f"deadline {time.monotonic() + seconds_from_now}\n")
            self.submitter.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    # -- pauses -----------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        """Sleep, watching for worker processes that exit by themselves."""
        end = time.monotonic() + seconds
        while True:
            self.cluster.watch()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.25, left))

    # -- faults -----------------------------------------------------------------------

    def group_kill(self) -> None:
        slot = self.rng.choice(sorted(self.cluster.live))
        inc = self.cluster.live[slot]
        pids = inc.pids()
        before = running_on(self.engine, HOST, pids)
        at = db_now(self.engine)
        _, pids = self.cluster.kill_group(slot)
        after = db_now(self.engine)
        victims = before | running_on(self.engine, HOST, pids)
        received = set(RECEIVED.findall(inc.log.read_text(errors="replace"))) | set(self.unacked())
        self.kills.append(Kill("group", at, after, frozenset(pids), victims, received))
        self.say(
            f"SIGKILL group of worker {slot}#{inc.number} ({len(pids)} processes): {len(victims)} running"
        )
        self.pause(self.rng.uniform(0.2, 2.0))
        new = self.cluster.start(slot)
        self.say(f"worker {slot}#{new.number} started")

    def unacked(self) -> dict[str, str]:
        """Task id → job id of every message delivered but not acked (kombu's ``unacked``
        hash): after a group kill it holds what the dead worker had taken."""
        out: dict[str, str] = {}
        try:
            raw = self.redis.client().hgetall("unacked")
        except redis.RedisError:
            return out
        for value in raw.values():
            try:
                headers = json.loads(value)[0].get("headers") or {}
            except (ValueError, IndexError, AttributeError):
                continue
            if headers.get("id"):
                out[str(headers["id"])] = str(headers.get("conveyor_job_id") or "")
        return out

    def child_kill(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            children = {p: s for s, inc in self.cluster.live.items() for p in inc.pids() if p != inc.proc.pid}
            running = [r for r in running_jobs(self.engine, HOST) if r[2] in children]
            if running or time.monotonic() > deadline:
                break
            self.pause(0.2)
        if not running:
            self.say("no pool child is running a job: child kill skipped")
            self.notes.append("child kill skipped: nothing running")
            return
        job_id, attempt, pid, _, _ = self.rng.choice(sorted(running))
        at = db_now(self.engine)
        self.cluster.kill_child(pid)
        after = db_now(self.engine)
        victims = {(job_id, attempt)} | running_on(self.engine, HOST, [pid])
        self.kills.append(Kill("child", at, after, frozenset({pid}), victims))
        self.say(f"SIGKILL pool child {pid} of worker {children[pid]} running {job_id}#{attempt}")

    def sigterm(self) -> None:
        """SIGTERM a worker, preferably one running a job that outlasts the soft timeout."""
        slot = None
        deadline = time.monotonic() + 20
        while slot is None and time.monotonic() < deadline:
            now = db_now(self.engine)
            for s_, inc in sorted(self.cluster.live.items()):
                pids = inc.pids()
                for _, _, pid, started, payload in running_jobs(self.engine, HOST):
                    remaining = float((payload or {}).get("sleep") or 0) - (now - started).total_seconds()
                    if pid in pids and remaining > SOFT_SHUTDOWN + 1:
                        slot = s_
            if slot is None:
                self.pause(0.25)
        if slot is None:
            slot = self.rng.choice(sorted(self.cluster.live))
            self.notes.append("SIGTERM found no job outlasting the soft timeout")
        inc = self.cluster.live[slot]
        pids = inc.pids()
        running = running_on(self.engine, HOST, pids)
        at = db_now(self.engine)
        signalled = time.monotonic()
        self.cluster.sigterm(slot)
        bound = SOFT_SHUTDOWN + SHUTDOWN_SLACK
        exit_s: float | None = None
        try:
            inc.proc.wait(timeout=bound + 20)
            exit_s = time.monotonic() - signalled
        except subprocess.TimeoutExpired:
            self.say(f"worker {slot}#{inc.number} still up {bound + 20:.0f}s after SIGTERM: SIGKILL")
        exited_at = db_now(self.engine) if exit_s is not None else None
        self.shutdowns.append(
            Shutdown(at, exited_at, exit_s, bound, inc.proc.returncode, frozenset(pids), running)
        )
        if exit_s is None:
            kill_at = db_now(self.engine)
            left = running_on(self.engine, HOST, pids)
            os.killpg(inc.proc.pid, signal.SIGKILL)
            inc.proc.wait(timeout=10)
            wait_gone(pids)
            received = set(RECEIVED.findall(inc.log.read_text(errors="replace"))) | set(self.unacked())
            self.kills.append(Kill("group", kill_at, db_now(self.engine), frozenset(pids), left, received))
        self.say(
            f"SIGTERM worker {slot}#{inc.number} with {len(running)} running: exit "
            f"{'none' if exit_s is None else f'{exit_s:.2f}s'} code {inc.proc.returncode} (bound {bound}s)"
        )
        self.pause(self.rng.uniform(0.2, 1.0))
        new = self.cluster.start(slot)
        self.say(f"worker {slot}#{new.number} started")

    def redis_restart(self) -> None:
        at = db_now(self.engine)
        began = time.monotonic()
        # SHUTDOWN NOSAVE from a client that does not retry (PrivateRedis.shutdown_nosave's
        # client retries its lost connection for seconds, which would stretch the outage).
        client = redis.Redis(port=self.redis.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(redis.ConnectionError):
            client.shutdown(nosave=True)
        client.close()
        assert self.redis.proc is not None
        self.redis.proc.wait(timeout=10)
        time.sleep(self.rng.uniform(0.2, 3.0))
        self.redis.start()
        self.outages.append(Outage("redis", at, db_now(self.engine)))
        self.say(f"Redis restarted empty after {time.monotonic() - began:.2f}s down")

    def fault(self, kind: str) -> None:
        {
            "group": self.group_kill,
            "child": self.child_kill,
            "sigterm": self.sigterm,
            "redis": self.redis_restart,
        }[kind]()

    def samples(self) -> int:
        return sum(len(k.victims) for k in self.kills)


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = private_redis()
    yield server
    server.stop()


def _seed() -> int:
    raw = os.environ.get("CHAOS_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(1, 2**31)


def chaos(
    platform: Any,
    tmp_path: Path,
    redis_server: PrivateRedis,
    tag: str,
    *,
    n_jobs: int,
    sleep: tuple[float, float],
    long_share: float,
    counts: dict[str, int],
    gap: tuple[float, float],
    extra_env: dict[str, str],
    lease_only: bool,
    max_extra_kills: int,
) -> tuple[Run, ChaosResult, list[str]]:
    """Run a schedule drawn from ``counts``; returns the run, the check and the failures."""
    seed = _seed()
    rng = random.Random(seed)  # the jobs and the schedule: the same for the same seed
    n_jobs = int(os.environ.get("CHAOS_JOBS", n_jobs))
    print(f"\nchaos seed={seed} jobs={n_jobs} faults={counts} (replay with CHAOS_SEED={seed})", flush=True)
    settings = platform.settings.with_urls(redis_server.url, platform.settings.database_url)
    env = default_timer_env(CONVEYOR_SOFT_SHUTDOWN_TIMEOUT=str(SOFT_SHUTDOWN), **extra_env)
    print(f"worker env: {env}", flush=True)
    claim_log = ClaimLog(platform.engine, tag)
    run = Run(
        platform=platform,
        tag=tag,
        seed=seed,
        tmp=tmp_path,
        redis=redis_server,
        cluster=Cluster(
            settings,
            queues=[q.name for q in platform.queues],
            log_dir=tmp_path,
            env=env,
            concurrency=CONCURRENCY,
        ),
        claim_log=claim_log,
        rng=random.Random(seed + 1),
    )
    run.cluster.say = run.say
    items = make_items(rng, tag, n_jobs, sleep=sleep, long_share=long_share)
    schedule = Schedule.draw(rng, counts, gap, warmup=(3.0, 6.0))
    expected = expected_jobs(items)
    failures: list[str] = []
    claim_log.install()
    try:
        return _run(
            run,
            items,
            expected,
            schedule,
            failures,
            gap=gap,
            max_extra_kills=max_extra_kills,
            lease_only=lease_only,
        )
    finally:
        claim_log.uninstall()


def _run(
    run: Run,
    items: list[Item],
    expected: list[ExpectedJob],
    schedule: Schedule,
    failures: list[str],
    *,
    gap: tuple[float, float],
    max_extra_kills: int,
    lease_only: bool,
) -> tuple[Run, ChaosResult, list[str]]:
    platform, tag, seed = run.platform, run.tag, run.seed
    try:
        for slot in ("A", "B"):
            run.cluster.start(slot)
        run.say(f"workers up; schedule: {[(round(g, 1), k) for g, k in schedule.events]}")
        # At most one job per worker slot waits in the queue: every slot stays busy, and a
        # recovered job is not measured behind a backlog the run itself piled up.
        run.start_submitter(items, cap=2 * CONCURRENCY, deadline=time.monotonic() + schedule.remaining(0))
        for index, (pause_s, kind) in enumerate(schedule.events):
            run.pause(pause_s)
            run.fault(kind)
            run.move_deadline(schedule.remaining(index + 1))
        extra = 0
        while run.samples() < MIN_SAMPLES + 4 and extra < max_extra_kills:
            run.pause(run.rng.uniform(*gap))
            run.group_kill()
            extra += 1
        if extra:
            run.say(f"{extra} extra group kill(s) for enough recovery samples")
        run.move_deadline(0.0)
        end = time.monotonic() + 120
        while not run.submitter_done.is_set() and time.monotonic() < end:
            run.pause(0.5)
        run.say(f"submitter done: {len(run.accepted)}/{len(items)} items accepted")
        accepted = [items[i] for i in sorted(run.accepted)]
        if len(accepted) != len(items):
            failures.append(f"only {len(accepted)} of {len(items)} submissions were accepted")
        expected = expected_jobs(accepted)
        drain_end = time.monotonic() + DRAIN_TIMEOUT
        while time.monotonic() < drain_end and not _all_terminal(platform.engine, expected):
            run.pause(1.0)
        if _all_terminal(platform.engine, expected):
            run.say("drained")
        else:
            run.say("drain deadline passed")
            _explain_stuck(run, expected)
    finally:
        run.cluster.stop_all()
        if run.submitter is not None:
            if run.submitter.poll() is None:
                run.submitter.kill()
            run.submitter.wait(timeout=10)
            for pipe in (run.submitter.stdin, run.submitter.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
    crashes = run.cluster.all_crashes()
    _, cancels = run.cluster.log_evidence()
    result = check(
        platform.engine,
        expected=expected,
        note_prefix=f"{tag}-",
        claim_log=run.claim_log,
        kills=run.kills,
        shutdowns=run.shutdowns,
        outages=run.outages,
        worker_crashes=crashes,
        crash_budget=platform.stages[EFFECT].max_attempts,
        lease_only=lease_only,
    )
    kinds = [k.kind for k in run.kills]
    run.say(
        f"seed={seed} group_kills={kinds.count('group')} child_kills={kinds.count('child')} "
        f"sigterms={len(run.shutdowns)} redis_restarts={len(run.outages)} "
        f"celery_connection_loss_cancels={len(cancels)} notes={run.notes}"
    )
    for c in cancels:
        print(f"  connection-loss cancel: {c}", flush=True)
    if not result.zeros():
        failures.append(f"checker: {result.line()}")
    if len(result.recovery) < MIN_SAMPLES:
        failures.append(f"only {len(result.recovery)} recovery samples (need {MIN_SAMPLES})")
    if not result.recovery_p95_s <= RECOVERY_P95_BOUND:
        failures.append(f"recovery p95 {result.recovery_p95_s:.2f}s > {RECOVERY_P95_BOUND}s")
    if result.stranded:
        failures.append(f"{len(result.stranded)} job(s) claimed more than 30 s after a fault")
    return run, result, failures


def _explain_stuck(run: Run, expected: list[ExpectedJob]) -> None:
    """Evidence for jobs still not terminal: their row, and whether a message of theirs
    sits in kombu's ``unacked`` hash (taken by a worker, never acked)."""
    from sqlalchemy import text

    ids = [j.id for j in expected]
    with run.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, status, attempts, lease_owner, celery_task_id, published_at, broker_epoch, "
                "created_at, clock_timestamp() AS now FROM jobs WHERE id = ANY(:ids) "
                "AND status NOT IN ('succeeded', 'dead', 'cancelled', 'expired', 'skipped')"
            ),
            {"ids": ids},
        ).mappings()
        stuck = [dict(r) for r in rows]
    unacked = run.unacked()
    epoch = run.redis.client().get("conveyor:epoch")
    kills = [(k.kind, k.at.time().isoformat()) for k in run.kills]
    print(f"current broker epoch {epoch!r}; kills at {kills}", flush=True)
    for row in stuck[:10]:
        held = [t for t, j in unacked.items() if j == row["id"]]
        print(
            f"  stuck {row['id']}: {row['status']} attempts={row['attempts']} owner={row['lease_owner']} "
            f"task={row['celery_task_id']} created={row['created_at'].time()} "
            f"published={row['published_at'].time() if row['published_at'] else None} "
            f"epoch={row['broker_epoch']} now={row['now'].time()}; in unacked: {held or 'no'}",
            flush=True,
        )


def _all_terminal(engine: Any, expected: list[ExpectedJob]) -> bool:
    from sqlalchemy import text

    with engine.connect() as conn:
        rows = {
            str(r.id): str(r.status)
            for r in conn.execute(
                text("SELECT id, status FROM jobs WHERE id = ANY(:ids)"), {"ids": [j.id for j in expected]}
            )
        }
    terminal = {"succeeded", "dead", "cancelled", "expired", "skipped"}
    for job in expected:
        if job.kind == "tail":
            assert job.head is not None
            if rows.get(job.head) != "succeeded":
                continue
        if rows.get(job.id) not in terminal:
            return False
    return True


@pytest.mark.timeout(480)
def test_chaos_kills_shutdown_and_redis_wipe(
    platform: Any, tmp_path: Path, redis_server: PrivateRedis, tag: str
) -> None:
    """1,000 jobs; ≥3 group kills, a pool-child kill, a bounded SIGTERM, an empty Redis."""
    started = time.monotonic()
    run, result, failures = chaos(
        platform,
        tmp_path,
        redis_server,
        tag,
        n_jobs=1000,
        sleep=(0.15, 1.0),
        long_share=0.02,
        counts={"group": 6, "child": 1, "sigterm": 1, "redis": 1},
        gap=(3.5, 9.0),
        extra_env={},
        lease_only=False,
        max_extra_kills=3,
    )
    if not run.shutdowns:
        failures.append("no SIGTERM was sent")
    failures += [f"bounded shutdown: {p}" for p in result.shutdown_problems]
    print(f"chaos run took {time.monotonic() - started:.1f}s", flush=True)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(420)
def test_chaos_takeover_by_lease_alone(
    platform: Any, tmp_path: Path, redis_server: PrivateRedis, tag: str
) -> None:
    """Same-host PID detection off: every takeover goes through the lease (p95 ≤ 15 s)."""
    started = time.monotonic()
    _, _, failures = chaos(
        platform,
        tmp_path,
        redis_server,
        tag,
        n_jobs=300,
        sleep=(0.5, 2.5),
        long_share=0.0,
        counts={"group": 6, "child": 2},
        gap=(3.0, 7.0),
        extra_env={"CONVEYOR_DETECT_LOCAL_DEAD_OWNERS": "false"},
        lease_only=True,
        max_extra_kills=3,
    )
    print(f"chaos run took {time.monotonic() - started:.1f}s", flush=True)
    assert not failures, "\n".join(failures)
