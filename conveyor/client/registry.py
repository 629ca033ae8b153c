"""The stage registry: what a client needs to submit a stage by name without its code.

One ``stages`` row per stage holds its queue, priority, attempts, dedup policy (as data),
lease key template, preemptability and the payload model's JSON Schema. The worker side
writes the rows (:func:`refresh` at a worker's start, :func:`write` after ``conveyor db
upgrade``); a client reads them (:func:`load`, :func:`lookup`), checks a payload against
the schema (:meth:`RegisteredStage.validate`) and resolves the dedup key
(:meth:`RegisteredStage.resolve_dedup`).

The client's check is a courtesy, the worker's is the authority. JSON Schema carries the
payload's shape (types, required fields, bounds, enums, extra fields when forbidden) but
no code: a model validator comparing two fields, a field validator, a custom type pass the
client and are refused by the worker's pydantic model (the job is dead-lettered with
``PayloadInvalid``). JSON Schema also has no lax mode, so the client refuses a few inputs
pydantic would coerce (``"5"`` for an integer, ``1`` for a boolean).

A dedup key must come out the same on both sides, or duplicates stop collapsing. The
client fills in defaults and turns JSON back into the values the model would hold (``5``
→ ``5.0`` for a float, datetime and UUID strings); :func:`describe` registers a policy as
data only when that is exact: a key read from plain fields (str, int, float, bool,
datetime, date, time, UUID, str/int enums, literals, optional or not) that no validator,
serializer, alias, string transform or default factory touches. Otherwise (a callable key,
a Decimal, a nested model) the row has no policy and ``dedup_by_code`` says why, and the
client refuses the submit: only the deployment's platform can compute that key.

This module is client-side: it imports nothing of the worker (stage, runner, platform).
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import functools
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jsonschema
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python
from sqlalchemy import Connection, Engine, select

from conveyor.client.idempotency import Strict
from conveyor.client.portable_dedup import model_value, policy_as_data, template_names
from conveyor.dedup import Dedup
from conveyor.errors import ConfigurationError, PayloadInvalid, UnknownStage
from conveyor.errors import describe as describe_error
from conveyor.schema_errors import or_list, readable_schema_errors
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.db.engine import reading
from conveyor.store.db.namespace import table_exists
from conveyor.store.db.schema import stages

log = logging.getLogger("conveyor.registry")

FEW_STAGES = 10  # an unknown name lists every stage when there are at most this many


class StageLike(Protocol):
    """What :func:`describe` reads of a stage (``conveyor.stage.StageSpec`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def dedup(self) -> Dedup | None: ...
    @property
    def lease_key(self) -> str | None: ...
    @property
    def preemptable(self) -> bool: ...
    @property
    def on_retry(self) -> Callable[[Any, Any], None] | None: ...
    @property
    def payload(self) -> type[BaseModel]: ...
    @property
    def idempotency(self) -> str: ...
    @property
    def idempotency_ignore(self) -> frozenset[str]: ...
    @property
    def kwargsrepr(self) -> Callable[[Mapping[str, Any]], str] | None: ...


# -- the worker side: rows from stage specs ------------------------------------------------


def describe(spec: StageLike) -> dict[str, Any]:
    """The ``stages`` row of one stage (without ``updated_at``), JSON-ready.

    Raises :class:`ConfigurationError` when the payload model has no JSON Schema (a field
    of an arbitrary Python type).
    """
    try:
        schema = json.loads(json.dumps(spec.payload.model_json_schema()))
    except Exception as exc:
        raise ConfigurationError(f"stage {spec.name}: its payload model has no JSON Schema: {exc}") from exc
    policy, by_code = policy_as_data(spec.dedup, spec.payload)
    return {
        "name": spec.name,
        "queue": spec.queue,
        "priority": int(spec.priority),
        "max_attempts": int(spec.max_attempts),
        "dedup": policy,
        "dedup_by_code": by_code,
        "lease_key": spec.lease_key,
        "preemptable": bool(spec.preemptable),
        "on_retry": spec.on_retry is not None,
        "payload_schema": schema,
        "submit_rules": submit_rules(spec),
    }


def submit_rules(spec: StageLike) -> dict[str, Any] | None:
    """What a client without ``spec``'s code applies at submit beyond the schema: its strict
    idempotency rule, and whether the messages' ``kwargsrepr`` hides the payload (the stage
    masks it in code the client does not have)."""
    rules: dict[str, Any] = {}
    if spec.idempotency == "strict":
        rules["idempotency"] = {"mode": "strict", "ignore": sorted(spec.idempotency_ignore)}
    if spec.kwargsrepr is not None:
        rules["masked_repr"] = True
    return rules or None


def write(bind: Engine | Connection, specs: Iterable[StageLike]) -> list[str]:
    """Upsert the rows of ``specs`` in one transaction; returns the names written, sorted.

    A row is rewritten only when its content changed, so ``updated_at`` says when a stage's
    definition last changed and a worker's start usually writes nothing. Rows of stages not
    among ``specs`` are left alone: workers of another version of the deployment may still
    run them (a rolling deploy), and a client may still submit them. Nothing deletes rows;
    a stage removed for good stays listed until someone deletes its row.

    With an :class:`Engine` the transaction commits here; a :class:`Connection` already in
    a transaction writes inside it (the caller commits), else in its own.
    """
    rows = _rows(specs, strict=True)
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return _upsert(conn, rows)
    if bind.in_transaction():
        return _upsert(bind, rows)
    with bind.begin():
        return _upsert(bind, rows)


def refresh(engine: Engine, specs: Iterable[StageLike]) -> list[str]:
    """:func:`write`, for a worker's start: never raises. A missing ``stages`` table (a
    database not yet upgraded), a database error or a stage whose row cannot be made is
    logged as a warning and the rest carries on. Returns the names written."""
    try:
        rows = _rows(specs, strict=False)
        with engine.connect() as conn:
            if not table_exists(conn, stages):
                log.warning(
                    "stage registry not refreshed: table %r does not exist yet (run `conveyor db "
                    "upgrade`); clients cannot submit by stage name until it does",
                    stages.name,
                )
                return []
        with engine.begin() as conn:
            written = _upsert(conn, rows)
    except Exception as exc:
        log.warning("stage registry not refreshed: %s", describe_error(exc), exc_info=True)
        return []
    if written:
        log.info("stage registry: wrote %d stage(s): %s", len(written), ", ".join(written))
    return written


