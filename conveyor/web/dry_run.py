"""``POST /jobs/dry-run``: would this submit run now, and if not, why — without inserting.

The body is a submit's and is validated exactly as one (an unknown stage, an invalid
payload, a stage whose dedup key only its code computes: the same problems). Then the
rules a submit and a worker's claim apply are read, never written:

- ``idempotency_key``: the owner's key names an existing job (the submit would return it);
- ``deduplicated``: the stage's dedup policy finds a live holder of the payload's key
  (read as :meth:`conveyor.store.dedup_keys.Deduplicator.acquire` decides; its id only when the
  caller may see that job);
- ``delayed``: ``delay``/``run_at`` lies in the future; ``expired``: it expires first;
- ``lease_held``: another live job holds the stage's lease key;
- ``rate_limited`` / ``concurrency``: the queue's token bucket is empty, or the stage's
  slots (a deployment override's cap) are taken.

The last two are best-effort: they read Redis as it is now, and a stage's declared
concurrency cap lives in its code (only a ``CONVEYOR_STAGES`` override is known here), so
``would_run_now`` is a forecast; the worker's claim is the authority.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlalchemy import and_, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from conveyor.client.by_name import Client
from conveyor.client.owners import owned_key
from conveyor.client.registry import RegisteredStage
from conveyor.errors import SubmitFailed, describe
from conveyor.stage import checked_size, format_key
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import dedup_keys, jobs, leases
from conveyor.store.dedup_keys import FAILED
from conveyor.web.auth import Caller, Submitter, client_of
from conveyor.web.models import SubmitRequest
from conveyor.web.problems import responses

router = APIRouter(prefix="/jobs", tags=["jobs"])


class Reason(BaseModel):
    """One reason the job would not run now."""

    code: str = Field(
        description="idempotency_key, deduplicated, delayed, expired, lease_held, rate_limited, concurrency"
    )
    detail: str
    job_id: str | None = Field(None, description="the job in the way, when the caller may see it")
    until: dt.datetime | None = Field(None, description="when it would be due (delayed)")


class DryRun(BaseModel):
    """The forecast: ``would_run_now`` when no reason stands in the way."""

    would_run_now: bool
    reasons: list[Reason]
    best_effort: list[str] = Field(
        description="the checks answered from live Redis state or not known here (a forecast only)"
    )


@router.post(
    "/dry-run",
    response_model=DryRun,
    operation_id="dryRunJob",
    summary="Would this submit run now, and if not, why",
    description="Scope `submit`. The body of `POST /jobs`, validated as it is; nothing is inserted. "
    "Reasons: `idempotency_key`, `deduplicated`, `delayed`, `expired`, `lease_held`, `rate_limited`, "
    "`concurrency` (the last two best-effort).",
    responses=responses(401, 403, 413, 422, 503),
)
def dry_run(request: Request, caller: Submitter, body: SubmitRequest) -> DryRun:
    """The reasons a submit of ``body`` by the caller would not run now."""
    client = client_of(request)
    key = owned_key(caller.owner, body.idempotency_key)
    try:
        spec = client.stage(body.stage)
    except (DBAPIError, PoolTimeout) as exc:
        raise SubmitFailed(f"could not look up stage {body.stage!r}: {describe(exc)}") from exc
    payload = checked_size(spec.name, spec.validate(body.payload), client.settings.max_payload_bytes)
    # Refuses a stage whose key only its code computes, as a submit does.
    resolved = spec.resolve_dedup(payload) if body.dedup else None
    reasons: list[Reason] = []
    with reading(client.connections.engine) as conn:
        if key is not None:
            existing = conn.execute(select(jobs.c.id).where(jobs.c.idempotency_key == key)).scalar()
            if existing is not None:
                detail = "the idempotency key names an existing job; the submit would return it"
                reasons.append(Reason(code="idempotency_key", detail=detail, job_id=str(existing)))
        if resolved is not None and body.reuse != "always":
            holder = _dedup_holder(conn, client, resolved, body.reuse)
            if holder is not None:
                reasons.append(
                    _seen("deduplicated", "an equal job holds the stage's dedup key", holder, caller)
                )
        now = conn.execute(select(db_now())).scalar_one()
        now = now if now.tzinfo else now.replace(tzinfo=dt.UTC)  # SQLite's clock is naive UTC
        reasons += _timing(body, now)
        if spec.lease_key:
            reasons += _lease(conn, spec, payload, caller)
    reasons += _admission(client, spec)
    return DryRun(would_run_now=not reasons, reasons=reasons, best_effort=["rate_limited", "concurrency"])


def _seen(code: str, detail: str, holder: tuple[str, str | None], caller: Caller) -> Reason:
    """A reason naming the job in the way only when the caller may see it."""
    job_id, owner = holder
    return Reason(code=code, detail=detail, job_id=job_id if caller.sees(owner) else None)


def _dedup_holder(
    conn: Any, client: Client, resolved: tuple[str, str], reuse: str
) -> tuple[str, str | None] | None:
    """The live holder of (scope, key), by the rules of ``Deduplicator.acquire``'s ``free_if``."""
    scope, key = resolved
    row = (
        conn.execute(
            select(
                dedup_keys.c.mode,
                dedup_keys.c.expires_ms,
                jobs.c.id,
                jobs.c.owner,
                jobs.c.status,
                jobs.c.published_at,
            )
            .select_from(dedup_keys.outerjoin(jobs, jobs.c.id == dedup_keys.c.job_id))
            .where(and_(dedup_keys.c.scope == scope, dedup_keys.c.key == key))
        )
        .mappings()
        .one_or_none()
    )
    if row is None or row["id"] is None:
        return None
    now_ms = int(client.deduper.clock() * 1000)
    expired = row["expires_ms"] is not None and row["expires_ms"] <= now_ms
    status = row["status"]
    started = status != s.QUEUED or row["published_at"] is not None
    free = (
        (row["mode"] == "simple" and status in s.TERMINAL)
        or (row["mode"] in ("throttle", "id") and expired)
        or (row["mode"] == "debounce" and (expired or started))
        or (reuse == "if_failed" and status in FAILED)
    )
    return None if free else (str(row["id"]), row["owner"])


