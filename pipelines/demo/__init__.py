"""The self-check behind ``conveyor demo``: submit a known mix, then assert the outcome."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import func, select

from conveyor.platform import Platform
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters, jobs

TIMEOUT = 150.0


@dataclass
class Plan:
    """The jobs one run submitted, by what they are expected to do."""

    plain: list[str] = field(default_factory=list)
    flaky: list[str] = field(default_factory=list)
    broken: str = ""
    expired: str = ""
    delayed: str = ""

    def all(self) -> list[str]:
        """Every job id of the run."""
        return [*self.plain, *self.flaky, self.broken, self.expired, self.delayed]


def submit_mix(platform: Platform, *, jobs: int, flaky: int = 5) -> Plan:
    """Submit the self-check mix and return its plan."""
    run = uuid.uuid4().hex[:8]
    plan = Plan()
    plan.plain = [platform.submit("conveyor.demo.square", {"n": i}).id for i in range(jobs)]
    plan.flaky = [
        platform.submit("conveyor.demo.flaky", {"n": i, "fail_times": 1 + i % 2}).id for i in range(flaky)
    ]
    plan.broken = platform.submit("conveyor.demo.broken", {"n": 13}, label=f"broken record ({run})").id
    # Due in 3 s but expired after 1 s: it must end `expired` without ever starting.
    plan.expired = platform.submit(
        "conveyor.demo.effect", {"note": f"expired-{run}"}, delay=3, expires_in=1
    ).id
    plan.delayed = platform.submit("conveyor.demo.effect", {"note": f"delayed-{run}"}, delay=2).id
    return plan


def wait_terminal(
    platform: Platform, ids: list[str], console: Console, timeout: float = TIMEOUT
) -> dict[str, Any]:
    """Show progress until every job is terminal (or time is up); return rows by id."""
    deadline = time.monotonic() + timeout
    terminal = list(s.TERMINAL)
    with Progress(
        TextColumn("[bold]self-check"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("jobs", total=len(ids))
        while True:
            with platform.engine.connect() as conn:
                done = 0
                for chunk in _chunks(ids, 500):
                    done += conn.execute(
                        select(func.count())
                        .select_from(jobs)
                        .where(jobs.c.id.in_(chunk), jobs.c.status.in_(terminal))
                    ).scalar_one()
            bar.update(task, completed=done)
            if done == len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    with platform.engine.connect() as conn:
        rows: dict[str, Any] = {}
        for chunk in _chunks(ids, 500):
            rows.update(
                {r["id"]: r for r in conn.execute(select(jobs).where(jobs.c.id.in_(chunk))).mappings()}
            )
    return rows


def check(platform: Platform, plan: Plan, rows: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The assertions, as (what, ok, detail)."""
    results: list[tuple[str, bool, str]] = []
    ok_plain = sum(1 for i in plan.plain if rows[i]["status"] == s.SUCCEEDED)
    results.append((f"{len(plan.plain)} plain jobs succeeded", ok_plain == len(plan.plain), f"{ok_plain}"))
    retried = [rows[i] for i in plan.flaky]
    ok_retry = sum(1 for r in retried if r["status"] == s.SUCCEEDED and r["attempts"] > 1)
    results.append((f"{len(plan.flaky)} retried then succeeded", ok_retry == len(plan.flaky), f"{ok_retry}"))
    broken = rows[plan.broken]
    with platform.engine.connect() as conn:
        letter = (
            conn.execute(select(dead_letters).where(dead_letters.c.job_id == plan.broken)).mappings().first()
        )
    readable = letter is not None and "cannot be processed" in letter["message"]
    results.append(
        (
            "1 dead-lettered with a readable message",
            broken["status"] == s.DEAD and readable,
            letter["message"] if letter else "no DLQ entry",
        )
    )
    exp = rows[plan.expired]
    results.append(
        (
            "1 expired without running",
            exp["status"] == s.EXPIRED and exp["started_at"] is None,
            f"{exp['status']}",
        )
    )
    dl = rows[plan.delayed]
    on_time = (
        dl["status"] == s.SUCCEEDED and dl["started_at"] is not None and dl["started_at"] >= dl["run_at"]
    )
    results.append(
        (
            "1 delayed ran no earlier than its run_at",
            on_time,
            f"{dl['status']} run_at={dl['run_at']} started={dl['started_at']}",
        )
    )
    return results


