"""The stage registry in Postgres and SQLite: rows written from the deployment's stages,
read back by a client, refreshed by workers of databases old and new.

Isolation: the Postgres tests write inside a transaction they roll back (or under names
tagged for the test, deleted afterwards); the SQLite tests use a scratch file each."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from pydantic import BaseModel, model_validator
from sqlalchemy import Connection, Engine, delete, inspect

from conveyor.client.registry import RegisteredStage, describe, load, lookup, refresh, write
from conveyor.errors import ConfigurationError, PayloadInvalid, UnknownStage
from conveyor.stage import StageSpec
from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.migrate import alembic_config, upgrade
from conveyor.store.db.schema import stages
from tests.helpers import scratch_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def specs() -> list[StageSpec]:
    """The deployment's real stages."""
    from config.celery_app import platform

    platform.app.loader.import_default_modules()
    return list(platform.stages.values())


@pytest.fixture(params=["postgres", pytest.param("sqlite", marks=pytest.mark.sqlite)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """Postgres: the session's database. SQLite: a scratch file, migrated."""
    if request.param == "postgres":
        yield request.getfixturevalue("platform").engine
        return
    eng = make_engine(sqlite_url(tmp_path))
    upgrade(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def conn(engine: Engine) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back: nothing outlives the test."""
    with engine.connect() as c:
        tx = c.begin()
        try:
            yield c
        finally:
            tx.rollback()


def tagged(spec: StageSpec, tag: str, **changes: Any) -> StageSpec:
    return dataclasses.replace(spec, name=f"conveyor.{tag}.{spec.name.rsplit('.', 1)[-1]}", **changes)


def content(stage: RegisteredStage) -> dict[str, Any]:
    row = dataclasses.asdict(stage)
    row.pop("updated_at")
    return row


def test_write_then_load_round_trips_every_stage(conn: Connection, specs: list[StageSpec]) -> None:
    write(conn, specs)
    registry = load(conn)
    for spec in specs:
        stage = registry[spec.name]
        assert content(stage) == describe(spec)
        assert isinstance(stage.updated_at, dt.datetime) and stage.updated_at.tzinfo is not None
    # An idempotent second write: nothing changes, not even updated_at.
    assert write(conn, specs) == []
    assert load(conn) == registry
    # The client resolves the real dedup key as the worker side does.
    keyed = next(s for s in specs if s.name == "conveyor.demo.keyed")
    assert keyed.dedup is not None
    payload = {"user": "bob", "note": "n"}
    want = keyed.dedup.resolve(keyed.name, keyed.validate(payload))
    got = lookup(registry, keyed.name)
    assert got.resolve_dedup(got.validate(payload)) == want


def test_a_changed_stage_is_rewritten_and_absent_ones_are_left_alone(
    conn: Connection, specs: list[StageSpec], tag: str
) -> None:
    square, sync = (
        next(s for s in specs if s.name == n) for n in ("conveyor.demo.square", "conveyor.demo.sync")
    )
    a, b = tagged(square, tag), tagged(sync, tag)
    assert write(conn, [b, a]) == sorted([a.name, b.name])
    before = load(conn)
    # A newer version of the deployment changes a and no longer declares b.
    assert write(conn, [tagged(square, tag, priority=5, max_attempts=9)]) == [a.name]
    after = load(conn)
    assert (after[a.name].priority, after[a.name].max_attempts) == (5, 9)
    assert after[b.name] == before[b.name]  # left for the workers that still run it
    assert after[a.name].updated_at >= before[a.name].updated_at  # type: ignore[operator]


def test_an_invalid_payload_is_refused_naming_the_field(conn: Connection, specs: list[StageSpec]) -> None:
    write(conn, specs)
    square = lookup(load(conn), "conveyor.demo.square")
    with pytest.raises(PayloadInvalid) as info:
        square.validate({"n": "seven"})
    assert str(info.value) == "invalid payload for conveyor.demo.square: n: Input should be an integer"
    assert square.validate({"n": 7}) == {"n": 7}


def test_an_unknown_stage_lists_close_names(conn: Connection, specs: list[StageSpec]) -> None:
    write(conn, specs)
    with pytest.raises(UnknownStage, match=r"did you mean 'conveyor\.demo\.square'\?$") as info:
        lookup(load(conn), "conveyor.demo.sqare")
    assert info.value.suggestions == ("conveyor.demo.square",)


class Window(BaseModel):
    """A payload with a rule JSON Schema cannot say: ``end`` after ``start``."""

    start: int
    end: int

    @model_validator(mode="after")
    def end_after_start(self) -> Window:
        if self.end <= self.start:
            raise ValueError("end must come after start")
        return self


def test_a_cross_field_rule_passes_the_client_and_is_refused_by_the_worker(
    conn: Connection, tag: str
) -> None:
    """Expected: the schema holds the fields' shapes, not the model's code, so the client
    accepts a payload the worker's pydantic model (``StageSpec.validate``, what the runner
    calls at claim) refuses; such a job is dead-lettered with the validator's message."""
    spec = StageSpec(
        name=f"conveyor.{tag}.window", fn=lambda ctx, p: None, payload=Window, queue="demo", max_attempts=1
    )
    write(conn, [spec])
    stage = lookup(load(conn), spec.name)
    payload = {"start": 5, "end": 1}
    assert stage.validate(payload) == payload
    with pytest.raises(PayloadInvalid, match="end must come after start"):
        spec.validate(payload)
    with pytest.raises(PayloadInvalid, match=r"end: Input should be an integer$"):
        stage.validate({"start": 5, "end": "later"})  # the shape is still checked by the client


def test_a_write_through_an_engine_commits(engine: Engine, specs: list[StageSpec], tag: str) -> None:
    mine = [tagged(s, tag) for s in specs[:3]]
    try:
        assert write(engine, mine) == sorted(s.name for s in mine)
        with engine.connect() as other:
            assert {s.name for s in mine} <= set(load(other))
        assert {s.name for s in mine} <= set(load(engine))
    finally:
        with engine.begin() as c:
            c.execute(delete(stages).where(stages.c.name.in_([s.name for s in mine])))


class Opaque:
    """A type with no JSON Schema."""


class Unschemable(BaseModel):
    model_config = {"arbitrary_types_allowed": True}
    thing: Opaque


@contextlib.contextmanager
def old_database(kind: str, tmp_path: Path) -> Iterator[Engine]:
    """A database of its own, migrated as far as 0009 (before the registry)."""
    with contextlib.ExitStack() as stack:
        url = (
            sqlite_url(tmp_path)
            if kind == "sqlite"
            else stack.enter_context(scratch_database("conveyor_reg"))
        )
        eng = make_engine(url, pool_size=2)
        stack.callback(eng.dispose)
        command.upgrade(alembic_config(eng), "0009")
        yield eng


@pytest.mark.parametrize("kind", ["postgres", pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_refresh_carries_on_before_the_migration_and_writes_after_it(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    specs: list[StageSpec],
    caplog: pytest.LogCaptureFixture,
) -> None:
    if kind == "postgres":
        request.getfixturevalue("services")
    caplog.set_level(logging.INFO, logger="conveyor.registry")
    with old_database(kind, tmp_path) as eng:
        # A worker of this version on a database not yet upgraded: a warning, no error.
        assert refresh(eng, specs) == []
        assert "table 'stages' does not exist yet" in caplog.text
        with pytest.raises(ConfigurationError, match="run `conveyor db upgrade`"):
            load(eng)
        upgrade(eng)
        bad = StageSpec(
            name="conveyor.demo.opaque",
            fn=lambda ctx, p: None,
            payload=Unschemable,
            queue="demo",
            max_attempts=1,
        )
        caplog.clear()
        assert refresh(eng, [*specs, bad]) == sorted(s.name for s in specs)
        assert (
            "conveyor.demo.opaque left out: stage conveyor.demo.opaque: its payload model has no JSON Schema"
            in caplog.text
        )
        with pytest.raises(ConfigurationError, match="has no JSON Schema"):
            write(eng, [bad])  # the strict form raises
        assert refresh(eng, specs) == []  # the next worker's start writes nothing
        assert set(load(eng)) == {s.name for s in specs}
        # The migration's downgrade drops the table, its upgrade creates it again.
        cfg = alembic_config(eng)
        command.downgrade(cfg, "0009")
        with eng.connect() as c:
            assert not inspect(c).has_table("stages")
        command.upgrade(cfg, "heads")
        assert load(eng) == {}
