"""The chaos checker: did every accepted job reach a terminal state with exactly one effect,
and how long did takeovers take?

Reusable with any fault schedule. A run records what it did (:class:`Kill`, :class:`Shutdown`,
:class:`Outage`) while :class:`ClaimLog` records every claim and status change of ``jobs`` in
Postgres (a trigger: database time, nothing is sampled), and :func:`check` prints one line::

    lost=0 duplicated=0 unexpected=0 nonterminal=0 dead=0 worker_crashes=0 recovery_p95_s=11.8

Definitions (all times are Postgres ``clock_timestamp()``):

* ``lost``: an accepted job without a row, a job that ended ``cancelled``/``expired``/
  ``skipped`` although nobody asked, a succeeded job without its effect row, or the second
  link of a chain whose first link succeeded but which never appeared.
* ``duplicated``: effect notes with more than one row (``demo_effects`` has no unique key).
* ``unexpected``: effect rows of no accepted job, of a job that did not succeed, or written
  by an attempt other than the one that completed the job.
* ``nonterminal``: jobs not in a terminal state when the check runs (after the drain).
* ``dead``: dead jobs, leaving out those whose crash budget the run's own kills used up
  (a job killed ``max_attempts`` times may rightly be dead): those are listed separately.
* ``worker_crashes``: passed in by the run (process exits it did not cause).
* ``recovery_p95_s``: for every attempt running on a killed process, kill time (taken right
  before the signal) to the job's next claim; nearest-rank p95. An attempt never claimed
  again counts as infinite unless its job was dead-lettered (then: time to the burial).
  A victim requeued, then waiting in the queue across a later fault, counts its detection
  plus its wait from the end of that fault (the later fault's outage is its own sample's).
  ``recovery_p95_s_lease`` is the same figure, printed by a run whose workers do not detect
  dead owners on their own host (every takeover went through the lease).

A second line adds what the promises around those need: ``detect_p95_s`` (kill to the
requeue or takeover, without the queue wait), attempts counted beyond one per kill
(``overcounted``: only crashes count), bounded-shutdown problems, and ``stranded`` jobs
(claimed more than 30 s after a kill or an outage they waited across, or whose message a
killed worker had taken).
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

TERMINAL = frozenset({"succeeded", "dead", "cancelled", "expired", "skipped"})
CLAIMABLE = frozenset({"queued", "retrying", "throttled"})


# -- what the run records --------------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedJob:
    """An accepted job: a single stage, or the first (``head``) or second (``tail``) link
    of a two-link chain. A tail is expected only once its head succeeded."""

    id: str
    note: str
    kind: str  # "single" | "head" | "tail"
    head: str | None = None


@dataclass
class Kill:
    """A SIGKILL the run sent: to a worker's whole process group or to one pool child."""

    kind: str  # "group" | "child"
    at: dt.datetime  # database time right before the signal
    after: dt.datetime  # database time once every signalled process was gone
    pids: frozenset[int]
    victims: set[tuple[str, int]] = field(default_factory=set)  # (job id, attempt) seen running
    received: set[str] = field(default_factory=set)  # Celery task ids the killed processes had taken


@dataclass
class Shutdown:
    """A SIGTERM the run sent to a worker's main process (bounded warm shutdown)."""

    at: dt.datetime
    exited_at: dt.datetime | None
    exit_s: float | None  # wall time from the signal to the exit (None: did not exit)
    bound_s: float
    returncode: int | None
    pids: frozenset[int]
    running: set[tuple[str, int]] = field(default_factory=set)  # attempts running at the signal


@dataclass
class Outage:
    """A fault that is not a kill (an empty-Redis restart)."""

    kind: str
    at: dt.datetime  # database time when it began
    until: dt.datetime | None = None  # database time when the service was back


# -- the claim log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRow:
    """One claim or status change of a job, as the trigger saw it."""

    at: dt.datetime
    attempts: int
    old_attempts: int
    status: str
    old_status: str
    owner: str | None
    started_at: dt.datetime | None
    task_id: str | None = None

    @property
    def is_claim(self) -> bool:
        return self.attempts > self.old_attempts