SAMPLE_DOCUMENTS = {
    "beekeeping.md": "# Beekeeping\n\nBeekeepers inspect the **brood frames** weekly, checking the queen, "
    "honey stores and varroa mites before the summer nectar flow.",
    "lighthouse.html": "<html><body><h1>Lighthouse</h1><p>The keeper trimmed the wick and polished the "
    "Fresnel lens while the foghorn sounded.</p><script>ignored()</script></body></html>",
    "sourdough.txt": "A sourdough starter of rye flour ferments for days; wild yeast leavens the dough.",
    "broken.pdf": "%PDF-1.7\n this is not really a PDF",
}


def files_check(platform: Platform) -> list[tuple[str, bool, str]]:
    """A batch of sample documents end to end: one is corrupt and must fail, not block."""
    from pipelines.files import Upload, process_batch, search
    from tasks.files.models import batches

    owner = f"demo-{uuid.uuid4().hex[:6]}"
    batch_id = process_batch(platform, owner, [Upload(n, t.encode()) for n, t in SAMPLE_DOCUMENTS.items()])
    deadline = time.monotonic() + 120
    batch: Any = None
    while time.monotonic() < deadline:
        with platform.engine.connect() as conn:
            batch = conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one()
        if batch["status"] == "completed":
            break
        time.sleep(0.25)
    assert batch is not None
    hits = search(platform, "queen brood varroa honey", owner=owner)
    return [
        (
            "document batch completed (3 ready, the corrupt PDF failed)",
            batch["status"] == "completed" and (batch["ready"], batch["failed"]) == (3, 1),
            f"total={batch['total']} ready={batch['ready']} failed={batch['failed']}",
        ),
        (
            "search finds the beekeeping notes",
            bool(hits) and hits[0].name == "beekeeping.md",
            hits[0].name if hits else "-",
        ),
    ]


@contextmanager
def peers() -> Iterator[dict[str, str]]:
    """The local peers the families talk to (``demo_peers``): started before the demo's
    worker, whose extra environment (yielded) names them."""
    from config import HAS_EMAIL, HAS_PUBLISHER, HAS_TRADING

    with ExitStack() as stack:
        env: dict[str, str] = {}
        if HAS_EMAIL:
            from pipelines.email.demo import peers as email_peers

            env.update(stack.enter_context(email_peers()))
        if HAS_PUBLISHER:
            from pipelines.publisher.demo import peers as publisher_peers

            env.update(stack.enter_context(publisher_peers()))
        if HAS_TRADING:
            from pipelines.trading.demo import peers as trading_peers

            env.update(stack.enter_context(trading_peers()))
        yield env


def family_starts(platform: Platform) -> None:
    """What a family's check needs started early (the publisher's posts, one of them held
    by a window that ends while the rest of the demo runs; the trading user's import)."""
    from config import HAS_PUBLISHER, HAS_TRADING

    if HAS_PUBLISHER:
        from pipelines.publisher.demo import start as publisher_start

        publisher_start(platform)
    if HAS_TRADING:
        from pipelines.trading.demo import start as trading_start

        trading_start(platform)


def family_checks(platform: Platform) -> list[tuple[str, bool, str]]:
    """Each installed family's own check, through the peers :func:`peers` started."""
    from config import HAS_EMAIL, HAS_PUBLISHER, HAS_TRADING

    results: list[tuple[str, bool, str]] = []
    if HAS_EMAIL:
        from pipelines.email.demo import check as email_check

        results += email_check(platform)
    if HAS_PUBLISHER:
        from pipelines.publisher.demo import check as publisher_check

        results += publisher_check(platform)
    if HAS_TRADING:
        from pipelines.trading.demo import check as trading_check

        results += trading_check(platform)
    return results


def self_check(platform: Platform, console: Console, *, jobs: int = 300) -> bool:
    """Run the self-check end to end; print a report; True when every assertion holds."""
    started = time.monotonic()
    family_starts(platform)
    plan = submit_mix(platform, jobs=jobs)
    rows = wait_terminal(platform, plan.all(), console)
    results = check(platform, plan, rows) + files_check(platform) + family_checks(platform)
    for what, ok, detail in results:
        console.print(f"{'[green]✓' if ok else '[red]✗'}[/] {what}  [dim]{detail}[/dim]")
    passed = all(ok for _, ok, _ in results)
    console.print(f"self-check {'passed' if passed else 'FAILED'} in {time.monotonic() - started:.1f}s")
    return passed


def _chunks(items: list[str], n: int) -> list[list[str]]:
    return [items[i : i + n] for i in range(0, len(items), n)]
