"""The stage registry without a database: rows of the deployment's real stages, the
client's JSON Schema check and its messages, close names, dedup policies as data."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import uuid
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.client.registry import RegisteredStage, close_names, describe, lookup
from conveyor.dedup import Dedup
from conveyor.errors import ConfigurationError, PayloadInvalid, UnknownStage
from conveyor.stage import StageSpec
from conveyor.store.db.schema import stages as stages_table


@pytest.fixture(scope="module")
def specs() -> dict[str, StageSpec]:
    from config.celery_app import platform

    platform.app.loader.import_default_modules()
    return dict(platform.stages)


@pytest.fixture(scope="module")
def registry(specs: dict[str, StageSpec]) -> dict[str, RegisteredStage]:
    return {name: RegisteredStage.from_row(describe(spec)) for name, spec in specs.items()}


def spec_of(
    model: type[BaseModel], dedup: Dedup | None = None, name: str = "conveyor.test.stage"
) -> StageSpec:
    return StageSpec(
        name=name, fn=lambda ctx, p: None, payload=model, queue="demo", max_attempts=1, dedup=dedup
    )


def registered(spec: StageSpec) -> RegisteredStage:
    """As a client sees it: the row through JSON, as the database returns it."""
    return RegisteredStage.from_row(json.loads(json.dumps(describe(spec))))


def problems(stage: RegisteredStage, payload: Any) -> str:
    with pytest.raises(PayloadInvalid) as info:
        stage.validate(payload)
    return str(info.value)


# -- rows of the real stages ------------------------------------------------------------


def test_every_stage_has_a_json_row_with_a_valid_schema(
    specs: dict[str, StageSpec], registry: dict[str, RegisteredStage]
) -> None:
    assert {"conveyor.demo.square", "conveyor.demo.keyed", "conveyor.demo.sync"} <= set(specs)
    columns = {c.name for c in stages_table.columns} - {"updated_at"}
    for name, spec in specs.items():
        row = describe(spec)
        assert set(row) == columns, name
        assert json.loads(json.dumps(row)) == row, name
        assert row["payload_schema"] == json.loads(json.dumps(spec.payload.model_json_schema()))
        registry[name].validate({} if name == "conveyor.files.reconcile" else _example(name))


def _example(name: str) -> dict[str, Any]:
    return {
        "conveyor.demo.keyed": {"user": "u1"},
        "conveyor.demo.sync": {"user": "u1", "note": "n"},
        "conveyor.demo.write": {"user": "u1", "note": "n"},
        "conveyor.demo.query": {"kind": "ok"},
        "conveyor.demo.fixable": {"key": "k1"},
        "conveyor.files.complete_batch": {"batch_id": "b1"},
        "conveyor.email.send": {
            "outboxId": "123e4567-e89b-12d3-a456-426614174000",
            "companyId": "789e4567-e89b-12d3-a456-426614174999",
            "requestId": "req-1",
            "to": "cliente@example.com",
            "subject": "Seu boleto",
            "htmlRef": "a" * 64,
            "recipient": {"externalId": "CUST-1", "email": "cliente@example.com"},
            "enqueuedAt": "2025-10-19T12:00:00Z",
        },
        "conveyor.publisher.publish": {"post_id": "p1", "brand": "b", "channel": "instagram", "account": "a"},
        "conveyor.publisher.first_comment": {"post_id": "c1", "media_id": "m1", "comment_hash": "0" * 64},
        "conveyor.trading.import_trades": {"userId": "u1", "sinceIso": "2025-01-01", "broker": "coinbase"},
        "conveyor.trading.score_bias": {"userId": "u1"},
        "conveyor.trading.simulate_simple": {"userId": "u1", "tradeId": "t1", "horizonDays": 7},
        "conveyor.trading.digest_weekly": {
            "userId": "u1",
            "periodStart": "2026-11-16",
            "periodEnd": "2026-11-23",
        },
        "conveyor.trading.digest_fanout": {"week": None},
    }.get(name, {"n": 1, "file_id": "f1"})


def test_rows_carry_the_declared_policy(
    specs: dict[str, StageSpec], registry: dict[str, RegisteredStage]
) -> None:
    for name, spec in specs.items():
        stage = registry[name]
        assert (stage.queue, stage.priority, stage.max_attempts) == (
            spec.queue,
            spec.priority,
            spec.max_attempts,
        )
        assert (stage.lease_key, stage.preemptable) == (spec.lease_key, spec.preemptable)
    assert (
        registry["conveyor.demo.sync"].lease_key == "user:{user}"
        and registry["conveyor.demo.sync"].preemptable
    )
    assert (registry["conveyor.demo.write"].queue, registry["conveyor.demo.write"].priority) == (
        "priority",
        10,
    )
    assert registry["conveyor.demo.square"].dedup_policy() is None
    assert registry["conveyor.demo.keyed"].dedup_policy() == specs["conveyor.demo.keyed"].dedup


# -- the client's check --------------------------------------------------------------------


def test_an_invalid_payload_names_the_field_without_echoing_it(registry: dict[str, RegisteredStage]) -> None:
    square = registry["conveyor.demo.square"]
    message = problems(square, {"n": "seven" * 2000})
    assert message == "invalid payload for conveyor.demo.square: n: Input should be an integer"
    assert problems(square, {}) == "invalid payload for conveyor.demo.square: n: Field required"
    assert problems(square, ["n"]).endswith("payload: Input should be an object")
    assert "not JSON data" in problems(square, {"n": object()})
    effect = registry["conveyor.demo.effect"]
    message = problems(effect, {"note": 5, "sleep": "slow", "crash_until_attempt": None})
    assert message == (
        "invalid payload for conveyor.demo.effect: note: Input should be a string or null; "
        "sleep: Input should be a number; crash_until_attempt: Input should be an integer"
    )


class Inner(BaseModel):
    a: int


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(ge=0)
    s: str = Field(default="ab", max_length=3, pattern="^[a-z]*$")
    kind: Literal["a", "b"] = "a"
    maybe: Literal["x", "y"] | None = None
    inner: Inner | None = None
    items: list[Inner] = []
    pair: tuple[int, int] | None = None


def test_messages_for_nested_fields_bounds_choices_and_extras() -> None:
    stage = registered(spec_of(Strict))
    message = problems(
        stage,
        {
            "n": -1,
            "s": "ABCDEF",
            "kind": "c",
            "maybe": 3,
            "inner": {"a": "q"},
            "items": [{"a": 1}, {}],
            "pair": [1, 2, 3],
            "x" * 100: 1,
        },
    )
    prefix, _, rest = message.partition(": ")
    assert prefix == "invalid payload for conveyor.test.stage"
    found = rest.split("; ")
    assert found[:5] == [
        f"{'x' * 37}...: Extra inputs are not permitted",
        "n: Input should be greater than or equal to 0",
        "s: String should have at most 3 characters",
        "s: String should match pattern '^[a-z]*$'",
        "kind: Input should be 'a' or 'b'",
    ]
    assert found[5] == "and 4 more"  # maybe, inner.a, items.1.a, pair: counted, not listed
    assert problems(stage, {"n": 1, "maybe": 3}).endswith("maybe: Input should be 'x', 'y' or null")
    assert problems(stage, {"n": 1, "inner": {"a": "q"}}).endswith("inner.a: Input should be an integer")
    assert problems(stage, {"n": 1, "items": [{"a": 1}, {}]}).endswith("items.1.a: Field required")
    assert problems(stage, {"n": 1, "pair": [1, 2, 3]}).endswith("pair: Array should have at most 2 items")


def test_validate_returns_json_with_defaults(registry: dict[str, RegisteredStage]) -> None:
    stage = registered(spec_of(Strict))
    assert stage.validate({"n": 1}) == {
        "n": 1,
        "s": "ab",
        "kind": "a",
        "maybe": None,
        "inner": None,
        "items": [],
        "pair": None,
    }

    class When(BaseModel):
        at: dt.datetime
        u: uuid.UUID

    u = uuid.uuid4()
    data = registered(spec_of(When)).validate({"at": dt.datetime(2030, 1, 2, tzinfo=dt.UTC), "u": u})
    assert data == {"at": "2030-01-02T00:00:00Z", "u": str(u)}


# -- unknown names -------------------------------------------------------------------------


def test_an_unknown_stage_lists_close_names(registry: dict[str, RegisteredStage]) -> None:
    with pytest.raises(UnknownStage) as info:
        lookup(registry, "conveyor.demo.sqare")
    assert isinstance(info.value, ConfigurationError)
    assert str(info.value) == "unknown stage 'conveyor.demo.sqare': did you mean 'conveyor.demo.square'?"
    assert info.value.suggestions == ("conveyor.demo.square",) and info.value.name == "conveyor.demo.sqare"
    assert close_names("demo.square", registry) == ["conveyor.demo.square"]
    assert close_names("conveyor.dmeo.square", registry) == ["conveyor.demo.square"]
    assert close_names("conveyor.files.extrct", registry) == ["conveyor.files.extract"]
    with pytest.raises(UnknownStage, match=r"25 are registered; list them with `conveyor stages`"):
        lookup(registry, "conveyor.billing.charge")
    few = {n: registry[n] for n in ("conveyor.demo.noop", "conveyor.demo.pad")}
    with pytest.raises(UnknownStage, match=r"known stages: conveyor.demo.noop, conveyor.demo.pad$"):
        lookup(few, "conveyor.billing.charge")
    with pytest.raises(UnknownStage, match="no stages are registered"):
        lookup({}, "conveyor.demo.square")
    assert lookup(registry, "conveyor.demo.square") is registry["conveyor.demo.square"]


# -- dedup as data -------------------------------------------------------------------------


def test_a_real_dedup_key_resolves_the_same_on_both_sides(
    specs: dict[str, StageSpec], registry: dict[str, RegisteredStage]
) -> None:
    spec, stage = specs["conveyor.demo.keyed"], registry["conveyor.demo.keyed"]
    assert spec.dedup is not None
    for payload in ({"user": "bob"}, {"user": "ünï cödé", "note": "x", "extra": 1}, {"user": "a:b{c}"}):
        assert stage.resolve_dedup(stage.validate(payload)) == spec.dedup.resolve(
            spec.name, spec.validate(payload)
        )
    assert registry["conveyor.demo.square"].resolve_dedup({"n": 1}) is None


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Rich(BaseModel):
    n: int
    f: float
    at: dt.datetime
    day: dt.date
    u: uuid.UUID
    kind: Literal["a", "b"] = "a"
    color: Color = Color.RED
    opt: float | None = None
    flag: bool = False


RICH_FIELDS = ("n", "f", "at", "day", "u", "kind", "color", "opt", "flag")
POLICIES = [
    Dedup(mode="id", fields=RICH_FIELDS),
    Dedup(mode="throttle", key="k:{n}:{f}:{at}:{day}:{u}:{kind}:{color}:{opt}:{flag}", ttl=5, scope="rich"),
    Dedup(mode="debounce", key="{n:05d}/{f:.2f}/{opt}", window=2.5, max_wait=10),
]

times = st.datetimes(
    min_value=dt.datetime(1990, 1, 1),
    max_value=dt.datetime(2090, 1, 1),
    timezones=st.sampled_from([None, dt.UTC, dt.timezone(dt.timedelta(hours=-5, minutes=-30))]),
)
numbers = st.one_of(st.integers(-(10**9), 10**9), st.floats(-1e9, 1e9, allow_nan=False))
payloads = st.fixed_dictionaries(
    {
        "n": st.integers(-(10**6), 10**6).flatmap(lambda n: st.sampled_from([n, float(n)])),
        "f": numbers,
        "at": times.map(lambda t: t.isoformat()),
        "day": st.dates().map(lambda d: d.isoformat()),
        "u": st.uuids().flatmap(lambda u: st.sampled_from([str(u), str(u).upper(), u.hex])),
    },
    optional={
        "kind": st.sampled_from(["a", "b"]),
        "color": st.sampled_from(["red", "blue"]),
        "opt": st.one_of(st.none(), numbers),
        "flag": st.booleans(),
    },
)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.mode)
@settings(max_examples=60, deadline=None)
@given(payload=payloads)
def test_a_dedup_policy_rebuilt_from_its_row_resolves_the_same_key(
    policy: Dedup, payload: dict[str, Any]
) -> None:
    spec = spec_of(Rich, policy)
    stage = registered(spec)
    assert stage.dedup_by_code is None and stage.dedup_policy() == policy
    expected = policy.resolve(spec.name, spec.validate(payload))
    assert stage.resolve_dedup(stage.validate(payload)) == expected
    assert stage.resolve_dedup(payload) == expected  # defaults are filled in for the key too


class Money(BaseModel):
    model_config = ConfigDict(str_to_lower=False)
    amount: decimal.Decimal
    user: str
    tags: list[str] = []
    alias_: str = Field(default="x", alias="aliased")
    made: str = Field(default_factory=lambda: "now")


class Lowered(BaseModel):
    user: str

    @field_validator("user")
    @classmethod
    def lower(cls, value: str) -> str:
        return value.lower()


class Shouting(BaseModel):
    model_config = ConfigDict(str_to_upper=True)
    user: str


@pytest.mark.parametrize(
    ("model", "policy", "reason"),
    [
        (Money, Dedup(key=lambda p: p.user), "its dedup key is computed by a function"),
        (
            Money,
            Dedup(key="m:{amount}"),
            "its dedup key reads 'amount', of type Decimal, which JSON does not carry",
        ),
        (Money, Dedup(mode="id", fields=("user", "tags")), "reads 'tags', of type list[str]"),
        (Money, Dedup(key="{alias_}"), "reads 'alias_', which has an alias"),
        (Money, Dedup(key="{made}"), "reads 'made', whose default is computed by a function"),
        (Money, Dedup(key="{missing}"), "reads 'missing', which is not a declared field"),
        (Lowered, Dedup(key="{user}"), "reads 'user', which a field validator or serializer rewrites"),
        (Shouting, Dedup(key="{user}"), "reads 'user', which its model's config rewrites (str_to_upper)"),
    ],
)
def test_a_key_only_code_computes_is_refused_to_the_client(
    model: type[BaseModel], policy: Dedup, reason: str
) -> None:
    row = describe(spec_of(model, policy))
    assert row["dedup"] is None and reason in row["dedup_by_code"]
    stage = RegisteredStage.from_row(row)
    with pytest.raises(ConfigurationError, match="submit it through the deployment's platform") as info:
        stage.dedup_policy()
    assert str(info.value).startswith("stage conveyor.test.stage: its dedup key ") and reason in str(
        info.value
    )
    with pytest.raises(ConfigurationError, match="computed by the deployment's code"):
        stage.resolve_dedup({"user": "u", "amount": "1.50"})


def test_resolve_data_agrees_with_resolve_for_a_models_values() -> None:
    model = Rich(n=3, f=1.5, at="2030-01-01T12:00:00+02:00", day="2030-01-01", u=uuid.uuid4(), opt=None)  # type: ignore[arg-type]
    for policy in POLICIES:
        want = policy.resolve("conveyor.test.stage", model)
        assert policy.resolve_data("conveyor.test.stage", model.model_dump(mode="python")) == want
    json_form = model.model_dump(mode="json")
    assert POLICIES[1].resolve_data("conveyor.test.stage", json_form) == POLICIES[1].resolve(
        "conveyor.test.stage", model
    )
    with pytest.raises(ConfigurationError, match="computed by a function"):
        Dedup(key=lambda p: p.user).resolve_data("conveyor.test.stage", {"user": "u"})


def test_a_bad_value_for_a_key_field_is_a_payload_error() -> None:
    stage = registered(spec_of(Rich, POLICIES[0]))
    payload = {"n": 1, "f": 1.0, "at": "yesterday", "day": "2030-01-01", "u": str(uuid.uuid4())}
    # JSON Schema formats are not checked by the client (the worker is the authority) ...
    stage.validate(payload)
    # ... but a key cannot be computed from a datetime that is not one.
    with pytest.raises(
        PayloadInvalid,
        match=r"^invalid payload for conveyor.test.stage: at: Input should be a valid datetime",
    ):
        stage.resolve_dedup(payload)