def _timing(body: SubmitRequest, now: dt.datetime) -> list[Reason]:
    """``delayed`` when due later than now; ``expired`` when it expires before it is due."""
    due = now + dt.timedelta(seconds=body.delay)
    if body.run_at is not None:
        due = body.run_at if body.run_at.tzinfo else body.run_at.replace(tzinfo=dt.UTC)
    out: list[Reason] = []
    if due > now:
        out.append(Reason(code="delayed", detail="it is due later", until=due))
        if body.expires_in is not None and now + dt.timedelta(seconds=body.expires_in) <= due:
            out.append(Reason(code="expired", detail="it would expire before it is due"))
    return out


def _lease(conn: Any, spec: RegisteredStage, payload: dict[str, Any], caller: Caller) -> list[Reason]:
    """``lease_held`` when a live job holds the stage's lease key for this payload."""
    try:
        lease = format_key(str(spec.lease_key), payload)
    except (KeyError, IndexError, ValueError):
        return []
    row = conn.execute(
        select(jobs.c.id, jobs.c.owner)
        .select_from(leases.join(jobs, jobs.c.id == leases.c.holder_job))
        .where(leases.c.key == lease, jobs.c.status.not_in(list(s.TERMINAL)))
    ).one_or_none()
    if row is None:
        return []
    return [_seen("lease_held", f"another job holds the lease {lease!r}", (str(row[0]), row[1]), caller)]


def _admission(client: Client, spec: RegisteredStage) -> list[Reason]:
    """Best-effort: the queue's token bucket and the stage's slots as Redis holds them now."""
    settings = client.settings
    rate = settings.rate_limits.get(spec.queue)
    cap = settings.stage_override(spec.name).concurrency
    out: list[Reason] = []
    try:
        r = client.connections.redis
        seconds, micros = r.time()
        now = int(seconds) + int(micros) / 1e6
        if rate is not None:
            burst = rate.burst or max(1.0, rate.rate)
            tokens, ts = r.hmget(f"{settings.key_prefix}rate:{spec.queue}", ["tokens", "ts"])
            level = burst if tokens is None else float(tokens) + max(0.0, now - float(ts or now)) * rate.rate
            if min(burst, level) < 1:
                out.append(Reason(code="rate_limited", detail=f"queue {spec.queue} is at its rate limit"))
        if cap is not None:
            held = r.zcount(f"{settings.key_prefix}slots:{spec.name}", int(now * 1000), "+inf")
            if int(held) >= cap:
                out.append(Reason(code="concurrency", detail=f"stage {spec.name} is at its concurrency cap"))
    except Exception:  # Redis away: no forecast of these; a submit would still be recorded
        return out
    return out


__all__ = ["router"]
