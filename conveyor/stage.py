"""Stage declarations: the typed payload and the policy, and how a Celery call maps onto them.

The Celery task class that runs a stage is :class:`conveyor.worker.task.StageTask`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from conveyor.dedup import Dedup
from conveyor.errors import PayloadInvalid, PayloadTooLarge
from conveyor.retry import Backoff, RetryPolicy

# ``fn(ctx, payload)``: ``ctx`` is the attempt's :class:`conveyor.worker.context.JobContext`.
StageFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class StageSpec:
    """Everything the platform knows about one stage, declared once in its decorator."""

    name: str
    fn: StageFn
    payload: type[BaseModel]
    queue: str
    max_attempts: int
    retry: RetryPolicy = dataclasses.field(default_factory=Backoff)
    time_limit: float | None = None
    soft_time_limit: float | None = None
    priority: int = 0
    label: Callable[[Any], str] | None = None
    retry_on_timeout: bool = False
    dedup: Dedup | None = None
    lease_key: str | None = None
    preemptable: bool = False
    grace: float | None = None
    concurrency: int | None = None  # running at once across all workers (None: no cap)
    # Called in the dead-letter transaction (connection, payload, error); its return value
    # goes on down the flow instead of the error, so a chord never waits on a dead member.
    on_dead: Callable[[Any, Any, BaseException], Any] | None = None
    # Called in the DLQ-retry transaction (connection, payload): undo what on_dead recorded.
    on_retry: Callable[[Any, Any], None] | None = None
    # Called when an attempt whose worker was lost is taken over (connection, payload,
    # attempts so far), in its own transaction.
    on_stalled: Callable[[Any, Any, int], None] | None = None

    def validate(self, data: Mapping[str, Any]) -> BaseModel:
        """Validate a payload mapping, turning errors into :class:`PayloadInvalid`."""
        try:
            return self.payload.model_validate(dict(data))
        except ValidationError as exc:
            raise PayloadInvalid(readable_validation_error(self.name, exc)) from None

    def label_for(self, payload: BaseModel) -> str:
        """A short human label for lists and the DLQ (never PII by convention)."""
        if self.label is None:
            return self.name.rsplit(".", 1)[-1]
        try:
            return str(self.label(payload))[:200]
        except Exception:  # a label must never break a submit
            return self.name


def checked_payload(stage: str, model: BaseModel, limit: int) -> dict[str, Any]:
    """The payload as stored (JSON-ready), refused when its JSON is over ``limit`` bytes."""
    return checked_size(stage, model.model_dump(mode="json"), limit)


def checked_size(stage: str, data: dict[str, Any], limit: int) -> dict[str, Any]:
    """``data`` (JSON-ready), refused with :class:`PayloadTooLarge` when its JSON is over
    ``limit`` bytes."""
    size = len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limit:
        raise PayloadTooLarge(
            f"payload for {stage} is {size} bytes of JSON, over the limit of {limit} bytes "
            "(max_payload_bytes): pass ids or references to stored data, not the data itself"
        )
    return data


def kept_if_small(data: Any, exc: PayloadInvalid) -> dict[str, Any]:
    """What to store of a payload that failed validation: the payload itself, so a DLQ
    retry after the stage's schema is fixed can run it, unless it was refused for its size
    (or is not a mapping), then nothing."""
    if isinstance(exc, PayloadTooLarge) or not isinstance(data, Mapping):
        return {}
    try:
        return dict(json.loads(json.dumps(dict(data), default=str)))
    except (TypeError, ValueError):
        return {}


def readable_validation_error(stage: str, exc: ValidationError) -> str:
    """One line per problem, naming the field, without echoing the submitted values."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    return f"invalid payload for {stage}: " + "; ".join(parts)


def payload_from_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a Celery call into one payload mapping.

    Keyword arguments are the payload. A dict positional argument is the previous chain
    link's result and is merged under the keywords; a list is a chord header's results
    and arrives as ``results``.
    """
    data: dict[str, Any] = {}
    for arg in args:
        if isinstance(arg, Mapping):
            data.update(arg)
        elif isinstance(arg, list):
            data["results"] = arg
        elif arg is not None:
            raise PayloadInvalid(
                f"positional argument of type {type(arg).__name__} is not accepted: "
                "pass the payload as keyword arguments"
            )
    data.update(kwargs)
    return data


def to_jsonable(value: Any) -> Any:
    """A stage's return value as JSON-ready data."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def format_key(template: str, payload: Mapping[str, Any]) -> str:
    """A stage's lease key (``"user:{user_id}"``) filled from the payload."""
    return template.format(**payload)[:200]


def signature_options(options: Mapping[str, Any], *, link: Any, link_error: Any) -> dict[str, Any]:
    """The subset of apply_async options needed to publish the same message again."""
    keep = ("chain", "chord", "group_id", "group_index", "parent_id", "root_id")
    out = {k: _plain(options[k]) for k in keep if options.get(k) is not None}
    if link:
        out["link"] = _plain(link if isinstance(link, list) else [link])
    if link_error:
        out["link_error"] = _plain(link_error if isinstance(link_error, list) else [link_error])
    return out


def _plain(value: Any) -> Any:
    """Signatures are dicts; make nested ones plain JSON-able structures."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