class ClaimLog:
    """A trigger on ``jobs`` writing each claim and status change to a table of its own.

    Observation only: it never changes a job. Install it before the run, drop it after.
    """

    def __init__(self, engine: Engine, name: str) -> None:
        if not name.replace("_", "").isalnum():
            raise ValueError(f"bad claim log name {name!r}")
        self.engine = engine
        self.table = f"chaos_claims_{name}"
        self.fn = f"chaos_log_{name}"

    def install(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    f"""
                    CREATE TABLE IF NOT EXISTS {self.table} (
                      id bigserial PRIMARY KEY, job_id text NOT NULL, attempts int NOT NULL,
                      old_attempts int NOT NULL, status text NOT NULL, old_status text NOT NULL,
                      lease_owner text, started_at timestamptz, task_id text,
                      at timestamptz NOT NULL DEFAULT clock_timestamp())
                    """
                )
            )
            conn.execute(text(f"CREATE INDEX IF NOT EXISTS {self.table}_job ON {self.table} (job_id, id)"))
            conn.execute(
                text(
                    f"""
                    CREATE OR REPLACE FUNCTION {self.fn}() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN
                      INSERT INTO {self.table}
                        (job_id, attempts, old_attempts, status, old_status, lease_owner, started_at,
                         task_id)
                      VALUES (NEW.id, NEW.attempts, OLD.attempts, NEW.status, OLD.status,
                              NEW.lease_owner, NEW.started_at, NEW.celery_task_id);
                      RETURN NULL;
                    END $$
                    """
                )
            )
            conn.execute(text(f"DROP TRIGGER IF EXISTS {self.fn} ON jobs"))
            conn.execute(
                text(
                    f"""
                    CREATE TRIGGER {self.fn} AFTER UPDATE ON jobs FOR EACH ROW
                    WHEN (OLD.attempts IS DISTINCT FROM NEW.attempts
                          OR OLD.status IS DISTINCT FROM NEW.status
                          OR OLD.celery_task_id IS DISTINCT FROM NEW.celery_task_id)
                    EXECUTE FUNCTION {self.fn}()
                    """
                )
            )

    def uninstall(self, *, keep_table: bool = False) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER IF EXISTS {self.fn} ON jobs"))
            conn.execute(text(f"DROP FUNCTION IF EXISTS {self.fn}()"))
            if not keep_table:
                conn.execute(text(f"DROP TABLE IF EXISTS {self.table}"))

    def rows(self, job_ids: Iterable[str]) -> dict[str, list[LogRow]]:
        """Every logged change of these jobs, in commit-independent insertion order."""
        out: dict[str, list[LogRow]] = defaultdict(list)
        with self.engine.connect() as conn:
            result = conn.execute(
                text(
                    f"SELECT job_id, at, attempts, old_attempts, status, old_status, lease_owner, "
                    f"started_at, task_id FROM {self.table} WHERE job_id = ANY(:ids) ORDER BY id"
                ),
                {"ids": list(job_ids)},
            )
            for r in result:
                out[str(r.job_id)].append(
                    LogRow(
                        at=r.at,
                        attempts=int(r.attempts),
                        old_attempts=int(r.old_attempts),
                        status=str(r.status),
                        old_status=str(r.old_status),
                        owner=r.lease_owner,
                        started_at=r.started_at,
                        task_id=r.task_id,
                    )
                )
        for rows in out.values():  # row locks serialise the changes of one job: clock order
            rows.sort(key=lambda x: x.at)
        return out


# -- reading the database during a run ---------------------------------------------------------


def db_now(engine: Engine) -> dt.datetime:
    """Postgres's ``clock_timestamp()``."""
    with engine.connect() as conn:
        value = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    assert isinstance(value, dt.datetime)
    return value