def _rows(specs: Iterable[StageLike], *, strict: bool) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for spec in specs:
        try:
            rows[spec.name] = describe(spec)
        except ConfigurationError as exc:
            if strict:
                raise
            log.warning("stage registry: %s left out: %s", spec.name, exc)
    return [rows[name] for name in sorted(rows)]  # one lock order for concurrent writers


def _upsert(conn: Connection, rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    names = [r["name"] for r in rows]
    found = conn.execute(select(stages).where(stages.c.name.in_(names))).mappings()
    current = {r["name"]: _content(r) for r in found}
    changed = [r for r in rows if current.get(r["name"]) != _content(r)]
    for row in changed:
        stmt = upsert(conn, stages).values(**row, updated_at=db_now())
        update = {k: stmt.excluded[k] for k in row if k != "name"}
        update["updated_at"] = db_now()
        conn.execute(stmt.on_conflict_do_update(index_elements=[stages.c.name], set_=update))
    return [r["name"] for r in changed]


def _content(row: Mapping[Any, Any]) -> dict[str, Any]:
    return {k: row[k] for k in row if k != "updated_at"}


# -- the client side: registered stages ---------------------------------------------------


@dataclass(frozen=True)
class RegisteredStage:
    """One ``stages`` row, as a client sees a stage."""

    name: str
    queue: str
    priority: int
    max_attempts: int
    payload_schema: Mapping[str, Any]
    dedup: Mapping[str, Any] | None = None
    dedup_by_code: str | None = None  # why only the deployment's code can compute the key
    lease_key: str | None = None
    preemptable: bool = False
    # Whether the stage has an ``on_retry`` hook (deployment code a DLQ retry runs); None:
    # the row predates the registry saying so, which a client takes as "may have one".
    on_retry: bool | None = None
    updated_at: dt.datetime | None = None
    # What the client applies at submit beyond the schema (:func:`submit_rules`).
    submit_rules: Mapping[str, Any] | None = None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> RegisteredStage:
        """From a ``stages`` row (or a :func:`describe` result)."""
        return cls(
            name=row["name"],
            queue=row["queue"],
            priority=int(row["priority"]),
            max_attempts=int(row["max_attempts"]),
            payload_schema=row["payload_schema"],
            dedup=row.get("dedup"),
            dedup_by_code=row.get("dedup_by_code"),
            lease_key=row.get("lease_key"),
            preemptable=bool(row.get("preemptable")),
            on_retry=row.get("on_retry"),
            updated_at=row.get("updated_at"),
            submit_rules=row.get("submit_rules"),
        )

    @functools.cached_property
    def _strict(self) -> Strict | None:
        rule = (self.submit_rules or {}).get("idempotency") or {}
        if rule.get("mode") != "strict":
            return None
        return Strict.of(self.name, rule.get("ignore") or (), self.payload_schema)

    def strict_rule(self) -> Strict | None:
        """The stage's strict idempotency rule (:mod:`conveyor.client.idempotency`), or
        None; built once per registered stage."""
        return self._strict

    @property
    def masked_repr(self) -> bool:
        """Whether the stage masks what Flower shows of its payload (its ``kwargsrepr``)."""
        return bool((self.submit_rules or {}).get("masked_repr"))

    @functools.cached_property
    def _validator(self) -> Any:
        """Built once per stage (the dataclass is frozen; this caches in ``__dict__``)."""
        schema = dict(self.payload_schema)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ConfigurationError(
                f"stage {self.name}: its registered payload schema is not a valid JSON Schema: {exc.message}"
            ) from None
        return cls(schema)

    @functools.cached_property
    def _properties(self) -> Mapping[str, Any]:
        props = self.payload_schema.get("properties")
        return props if isinstance(props, Mapping) else {}

    def validate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The payload checked against the registered JSON Schema: a new JSON-ready dict
        (dates, UUIDs, enums, models turned into JSON) with the schema's top-level defaults
        filled in. Raises :class:`PayloadInvalid` naming each wrong field and what is wrong
        (up to five), never echoing the values.

        Passing here does not mean the worker accepts the payload: rules that live in the
        stage's code (a model validator comparing fields, a field validator) are checked
        only by the worker, which dead-letters the job with ``PayloadInvalid``.
        """
        if not isinstance(payload, Mapping):
            raise PayloadInvalid(
                f"invalid payload for {self.name}: payload: Input should be an object",
                problems=("payload: Input should be an object",),
            )
        try:
            data = to_jsonable_python(dict(payload))
        except PydanticSerializationError as exc:
            raise PayloadInvalid(f"invalid payload for {self.name}: payload: not JSON data ({exc})") from None
        problems = readable_schema_errors(itertools.islice(self._validator.iter_errors(data), 50))
        if problems:
            message = f"invalid payload for {self.name}: " + "; ".join(problems)
            raise PayloadInvalid(message, problems=problems)
        for key, prop in self._properties.items():
            if key not in data and isinstance(prop, Mapping) and "default" in prop:
                data[key] = copy.deepcopy(prop["default"])
        return dict(data)

    def dedup_policy(self) -> Dedup | None:
        """The stage's dedup policy rebuilt from its row (None: the stage does not dedup).

        Raises :class:`ConfigurationError` for a stage whose key only the deployment's code
        can compute (``dedup_by_code``): a client must not submit it without deduplication.
        """
        if self.dedup_by_code:
            raise ConfigurationError(
                f"stage {self.name}: {self.dedup_by_code}, so its dedup key is computed by the "
                "deployment's code: submit it through the deployment's platform (platform.submit)"
            )
        if not self.dedup:
            return None
        d = self.dedup
        return Dedup(
            mode=d["mode"],
            key=d.get("key"),
            fields=tuple(d["fields"]) if d.get("fields") else None,
            ttl=d.get("ttl"),
            window=d.get("window"),
            max_wait=d.get("max_wait"),
            scope=d.get("scope"),
        )

    def resolve_dedup(self, payload: Mapping[str, Any]) -> tuple[str, str] | None:
        """(scope, key) of ``payload`` (best :meth:`validate`'s result) under the stage's
        policy, as the worker side resolves it from the model; None without a policy."""
        policy = self.dedup_policy()
        if policy is None:
            return None
        names = list(policy.fields) if policy.fields else template_names(str(policy.key))
        data = dict(payload)
        try:
            for name in names:
                prop = self._properties.get(name, {})
                if name not in data and isinstance(prop, Mapping) and "default" in prop:
                    data[name] = copy.deepcopy(prop["default"])
                if name in data:
                    data[name] = model_value(data[name], prop)
            return policy.resolve_data(self.name, data)
        except ValidationError as exc:
            problems = [f"{name}: {e['msg']}" for e in exc.errors(include_input=False, include_url=False)]
            raise PayloadInvalid(
                f"invalid payload for {self.name}: " + "; ".join(problems), problems=problems
            ) from None
        except KeyError as exc:
            problem = f"{exc.args[0]}: Field required (the dedup key reads it)"
            raise PayloadInvalid(f"invalid payload for {self.name}: {problem}", problems=(problem,)) from None


def load(bind: Engine | Connection) -> dict[str, RegisteredStage]:
    """Every registered stage by name. Raises :class:`ConfigurationError` when the
    ``stages`` table does not exist (the database predates the registry)."""
    if isinstance(bind, Engine):
        with reading(bind) as conn:
            return load(conn)
    if not table_exists(bind, stages):
        raise ConfigurationError(
            f"the stage registry (table {stages.name!r}) does not exist: run `conveyor db upgrade` "
            "with a Conveyor that has it, and start the deployment's workers"
        )
    rows = bind.execute(select(stages).order_by(stages.c.name)).mappings()
    return {row["name"]: RegisteredStage.from_row(row) for row in rows}


def lookup(registry: Mapping[str, RegisteredStage], name: str) -> RegisteredStage:
    """The registered stage ``name``; :class:`UnknownStage` naming close names if none."""
    found = registry.get(name)
    if found is not None:
        return found
    close = tuple(close_names(name, registry))
    if close:
        message = f"unknown stage {name!r}: did you mean {or_list([repr(c) for c in close])}?"
    elif not registry:
        message = (
            f"unknown stage {name!r}: no stages are registered (run `conveyor db upgrade` or start "
            "a worker of the deployment)"
        )
    elif len(registry) <= FEW_STAGES:
        message = f"unknown stage {name!r}; known stages: {', '.join(sorted(registry))}"
    else:
        message = (
            f"unknown stage {name!r}: no registered stage has a close name ({len(registry)} are "
            "registered; list them with `conveyor stages`)"
        )
    raise UnknownStage(message, name=name, suggestions=close)


def close_names(name: str, names: Iterable[str], n: int = 3, cutoff: float = 0.75) -> list[str]:
    """Registered names close to ``name``, closest first. Dotted segments both names start
    with are ignored (every name starts ``conveyor.``), and a name that ends with ``name``
    (``demo.square`` for ``conveyor.demo.square``) is as close as can be."""
    scored = []
    for candidate in names:
        if candidate.endswith("." + name):
            score = 1.0
        else:
            a, b = name.split("."), candidate.split(".")
            pairs = enumerate(zip(a, b, strict=False))
            same = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
            score = difflib.SequenceMatcher(None, ".".join(a[same:]), ".".join(b[same:])).ratio()
        if score >= cutoff:
            scored.append((-score, candidate))
    return [c for _, c in sorted(scored)[:n]]
