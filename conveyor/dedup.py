"""Deduplication policies: how submits of a stage collapse into one job (simple, throttle,
debounce, deterministic ids), and one submit's plan resolved from its payload.

What a stage declares and a client reads from the registry; the decision itself, against
the ``dedup_keys`` table and its Redis cache, is :mod:`conveyor.store.dedup_keys`'s.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from conveyor.errors import ConfigurationError

Mode = Literal["simple", "throttle", "debounce", "id"]
Reuse = Literal["never", "if_failed", "always"]
# The key, in a keyed job's stored options, of the plan it was submitted with (DedupPlan.stored).
PLAN_OPTION = "dedup_plan"


@dataclass(frozen=True)
class Dedup:
    """How submits of a stage collapse into one job.

    * ``simple``: while the holder is not terminal, a submit returns it.
    * ``throttle``: the first submit holds the key for ``ttl`` seconds, finished or not.
    * ``debounce``: submits within ``window`` replace the pending job's payload and push
      its start back, but never beyond ``max_wait`` after the first; the last payload runs.
    * ``id``: a deterministic id from ``fields`` (sha256 of canonical JSON, namespaced by
      stage) returns the same job in any state for the retention period, unless the
      submit passes ``reuse="if_failed"`` or ``"always"``.

    ``key`` is a format template over the payload (``"user:{user_id}"``) or a callable;
    ``scope`` defaults to the stage name.
    """

    mode: Mode = "simple"
    key: str | Callable[[Any], str] | None = None
    fields: tuple[str, ...] | None = None
    ttl: float | None = None
    window: float | None = None
    max_wait: float | None = None
    scope: str | None = None

    def __post_init__(self) -> None:
        if self.mode == "throttle" and not self.ttl:
            raise ConfigurationError("throttle dedup needs ttl")
        if self.mode == "debounce" and not self.window:
            raise ConfigurationError("debounce dedup needs window")
        if self.mode == "id" and not self.fields:
            raise ConfigurationError("deterministic ids need fields")
        if self.key is None and not self.fields:
            raise ConfigurationError("dedup needs a key template or id fields")
        if self.scope is not None and ":" in self.scope:
            # A dedup id is "scope:key"; the first colon must split it back unambiguously.
            raise ConfigurationError(f"dedup scope {self.scope!r} must not contain ':'")

    def resolve(self, stage: str, payload: BaseModel) -> tuple[str, str]:
        """(scope, key) for ``payload``."""
        scope = self.scope or stage
        if self.fields:
            return scope, self._digest(stage, payload.model_dump(mode="python"))
        if callable(self.key):
            return scope, str(self.key(payload))[:200]
        assert self.key is not None
        return scope, self.key.format(**payload.model_dump(mode="json"))[:200]

    def resolve_data(self, stage: str, data: Mapping[str, Any]) -> tuple[str, str]:
        """(scope, key) for a payload given as a mapping, without its model (a client).

        Agrees with :meth:`resolve` for a model ``m`` when ``data`` holds m's field values
        as ``m.model_dump(mode="python")`` has them, or their JSON form where that is the
        same text (str, int, float, bool, None, UUID, date, UTC datetimes): ``fields``
        are hashed as canonical JSON, a key template is filled from the values' JSON form.
        Turning a client's JSON into those values (defaults, ``5`` for a float field, a
        datetime string) is the caller's part (see :mod:`conveyor.client.registry`). A callable
        key needs the model: :class:`ConfigurationError`.
        """
        scope = self.scope or stage
        if self.fields:
            return scope, self._digest(stage, data)
        if callable(self.key):
            raise ConfigurationError(
                f"the dedup key of {stage} is computed by a function: it needs the stage's payload model"
            )
        assert self.key is not None
        return scope, self.key.format(**to_jsonable_python(dict(data)))[:200]

    def _digest(self, stage: str, data: Mapping[str, Any]) -> str:
        assert self.fields
        picked = {f: data.get(f) for f in self.fields}
        return hashlib.sha256(f"{stage}\n{canonical_json(picked)}".encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTC ISO-8601 datetimes, normalised decimals."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_canonical, ensure_ascii=False)


def _canonical(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        text = format(value.normalize(), "f")
        return text.rstrip("0").rstrip(".") if "." in text else text
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="python")
    raise TypeError(f"cannot canonicalise {type(value).__name__}")


@dataclass(frozen=True)
class DedupPlan:
    """One submit's dedup decision inputs: the declared policy resolved for a payload."""

    dedup: Dedup
    scope: str
    key: str
    reuse: Reuse = "never"
    retention: float = 7 * 86400.0

    @property
    def dedup_id(self) -> str:
        """``scope:key``, as stored on the job and reported in events."""
        return f"{self.scope}:{self.key}"

    @property
    def ttl(self) -> float | None:
        """How long the key is held after a submit (None: until the holder is terminal)."""
        return {
            "simple": None,
            "throttle": self.dedup.ttl,
            "debounce": self.dedup.window,
            "id": self.retention,
        }[self.dedup.mode]

    @property
    def fast_path(self) -> bool:
        """Whether a cache hit may answer (debounce must update Postgres; reuse must check it)."""
        return self.dedup.mode != "debounce" and self.reuse == "never"

    def expires_ms(self, now: float) -> int | None:
        """Absolute expiry on the dedup clock, for the cache entry."""
        return int((now + self.ttl) * 1000) if self.ttl else None

    def stored(self) -> dict[str, Any]:
        """What the job keeps of this plan (its options' ``PLAN_OPTION``): a DLQ retry
        takes the dedup id again as this submit would, with the same ``reuse``."""
        return {"mode": self.dedup.mode, "ttl": self.ttl, "reuse": self.reuse}