def owner_pid(owner: str | None, host: str) -> int | None:
    """The pid of a ``host:pid[:thread]`` lease owner on ``host``."""
    if not owner:
        return None
    h, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    return int(pid) if h == host and pid.isdigit() else None


def running_on(engine: Engine, host: str, pids: Iterable[int]) -> set[tuple[str, int]]:
    """(job id, attempt) of every running job whose lease owner is one of ``pids``."""
    wanted = set(pids)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, attempts, lease_owner FROM jobs WHERE status = 'running'")).all()
    return {(str(r.id), int(r.attempts)) for r in rows if owner_pid(r.lease_owner, host) in wanted}


def running_jobs(engine: Engine, host: str) -> list[tuple[str, int, int, dt.datetime, Any]]:
    """(job id, attempt, owner pid, started_at, payload) of every running job on ``host``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, attempts, lease_owner, started_at, payload FROM jobs WHERE status = 'running'")
        ).all()
    out = []
    for r in rows:
        pid = owner_pid(r.lease_owner, host)
        if pid is not None:
            out.append((str(r.id), int(r.attempts), pid, r.started_at, r.payload))
    return out


# -- the check -------------------------------------------------------------------------------


@dataclass
class ChaosResult:
    """What :func:`check` found; ``line()`` is the one-line summary."""

    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    nonterminal: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    excused_dead: list[str] = field(default_factory=list)
    worker_crashes: list[str] = field(default_factory=list)
    recovery: list[float] = field(default_factory=list)
    recovery_notes: list[str] = field(default_factory=list)
    detect: list[float] = field(default_factory=list)  # kill to requeue/takeover (no queue wait)
    unrecovered: list[str] = field(default_factory=list)
    lease_only: bool = False
    overcounted: list[str] = field(default_factory=list)
    undercounted: list[str] = field(default_factory=list)
    shutdown_problems: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)
    taken_before_claim: list[float] = field(default_factory=list)  # kill to claim, seconds
    max_wait_s: float = 0.0
    max_wait_note: str = ""
    details: list[str] = field(default_factory=list)
    jobs: int = 0
    effects: int = 0

    @property
    def recovery_p95_s(self) -> float:
        return p95(self.recovery)

    def line(self) -> str:
        text_ = (
            f"lost={len(self.lost)} duplicated={len(self.duplicated)} unexpected={len(self.unexpected)} "
            f"nonterminal={len(self.nonterminal)} dead={len(self.dead)} "
            f"worker_crashes={len(self.worker_crashes)} recovery_p95_s={_fmt(self.recovery_p95_s)}"
        )
        if self.lease_only:
            text_ += f" recovery_p95_s_lease={_fmt(self.recovery_p95_s)}"
        return text_

    def extra_line(self) -> str:
        return (
            f"jobs={self.jobs} effects={self.effects} recovery_samples={len(self.recovery)} "
            f"recovery_max_s={_fmt(max(self.recovery, default=0.0))} detect_p95_s={_fmt(p95(self.detect))} "
            f"excused_dead={len(self.excused_dead)} overcounted={len(self.overcounted)} "
            f"undercounted={len(self.undercounted)} shutdown_problems={len(self.shutdown_problems)} "
            f"stranded={len(self.stranded)} max_claim_wait_s={_fmt(self.max_wait_s)} "
            f"taken_before_claim={len(self.taken_before_claim)} "
            f"taken_before_claim_max_s={_fmt(max(self.taken_before_claim, default=0.0))}"
        )

    def zeros(self) -> bool:
        found = (
            self.lost,
            self.duplicated,
            self.unexpected,
            self.nonterminal,
            self.dead,
            self.worker_crashes,
        )
        return not any(found)


def p95(samples: Sequence[float]) -> float:
    """Nearest-rank 95th percentile (``nan`` without samples)."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else "nan" if math.isnan(x) else f"{x:.2f}"


def _secs(a: dt.datetime, b: dt.datetime) -> float:
    return (b - a).total_seconds()


