"""Stage declarations: the typed payload and the policy, and how a Celery call maps onto them.

The Celery task class that runs a stage is :class:`conveyor.worker.task.StageTask`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import celery
from pydantic import BaseModel, ValidationError, create_model
from pydantic_core import to_jsonable_python

from conveyor.dedup import Dedup
from conveyor.errors import ConfigurationError, PayloadInvalid, PayloadTooLarge
from conveyor.retry import Backoff, RetryPolicy
from conveyor.wire import from_wire, to_wire, wire_text

if TYPE_CHECKING:
    from conveyor.calendar import Window

# ``fn(ctx, payload)``: ``ctx`` is the attempt's :class:`conveyor.worker.context.JobContext`.
StageFn = Callable[[Any, Any], Any]

# Set by the runner on a stage delivery's Celery request: (the message's task id, the job's
# task id). A retry or a republish carries a job in a message of another id; what the job
# sends from its delivery names the job's id, as Celery names the task's.
JOB_IDS_ATTR = "conveyor_job_ids"


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
    # "channel:{channel}": the cap holds per key (filled from the payload); a key's limit is
    # CONVEYOR_STAGES' ``concurrency_keys``, else ``concurrency_limit(key)``, else ``concurrency``.
    concurrency_key: str | None = None
    concurrency_limit: Callable[[str], int | None] | None = None
    concurrency_keys: tuple[tuple[str, int], ...] = ()
    # ``blackout(payload) -> windows``: a job due inside one waits, parked, for its end.
    blackout: Callable[[Any], Iterable[Window]] | None = None
    # Seconds a job may spend parked by ``Deferred`` in all; past it a deferral counts.
    max_deferred: float = 600.0
    # Called in the dead-letter transaction (connection, payload, error); its return value
    # goes on down the flow instead of the error, so a chord never waits on a dead member.
    on_dead: Callable[[Any, Any, BaseException], Any] | None = None
    # Called in the DLQ-retry transaction (connection, payload): undo what on_dead recorded.
    on_retry: Callable[[Any, Any], None] | None = None
    # Called when an attempt whose worker was lost is taken over (connection, payload,
    # attempts so far), in its own transaction.
    on_stalled: Callable[[Any, Any, int], None] | None = None
    # Declared on a plain signature (``def add(x, y)``): every positional argument, a
    # dict or a list included, takes the next parameter, as in Celery.
    positional: bool = False
    # The fields a plain signature's ``*args`` and ``**kwargs`` became (a list and a dict):
    # the positional arguments past the named ones, the keywords no parameter names.
    var_positional: str | None = None
    var_keyword: str | None = None
    keyword_only: frozenset[str] = frozenset()  # the parameters after ``*`` or ``*args``
    bound: bool = False  # declared with ``bind=True``: the body's first argument is its task
    # "strict": a submit naming an existing job (its job id or idempotency key) must be of
    # this stage with the same payload, ``idempotency_ignore`` fields left out, or it raises
    # IdempotencyConflict; "key" (default): the existing job is returned, whatever it holds.
    idempotency: Literal["key", "strict"] = "key"
    idempotency_ignore: frozenset[str] = frozenset()
    # Called in the transaction that expires a job (connection, stored payload): the sweep's
    # and the claim's, so a family's own row never stays behind its expired job.
    on_expired: Callable[[Any, Any], None] | None = None
    # The message's ``kwargsrepr`` (what Flower shows of its arguments) from the payload:
    # a stage whose payload holds personal data masks it here.
    kwargsrepr: Callable[[Mapping[str, Any]], str] | None = None

    def concurrency_of(self, payload: Mapping[str, Any]) -> tuple[str, int] | None:
        """The concurrency key a job of this payload counts against (``""``: the stage's
        one cap) and its limit; None when it is not capped."""
        if self.concurrency_key is None:
            return None if self.concurrency is None else ("", self.concurrency)
        key = format_key(self.concurrency_key, payload)
        limit = dict(self.concurrency_keys).get(key)
        if limit is None and self.concurrency_limit is not None:
            limit = self.concurrency_limit(key)
        if limit is None:
            limit = self.concurrency
        return None if limit is None else (key, max(1, int(limit)))

    @property
    def capped(self) -> bool:
        """Whether a job of this stage may have to wait for a concurrency slot."""
        return self.concurrency is not None or self.concurrency_key is not None

    @property
    def positional_fields(self) -> list[str]:
        """The fields a positional argument may take, in order (not ``*args``'s, ``**kwargs``'s
        or a keyword-only parameter's)."""
        return [
            f
            for f in self.payload.model_fields
            if f not in (self.var_positional, self.var_keyword) and f not in self.keyword_only
        ]

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
    """The payload as stored (kombu's JSON), refused when that JSON is over ``limit`` bytes."""
    return checked_size(stage, model, limit)


def checked_size(stage: str, data: Any, limit: int) -> dict[str, Any]:
    """``data`` as stored (JSON-ready, kombu's tags for bytes, datetimes, Decimal, UUID),
    refused with :class:`PayloadTooLarge` when that JSON is over ``limit`` bytes."""
    text = wire_text(data)
    size = len(text.encode())
    if size > limit:
        raise PayloadTooLarge(
            f"payload for {stage} is {size} bytes of JSON, over the limit of {limit} bytes "
            "(max_payload_bytes): pass ids or references to stored data, not the data itself"
        )
    return dict(json.loads(text))


def kept_if_small(data: Any, exc: PayloadInvalid) -> dict[str, Any]:
    """What to store of a payload that failed validation: the payload itself, so a DLQ
    retry after the stage's schema is fixed can run it, unless it was refused for its size
    (or is not a mapping), then nothing."""
    if isinstance(exc, PayloadTooLarge) or not isinstance(data, Mapping):
        return {}
    try:
        return dict(to_wire(dict(data)))
    except (TypeError, ValueError):
        return {}


def readable_validation_error(stage: str, exc: ValidationError) -> str:
    """One line per problem, naming the field, without echoing the submitted values."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    return f"invalid payload for {stage}: " + "; ".join(parts)


def payload_from_call(spec: StageSpec, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Map a Celery call onto ``spec``'s payload: positional arguments take the payload's
    fields in their declared order, then the keyword arguments apply.

    A chain passes the previous link's result as the first positional argument. In a stage
    declared with ``payload=`` (``fn(ctx, payload)``), a dict positional argument is still
    merged as fields under the keywords and a list (a chord header's results) arrives as
    ``results``, and ``None`` is skipped; in a stage declared on a plain signature
    (``spec.positional``) every positional argument takes the next parameter, as in Celery,
    and the ones past them go to its ``*args``. A keyword no field names is refused, as
    Celery refuses it (``TypeError``), unless the signature has ``**kwargs`` (or it is a
    ``payload=`` stage's ``results``, the name a chord's results take there).
    """
    named = spec.positional_fields
    data: dict[str, Any] = {}
    values: list[Any] = []
    for arg in args:
        if not spec.positional:
            if isinstance(arg, Mapping):
                data.update(arg)
                continue
            if isinstance(arg, list):
                data["results"] = arg
                continue
            if arg is None:
                continue
        values.append(arg)
    if len(values) > len(named) and spec.var_positional is None:
        raise PayloadInvalid(
            f"{spec.name} takes {len(named)} positional argument{'' if len(named) == 1 else 's'} "
            f"but {len(values)} were given (fields in order: {', '.join(named) or 'none'})"
        )
    placed = dict(zip(named, values, strict=False))
    data.update(placed)
    if spec.var_positional is not None:
        data[spec.var_positional] = values[len(named) :]
    extra: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in placed:
            raise PayloadInvalid(f"{spec.name} got multiple values for {key!r}: positionally and by keyword")
        if key not in spec.payload.model_fields or key in (spec.var_positional, spec.var_keyword):
            if key == "results" and not spec.positional:
                data[key] = value  # a chord body's results, given as the positional path gives them
                continue
            extra[key] = value
            continue
        data[key] = value
    if extra and spec.var_keyword is None:
        raise PayloadInvalid(
            f"{spec.name} got unexpected keyword argument{'' if len(extra) == 1 else 's'} "
            f"{', '.join(map(repr, extra))} (its fields: {', '.join([*named, *sorted(spec.keyword_only)])})"
        )
    if spec.var_keyword is not None:
        data[spec.var_keyword] = extra
    return data


class PlainSignature(typing.NamedTuple):
    """What :func:`plain_stage` derives from an ordinary function."""

    model: type[BaseModel]
    body: StageFn
    var_positional: str | None
    var_keyword: str | None
    keyword_only: frozenset[str]


def plain_stage(name: str, fn: Callable[..., Any], *, bind: bool = False) -> PlainSignature:
    """The payload model of a stage declared on a plain signature (``def add(x, y)``), one
    field per parameter with its annotation (``Any`` if none) and default, ``*args`` a list
    field and ``**kwargs`` a dict field (``args``/``kwargs`` when the parameter's name starts
    with ``_``), and the body that calls ``fn`` with the validated fields as it was declared;
    with ``bind`` (Celery's ``bind=True``) the first parameter is no field: it gets the task."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: validate nothing rather than refuse
        hints = {}
    fields: dict[str, Any] = {}
    var_positional: str | None = None
    var_keyword: str | None = None
    before_star: list[str] = []
    params = list(inspect.signature(fn).parameters.values())
    if bind:
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise ConfigurationError(f"stage {name}: bind=True needs a first parameter for the task (self)")
        params = params[1:]
    for param in params:
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"stage {name}: parameter {param.name!r} must not be positional-only: "
                "a payload has named fields"
            )
        if param.kind is param.VAR_POSITIONAL:
            var_positional = _var_field(name, param.name, "args", fields)
            fields[var_positional] = (list[Any], dataclasses.field(default_factory=list))
            continue
        if param.kind is param.VAR_KEYWORD:
            var_keyword = _var_field(name, param.name, "kwargs", fields)
            fields[var_keyword] = (dict[str, Any], dataclasses.field(default_factory=dict))
            continue
        field_name = param.name
        if param.name.startswith("_"):
            if param.kind is not param.POSITIONAL_OR_KEYWORD:
                raise ConfigurationError(f"stage {name}: parameter {param.name!r} may not start with '_'")
            # An ignored argument (``def f(self, _, key)``) is still given by position:
            # its field is named by its place, as a payload's fields cannot start with '_'.
            field_name = f"arg{len(before_star)}"
            if field_name in {p.name for p in params}:
                raise ConfigurationError(
                    f"stage {name}: parameter {param.name!r} would be field {field_name!r}, "
                    "already a parameter"
                )
        if param.kind is param.POSITIONAL_OR_KEYWORD:
            before_star.append(field_name)
        default = ... if param.default is param.empty else param.default
        fields[field_name] = (hints.get(param.name, Any), default)
    model_name = "".join(part.title() for part in name.split(".")[-1].split("_")) + "Payload"
    model: type[BaseModel] = create_model(model_name, **fields)
    keywords = [n for n in fields if n not in before_star and n not in (var_positional, var_keyword)]

    def body(_ctx: Any, payload: BaseModel) -> Any:
        args = [getattr(payload, n) for n in before_star]
        if var_positional is not None:
            args.extend(getattr(payload, var_positional))
        kwargs = {n: getattr(payload, n) for n in keywords}
        if var_keyword is not None:
            kwargs.update(getattr(payload, var_keyword))
        if bind:
            return fn(celery.current_task, *args, **kwargs)
        return fn(*args, **kwargs)

    return PlainSignature(model, body, var_positional, var_keyword, frozenset(keywords))


def _var_field(stage: str, param: str, fallback: str, taken: Mapping[str, Any]) -> str:
    field = fallback if param.startswith("_") else param
    if field in taken:
        raise ConfigurationError(
            f"stage {stage}: parameter {param!r} would be field {field!r}, already a parameter"
        )
    return field


def to_jsonable(value: Any) -> Any:
    """A stage's return value as stored: JSON-ready data in kombu's encoding (models and
    dataclasses as their fields); :func:`from_wire` gives back what the body returned."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    return to_wire(value)


def format_key(template: str, payload: Mapping[str, Any]) -> str:
    """A stage's lease key (``"user:{user_id}"``) filled from the payload, a stored one
    (kombu's tags) or a model's JSON dump alike: each value in its JSON form."""
    return template.format(**to_jsonable_python(from_wire(dict(payload))))[:200]


def lineage(app: Any, options: Mapping[str, Any], job_id: str) -> tuple[str | None, str]:
    """The ``(parent_id, root_id)`` of a task sent with ``options``, by Celery's rule: ids
    not given are the sending worker task's (its id the parent, its root the root); a task
    sent from no task is its own root. A stage's delivery names its job's task id, not its
    message's (:data:`JOB_IDS_ATTR`)."""
    parent_id = options.get("parent_id") or None
    root_id = options.get("root_id") or None
    current = app.current_worker_task
    if current is not None:
        req = current.request
        message_id, own = getattr(req, JOB_IDS_ATTR, None) or (req.id, req.id)
        parent_id = parent_id or req.id
        root_id = root_id or req.root_id or own
        parent_id = own if parent_id == message_id else parent_id
        root_id = own if root_id == message_id else root_id
    return parent_id, root_id or job_id


def check_call_limits(spec: StageSpec, options: Mapping[str, Any]) -> None:
    """A call's own time limits (``.set(soft_time_limit=1)``) may only shorten the stage's:
    its hard limit is what keeps an attempt inside the redelivery bound."""
    hard = options.get("time_limit")
    soft = options.get("soft_time_limit")
    if hard is not None and spec.time_limit is not None and float(hard) > spec.time_limit:
        raise ConfigurationError(
            f"stage {spec.name}: time_limit={hard} is above the stage's own {spec.time_limit}s; "
            "a call may only shorten it (declare the stage's limit instead)"
        )
    if soft is not None and float(soft) >= float(hard or spec.time_limit or float("inf")):
        raise ConfigurationError(f"stage {spec.name}: soft_time_limit={soft} must be below the hard limit")


# Options a stamp may not be named after: the ones a job's options keep for themselves.
RESERVED = frozenset(
    {"chain", "chord", "group_id", "group_index", "parent_id", "root_id", "priority", "time_limit",
     "soft_time_limit", "link", "link_error", "eta", "stamped_headers", "task_id", "queue", "headers",
     "declare", "exchange", "routing_key", "mandatory"}
)  # fmt: skip


def signature_options(options: Mapping[str, Any], *, link: Any, link_error: Any) -> dict[str, Any]:
    """The subset of apply_async options needed to publish the same message again."""
    keep = (
        "chain",
        "chord",
        "group_id",
        "group_index",
        "parent_id",
        "root_id",
        "priority",
        "time_limit",
        "soft_time_limit",
    )
    out = {k: _plain(options[k]) for k in keep if options.get(k) is not None}
    # Celery's stamps (canvas stamping): the headers' names, and each stamp under its name.
    stamped = [str(k) for k in options.get("stamped_headers") or () if k in options and k not in RESERVED]
    if stamped:
        out["stamped_headers"] = stamped
        out.update({k: _plain(options[k]) for k in stamped})
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
