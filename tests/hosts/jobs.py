"""What the host tests do to jobs and read back: barrier jobs, copies of their messages,
skipped copies, takeovers (all on the database's clock)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from conveyor.store.db.schema import job_events
from tests.helpers import eventually, job_row, publish_again

# Below the Redis client's 30 s socket timeout, which would end the barrier's BLPOP with a
# connection error (an infrastructure requeue): the tests release their barriers sooner.
BARRIER_TIMEOUT = 25.0


def held(platform: Any, tag: str, note: str) -> Any:
    """Submit an effect job that blocks at the barrier ``tag`` until :func:`release`."""
    payload = {"note": note, "barrier": tag, "barrier_timeout": BARRIER_TIMEOUT}
    return platform.submit("conveyor.demo.effect", payload)


def running_for(platform: Any, tag: str, note: str, seconds: float) -> Any:
    """Submit an effect job that notes its start at the barrier ``tag`` and then runs for
    ``seconds`` (each attempt)."""
    payload = {"note": note, "barrier": tag, "barrier_timeout": 0.01, "sleep": seconds}
    return platform.submit("conveyor.demo.effect", payload)


def started(platform: Any, tag: str, n: int, timeout: float = 60) -> list[str]:
    """Wait until ``n`` attempts reached the barrier; their ``job:attempt:pid`` notes."""
    key = f"{tag}:started"

    def reached() -> list[bytes] | None:
        notes: list[bytes] = platform.redis.lrange(key, 0, -1)
        return notes if len(notes) >= n else None

    return [note.decode() for note in eventually(reached, timeout)]


def release(platform: Any, tag: str, n: int = 20) -> None:
    """Let ``n`` attempts waiting at the barrier go on."""
    platform.redis.rpush(f"{tag}:go", *["go"] * n)


def send_copies(platform: Any, job_ids: Sequence[str]) -> None:
    """Publish one more message for each job (a duplicate delivery, as a redelivery is)."""
    for job_id in job_ids:
        publish_again(platform, job_row(platform, job_id), task_id=str(uuid.uuid4()))


def skipped(platform: Any, job_ids: Sequence[str], reason: str = "live_lease") -> dict[str, int]:
    """How many copies of each job a worker acknowledged unrun for ``reason``."""
    wanted = set(job_ids)
    counts = dict.fromkeys(job_ids, 0)
    for _, fields in platform.redis.xrange(platform.discarded_stream):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f.get("job") in wanted and f.get("reason") == reason:
            counts[f["job"]] += 1
    return counts


def takeovers(platform: Any, job_id: str) -> list[dt.datetime]:
    """When the job's attempts were found stalled and taken over (the database's clock)."""
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(job_events.c.created_at)
            .where(job_events.c.job_id == job_id, job_events.c.topic == "job.stalled")
            .order_by(job_events.c.id)
        ).all()
    return [r[0] for r in rows]


def story(platform: Any, job_ids: Sequence[str]) -> str:
    """The jobs' owners and events, for an assertion message."""
    lines = []
    with platform.engine.connect() as conn:
        for job_id in job_ids:
            row = platform.store.get(conn, job_id)
            lines.append(
                f"job {job_id}: {row['status']} attempt {row['attempts']} owner {row['lease_owner']}"
            )
            events = conn.execute(
                select(job_events.c.created_at, job_events.c.topic, job_events.c.body)
                .where(job_events.c.job_id == job_id)
                .order_by(job_events.c.id)
            ).all()
            lines += [f"  {e.created_at:%H:%M:%S.%f} {e.topic} {e.body}" for e in events]
    return "\n".join(lines)