def confirmed_victims(kill: Kill, log: Mapping[str, list[LogRow]]) -> set[tuple[str, int]]:
    """The attempts the kill really cut short: seen running on a killed process, and not
    ended by that attempt itself before the processes were gone."""
    out = set()
    for job_id, attempt in kill.victims:
        ended_itself = any(
            r.attempts == attempt
            and not r.is_claim
            and r.old_status == "running"
            and r.status != "running"
            and r.at < kill.after
            for r in log.get(job_id, [])
        )
        if not ended_itself:
            out.add((job_id, attempt))
    return out


def counted_attempts(row: Mapping[str, Any], budget: int) -> int:
    """Attempts that count: ``attempts - uncounted``; before that column existed an
    uncounted attempt raised ``max_attempts`` by one instead."""
    if "uncounted" in row:
        return int(row["attempts"]) - int(row["uncounted"] or 0)
    return int(row["attempts"]) - (int(row["max_attempts"]) - budget)


def check(
    engine: Engine,
    *,
    expected: Sequence[ExpectedJob],
    note_prefix: str,
    claim_log: ClaimLog,
    kills: Sequence[Kill] = (),
    shutdowns: Sequence[Shutdown] = (),
    outages: Sequence[Outage] = (),
    worker_crashes: Sequence[str] = (),
    crash_budget: int = 4,
    lease_only: bool = False,
    strand_bound_s: float = 30.0,
    echo: bool = True,
) -> ChaosResult:
    """Compare the database with what was accepted and done to it; print the summary."""
    res = ChaosResult(lease_only=lease_only, worker_crashes=list(worker_crashes))
    ids = [j.id for j in expected]
    with engine.connect() as conn:
        rows = {
            str(r["id"]): dict(r)
            for r in conn.execute(text("SELECT * FROM jobs WHERE id = ANY(:ids)"), {"ids": ids}).mappings()
        }
        effect_rows: list[dict[str, Any]] = [
            dict(e)
            for e in conn.execute(
                text("SELECT id, job_id, attempt, note FROM demo_effects WHERE note LIKE :p ORDER BY id"),
                {"p": note_prefix.replace("_", r"\_") + "%"},
            ).mappings()
        ]
    log = claim_log.rows(ids)
    res.jobs = len(rows)
    res.effects = len(effect_rows)

    # (began, over): a kill is over at once; an outage when its service is back.
    faults = [(k.at, k.at) for k in kills] + [(o.at, o.until or o.at) for o in outages]

    # Kills: which attempts they cut short, and how long until each job was claimed again.
    hits: dict[str, int] = defaultdict(int)
    for kill in kills:
        for job_id, attempt in sorted(confirmed_victims(kill, log)):
            hits[job_id] += 1
            later = [r for r in log.get(job_id, []) if r.is_claim and r.attempts > attempt]
            if later:
                claimed = later[0].started_at or later[0].at
                freed = next((r for r in log.get(job_id, []) if _ends(r, attempt)), None)
                res.recovery.append(_recovery(kill.at, freed, claimed, faults))
                if freed is not None:
                    res.detect.append(max(0.0, _secs(kill.at, freed.at)))
                how = (
                    "taken over"
                    if freed is None or freed.is_claim
                    else f"{freed.status} at +{_secs(kill.at, freed.at):.2f}s"
                )
                if res.recovery[-1] < _secs(kill.at, claimed):
                    how += f", a fault during its queue wait (claimed at +{_secs(kill.at, claimed):.2f}s)"
                res.recovery_notes.append(
                    f"{res.recovery[-1]:.2f}s {kill.kind} {job_id}#{attempt}: {how}, "
                    f"claimed by {later[0].owner}"
                )
                continue
            ended = [
                r
                for r in log.get(job_id, [])
                if r.attempts == attempt and r.status in TERMINAL and r.at > kill.at
            ]
            if ended:
                res.recovery.append(max(0.0, _secs(kill.at, ended[0].at)))
                res.recovery_notes.append(
                    f"{res.recovery[-1]:.2f}s {kill.kind} {job_id}#{attempt} -> {ended[0].status}"
                )
                continue
            res.recovery.append(math.inf)
            res.unrecovered.append(
                f"{job_id}#{attempt} ({kill.kind} kill at {kill.at.isoformat()}); its changes: "
                + "; ".join(_change(r) for r in log.get(job_id, []))
            )

    troubled: list[str] = []  # jobs whose change history is worth printing

    # Messages a killed worker had taken but not claimed yet: still run within the bound.
    task_job: dict[str, str] = {j.id: j.id for j in expected}  # a first publish uses the job id
    for job_id, jl in log.items():
        for r in jl:
            if r.task_id:
                task_job[r.task_id] = job_id
    for kill in kills:
        for task_id in sorted(kill.received):
            taken = task_job.get(task_id)
            row = rows.get(taken) if taken else None
            if taken is None or row is None:
                continue
            jl = log.get(taken, [])
            if any(r.is_claim and r.task_id == task_id for r in jl):
                continue  # claimed by that delivery: a victim (or done), not this case
            before = [r for r in jl if r.at < kill.at]
            status = before[-1].status if before else "queued"
            if status not in CLAIMABLE or (before and before[-1].task_id not in (task_id, None)):
                continue  # not waiting for that very message when the worker died
            later = [r for r in jl if r.is_claim and r.started_at is not None and r.started_at > kill.at]
            wait = _secs(kill.at, later[0].started_at) if later and later[0].started_at else math.inf
            res.taken_before_claim.append(wait)
            if wait > strand_bound_s:
                troubled.append(taken)
                res.stranded.append(
                    f"{_describe(row, _job_of(expected, taken), hits)}: its message {task_id} was taken by "
                    f"a worker killed at {kill.at.isoformat()}, next claim {_fmt(wait)}s later"
                )

    # Jobs: terminal, each with its effect.
    by_note: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in effect_rows:
        by_note[str(e["note"])].append(e)
    expected_by_note = {j.note: j for j in expected}
    for job in expected:
        row = rows.get(job.id)
        if job.kind == "tail":
            assert job.head is not None
            head = rows.get(job.head)
            if head is None or head["status"] != "succeeded":
                continue  # never due: its head did not succeed (counted there)
        if row is None:
            res.lost.append(f"{job.id} ({job.kind} {job.note}): no job row")
            continue
        status = row["status"]
        if status not in TERMINAL:
            res.nonterminal.append(_describe(row, job, hits))
            troubled.append(job.id)
        elif status == "succeeded":
            if not [e for e in by_note.get(job.note, []) if e["job_id"] == job.id]:
                res.lost.append(f"{_describe(row, job, hits)}: succeeded without its effect row")
        elif status == "dead":
            if hits[job.id] >= crash_budget:
                res.excused_dead.append(_describe(row, job, hits))
            else:
                res.dead.append(_describe(row, job, hits))
                troubled.append(job.id)
        else:
            res.lost.append(f"{_describe(row, job, hits)}: ended {status} although nobody asked")

    # Effects: one per note, from the completing attempt of a succeeded, accepted job.
    for note, es in by_note.items():
        if len(es) > 1:
            res.duplicated.append(f"{note}: {len(es)} rows (attempts {[e['attempt'] for e in es]})")
        owner_job = expected_by_note.get(note)
        for e in es:
            erow = rows.get(str(e["job_id"]))
            if owner_job is None or owner_job.id != e["job_id"] or erow is None:
                res.unexpected.append(f"effect {e['id']} note={note} job={e['job_id']}: no such accepted job")
            elif erow["status"] != "succeeded":
                res.unexpected.append(
                    f"effect {e['id']} of {_describe(erow, owner_job, hits)}: job did not succeed"
                )
            elif int(e["attempt"]) != int(erow["attempts"]):
                res.unexpected.append(
                    f"effect {e['id']} of {_describe(erow, owner_job, hits)}: "
                    f"written by attempt {e['attempt']}"
                )

    # Attempt accounting: only crashes count, so a job that succeeded has counted one
    # attempt per kill that cut it short, plus the one that succeeded.
    for job in expected:
        row = rows.get(job.id)
        if row is None or row["status"] != "succeeded":
            continue
        counted = counted_attempts(row, crash_budget)
        if counted > hits[job.id] + 1:
            res.overcounted.append(f"{_describe(row, job, hits)}: counted {counted}")
            troubled.append(job.id)
        elif counted < hits[job.id] + 1:
            res.undercounted.append(f"{_describe(row, job, hits)}: counted {counted}")

    # Bounded shutdowns: the worker exits by itself in time; a job it cut short is requeued
    # uncounted at the deadline and later succeeds with one counted attempt.
    for sd in shutdowns:
        if sd.exit_s is None or sd.exit_s > sd.bound_s:
            res.shutdown_problems.append(
                f"SIGTERM at {sd.at.isoformat()}: exit after {sd.exit_s}s, bound {sd.bound_s}s"
            )
        if sd.returncode not in (0, None) and sd.exit_s is not None:
            res.shutdown_problems.append(f"SIGTERM at {sd.at.isoformat()}: exit code {sd.returncode}")
        for job_id, attempt in sorted(sd.running):
            end = next((r for r in log.get(job_id, []) if _ends(r, attempt)), None)
            srow = rows.get(job_id)
            sjob = next((j for j in expected if j.id == job_id), None)
            if srow is None or sjob is None:
                continue
            desc = _describe(srow, sjob, hits)
            if end is None or sd.exited_at is None or end.at > sd.exited_at:
                res.shutdown_problems.append(
                    f"{desc}: attempt {attempt} still running when the worker exited"
                )
                continue
            if end.status == "queued" and end.attempts == attempt:
                res.details.append(
                    f"shutdown cut {desc} short (requeued {_secs(sd.at, end.at):.2f}s after TERM)"
                )
                counted = counted_attempts(srow, crash_budget)
                succeeded = srow["status"] == "succeeded" and counted == hits[job_id] + 1
                # Killed afterwards as often as it may crash: dead, excused above, and the
                # shutdown's attempt still uncounted (every counted attempt was a kill).
                killed_out = srow["status"] == "dead" and hits[job_id] >= crash_budget == counted
                if not (succeeded or killed_out):
                    res.shutdown_problems.append(f"{desc}: cut short by a shutdown, counted {counted}")

    # A message a killed worker had taken (or a wiped Redis held) must still run soon:
    # no job waits claimable across a fault for longer than the bound after it.
    for job in expected:
        row = rows.get(job.id)
        if row is None:
            continue
        t0: dt.datetime | None = row["created_at"]
        for r in log.get(job.id, []):
            if r.is_claim:
                if t0 is not None and r.started_at is not None:
                    wait = _secs(t0, r.started_at)
                    if wait > res.max_wait_s:
                        res.max_wait_s = wait
                        near = [
                            f"{_secs(t0, f):+.1f}s" for f, over in faults if f <= r.started_at and over >= t0
                        ]
                        res.max_wait_note = (
                            f"{job.id} ({job.kind}) claimable at {t0.isoformat()}, claim of attempt "
                            f"{r.attempts} {wait:.2f}s later; faults in between at {near}"
                        )
                    # Time from the end of a fault the job waited across, to its claim.
                    worst = max(
                        (
                            _secs(max(t0, over), r.started_at)
                            for f, over in faults
                            if f <= r.started_at and over >= t0
                        ),
                        default=0.0,
                    )
                    if worst > strand_bound_s:
                        troubled.append(job.id)
                        res.stranded.append(
                            f"{_describe(row, job, hits)}: claimable since {t0.isoformat()}, claimed "
                            f"{worst:.1f}s after a fault"
                        )
                t0 = None
            elif r.status in CLAIMABLE and r.old_status not in CLAIMABLE:
                t0 = r.at

    for job_id in list(dict.fromkeys(troubled))[:10]:
        res.details.append(f"history of {job_id}: " + "; ".join(_change(r) for r in log.get(job_id, [])))

    if echo:
        print(res.line(), flush=True)
        print(res.extra_line(), flush=True)
        print(f"excused_dead (crash budget used up by the run's own kills): {res.excused_dead}", flush=True)
        print(f"recovery_samples_s={sorted(round(x, 2) for x in res.recovery)}", flush=True)
        slow = sorted(res.recovery_notes, key=lambda n: -float(n.split("s ", 1)[0]))[:5]
        print(f"slowest recoveries: {slow}", flush=True)
        print(f"longest claim wait: {res.max_wait_note}", flush=True)
        for title, items in (
            ("LOST", res.lost),
            ("DUPLICATED", res.duplicated),
            ("UNEXPECTED", res.unexpected),
            ("NONTERMINAL", res.nonterminal),
            ("DEAD", res.dead),
            ("WORKER CRASHES", res.worker_crashes),
            ("UNRECOVERED", res.unrecovered),
            ("OVERCOUNTED", res.overcounted),
            ("UNDERCOUNTED", res.undercounted),
            ("SHUTDOWN", res.shutdown_problems),
            ("STRANDED", res.stranded),
            ("NOTES", res.details),
        ):
            if items:
                print(f"{title} ({len(items)}):", flush=True)
                for item in items[:15]:
                    print(f"  {item}", flush=True)
    return res


