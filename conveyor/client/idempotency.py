"""Strict idempotency: a submit that names an existing job must be the same request.

A stage declared ``idempotency="strict"`` (kept in the stage registry, so a client without
its code applies it too) refuses a submit whose ``job_id`` or idempotency key names a job
of another stage, or one submitted with another payload, with
:class:`conveyor.errors.IdempotencyConflict`: nothing is recorded. Payloads are compared
as canonical JSON, the stage's ``idempotency_ignore`` fields left out and its schema's
top-level defaults filled in (a client without the model sends none of them).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from conveyor.errors import IdempotencyConflict
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import NewJob


@dataclass(frozen=True)
class Strict:
    """The strict rule of one stage: the fields left out and the defaults filled in."""

    stage: str
    ignore: frozenset[str]
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, stage: str, ignore: Collection[str], schema: Mapping[str, Any]) -> Strict:
        """The rule of ``stage`` from its payload's JSON Schema."""
        props = schema.get("properties") or {}
        defaults = {k: v["default"] for k, v in props.items() if isinstance(v, Mapping) and "default" in v}
        return cls(stage, frozenset(ignore), defaults)

    def canonical(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """Each compared field's canonical JSON."""
        full = {**self.defaults, **payload}
        return {
            k: json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            for k, v in full.items()
            if k not in self.ignore
        }

    def check(self, conn: Connection, new: NewJob, found: str) -> None:
        """Raise :class:`IdempotencyConflict` if job ``found``, which a submit of ``new``
        returned instead of recording it, holds another request under ``new``'s id or key.
        A job a dedup policy returned (neither the id nor the key) is left alone."""
        columns = (jobs.c.id, jobs.c.stage, jobs.c.payload, jobs.c.idempotency_key)
        row = conn.execute(select(*columns).where(jobs.c.id == found)).mappings().first()
        if row is None:
            return
        named = row["id"] == new.id or (
            new.idempotency_key is not None and row["idempotency_key"] == new.idempotency_key
        )
        if not named:
            return
        by = "job id" if row["id"] == new.id else "idempotency key"
        if row["stage"] != self.stage:
            raise IdempotencyConflict(
                f"idempotency conflict: the {by} names job {found}, a {row['stage']} job, "
                f"not {self.stage}; nothing was recorded",
                job_id=found,
            )
        stored, asked = self.canonical(row["payload"] or {}), self.canonical(new.payload)
        differ = sorted(k for k in stored.keys() | asked.keys() if stored.get(k) != asked.get(k))
        if differ:
            raise IdempotencyConflict(
                f"idempotency conflict: the {by} names job {found} of {self.stage}, submitted "
                f"with another payload (differing fields: {', '.join(differ)}); nothing was recorded",
                job_id=found,
            )


__all__ = ["Strict"]