def _change(r: LogRow) -> str:
    if r.status == r.old_status and r.attempts == r.old_attempts:
        return f"{r.at.time().isoformat()} {r.status}: published as {r.task_id}"
    return (
        f"{r.at.time().isoformat()} {r.old_status}#{r.old_attempts}->{r.status}#{r.attempts} "
        f"owner={r.owner} started={r.started_at.time().isoformat() if r.started_at else None} "
        f"task={r.task_id}"
    )


def _job_of(expected: Sequence[ExpectedJob], job_id: str) -> ExpectedJob:
    return next(j for j in expected if j.id == job_id)


def _recovery(
    killed: dt.datetime,
    freed: LogRow | None,
    claimed: dt.datetime,
    faults: Sequence[tuple[dt.datetime, dt.datetime]],
) -> float:
    """Seconds from a kill to the next claim of its victim. A victim freed to the queue
    that waits there across a later fault (another worker killed, Redis wiped) counts its
    detection, then its wait from the end of the last such fault only: the wait the later
    fault caused is that fault's recovery, not this one's."""
    whole = max(0.0, _secs(killed, claimed))
    if freed is None or freed.is_claim:
        return whole
    crossed = [over for began, over in faults if began <= claimed and over >= freed.at]
    if not crossed:
        return whole
    detect = max(0.0, _secs(killed, freed.at))
    return detect + max(0.0, _secs(max(freed.at, *crossed), claimed))


def _ends(r: LogRow, attempt: int) -> bool:
    """True when ``r`` ends ``attempt``: a later claim, or that attempt leaving ``running``."""
    if r.is_claim:
        return r.attempts > attempt
    return r.attempts == attempt and r.old_status == "running" and r.status != "running"


def _describe(row: Mapping[str, Any], job: ExpectedJob, hits: Mapping[str, int]) -> str:
    extra = ""
    if "uncounted" in row:
        extra = f" uncounted={row['uncounted']} requeues={row.get('requeues')}"
    return (
        f"{job.id} ({job.kind} {job.note}) status={row['status']} attempts={row['attempts']}"
        f"{extra} max_attempts={row['max_attempts']} killed={hits.get(job.id, 0)} "
        f"owner={row['lease_owner']} error={row.get('error_type')}: {str(row.get('last_error') or '')[:120]}"
    )
