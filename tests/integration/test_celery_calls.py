"""Stages called the way Celery tasks are (#29): positional arguments, plain signatures,
the job accessor, and payload values that kombu's JSON carries (bytes, datetimes...)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from celery import chain, chord
from pydantic import BaseModel
from sqlalchemy import select

from conveyor.errors import PayloadInvalid, PayloadTooLarge
from conveyor.shared import current_job
from conveyor.store.db import schema as s
from tests.helpers import dead_letter_for, eventually, job_row, module_stages

pytestmark = pytest.mark.timeout(120)


def add(x: int, y: int) -> int:
    return x + y


def tsum(nums: list[int]) -> int:
    return sum(nums)


def whoami(note):  # type: ignore[no-untyped-def]  # a Celery task as written, unannotated
    job = current_job()
    return {"job_id": job.job_id, "attempt": job.attempt, "note": note}


def echo(value, tag: str = ""):  # type: ignore[no-untyped-def]
    return value


def bound_retry(self, tag: str, times: int = 1):  # type: ignore[no-untyped-def]  # bind=True, as in Celery
    if self.request.retries < times:
        raise self.retry(countdown=0.1, max_retries=times)
    return {"id": self.request.id, "retries": self.request.retries, "tag": tag}


def retry_then_give_up(self, tag: str):  # type: ignore[no-untyped-def]
    raise self.retry(exc=ValueError(f"no luck for {tag}"), countdown=0, max_retries=1)


def fail_with(*args, **options):  # type: ignore[no-untyped-def]  # as Celery's own tests write tasks
    return {"args": list(args), "options": options}


class Scaled(BaseModel):
    n: int
    factor: int = 1


def scaled(ctx: Any, p: Scaled) -> dict[str, int]:
    return {"n": p.n * p.factor}


class Blob(BaseModel):
    data: bytes
    at: dt.datetime


def blob(ctx: Any, p: Blob) -> dict[str, Any]:
    return {"data": p.data, "at": p.at}


@pytest.fixture(scope="module")
def calls(platform: Any) -> Iterator[SimpleNamespace]:
    """This module's stages, for its tests only: the registry tests of the same session
    expect the deployment's stages alone."""
    declared = {
        "add": platform.stage("conveyor.calls.add", queue="demo")(add),
        "tsum": platform.stage("conveyor.calls.tsum", queue="demo")(tsum),
        "whoami": platform.stage("conveyor.calls.whoami", queue="demo")(whoami),
        "echo": platform.stage("conveyor.calls.echo", queue="demo")(echo),
        "fail_with": platform.stage("conveyor.calls.fail_with", queue="demo")(fail_with),
        "bound_retry": platform.stage("conveyor.calls.bound_retry", queue="demo", bind=True)(bound_retry),
        "give_up": platform.stage("conveyor.calls.give_up", queue="demo", bind=True, max_attempts=5)(
            retry_then_give_up
        ),
        "scaled": platform.stage("conveyor.calls.scaled", payload=Scaled, queue="demo")(scaled),
        "blob": platform.stage("conveyor.calls.blob", payload=Blob, queue="demo")(blob),
    }
    with module_stages(platform, "conveyor.calls.", declared) as declared_stages:
        yield declared_stages


def test_positional_chain_passes_the_parent_result_first(platform: Any, calls: Any, worker: Any) -> None:
    flow = (calls.add.s(2, 2) | calls.add.s(4)).apply_async()
    assert flow.get(timeout=30) == 8
    assert platform.job(flow.id).row()["payload"] == {"x": 4, "y": 4}


def test_plain_celery_send_task_with_positional_args_is_adopted(
    platform: Any, calls: Any, worker: Any
) -> None:
    result = platform.app.send_task("conveyor.calls.add", args=(2, 3), queue="demo")
    assert result.get(timeout=30) == 5


def test_chord_of_positional_stages_with_a_positional_body(platform: Any, calls: Any, worker: Any) -> None:
    result = chord([calls.add.s(i, i) for i in range(4)], calls.tsum.s()).apply_async()
    assert result.get(timeout=30) == 12


def test_plain_signature_reads_its_job_through_the_accessor(
    platform: Any, calls: Any, worker: Any, tag: str
) -> None:
    result = calls.whoami.delay(tag)
    out = result.get(timeout=30)
    assert out == {"job_id": result.job.id, "attempt": 1, "note": tag}
    assert calls.whoami(tag)["job_id"] == "inline"  # a direct call runs inline, the accessor too
    with pytest.raises(LookupError, match="no job"):
        current_job()


def test_model_stage_keeps_dict_results_and_takes_positional_fields(
    platform: Any, calls: Any, worker: Any
) -> None:
    # A dict result is merged as fields (as before #29), then the keywords apply.
    flow = chain(calls.scaled.si(n=3), calls.scaled.s(factor=2)).apply_async()
    assert flow.get(timeout=30) == {"n": 6}
    assert calls.scaled.delay(5, 3).get(timeout=30) == {"n": 15}  # positional, in declared order
    assert calls.scaled(4, factor=2) == {"n": 8}


def test_bad_positional_calls_are_refused_naming_the_problem(platform: Any, calls: Any, worker: Any) -> None:
    too_many = r"conveyor.calls.add takes 2 positional arguments but 3 were given"
    with pytest.raises(PayloadInvalid, match=too_many):
        calls.add.delay(1, 2, 3)
    with pytest.raises(PayloadInvalid, match=r"conveyor.calls.add got multiple values for 'x'"):
        calls.add.delay(1, x=2)
    assert calls.add.delay(1, y=2).get(timeout=30) == 3
    # A link that gets one argument too many is dead-lettered with the reason; the parent stands.
    flow = (calls.add.s(1, 1) | calls.add.s(2, 3)).apply_async()
    link = eventually(lambda: (r := job_row(platform, flow.id)) is not None and r["status"] == s.DEAD and r)
    letter = dead_letter_for(platform, link["id"])
    assert letter["error_type"] == "PayloadInvalid"
    assert "takes 2 positional arguments but 3 were given" in letter["message"]
    assert platform.job(flow.parent.id).status() == s.SUCCEEDED


def test_a_misspelt_keyword_is_refused_on_every_path(platform: Any, calls: Any, worker: Any) -> None:
    """Celery raises TypeError for a keyword the function does not take; a stage refuses it
    too instead of dropping it (at submit, and for a link, in its dead letter)."""
    unexpected = r"conveyor.calls.add got unexpected keyword argument 'yy' \(its fields: x, y\)"
    with pytest.raises(PayloadInvalid, match=unexpected):
        calls.add.delay(1, yy=2)
    with pytest.raises(PayloadInvalid, match=r"unexpected keyword argument 'factr'"):
        calls.scaled.delay(n=1, factr=2)  # a payload= stage too
    flow = (calls.add.s(1, 1) | calls.add.s(yy=3)).apply_async()
    link = eventually(lambda: (r := job_row(platform, flow.id)) is not None and r["status"] == s.DEAD and r)
    assert "unexpected keyword argument 'yy'" in dead_letter_for(platform, link["id"])["message"]


def test_star_args_and_kwargs_stages_take_what_celery_tasks_take(
    platform: Any, calls: Any, worker: Any
) -> None:
    assert calls.fail_with.delay("a", 2, colour="red").get(timeout=30) == {
        "args": ["a", 2],
        "options": {"colour": "red"},
    }
    assert platform.job(calls.fail_with.delay().id).row()["payload"] == {"args": [], "options": {}}
    flow = (calls.add.s(1, 1) | calls.fail_with.s("x")).apply_async()
    assert flow.get(timeout=30) == {"args": [2, "x"], "options": {}}


def test_a_bound_stage_retries_itself_as_a_celery_task_does(
    platform: Any, calls: Any, worker: Any, tag: str
) -> None:
    """``bind=True`` gives the body its task; ``self.retry()`` is another counted attempt of
    the same job after ``countdown``, and ``request.retries`` counts them."""
    result = calls.bound_retry.delay(tag, 2)
    assert result.get(timeout=30) == {"id": result.id, "retries": 2, "tag": tag}
    row = platform.job(result.id).row()
    assert row["attempts"] == 3 and row["status"] == s.SUCCEEDED
    assert calls.bound_retry(tag, 0) == {"id": calls.bound_retry.request.id, "retries": 0, "tag": tag}


def test_past_max_retries_the_job_dies_of_the_error_it_gave(
    platform: Any, calls: Any, worker: Any, tag: str
) -> None:
    """``retry(exc=..., max_retries=1)``: two attempts in all (not the stage's five), then the
    job is dead-lettered with ``exc`` and ``get()`` raises it, as Celery raises it."""
    result = calls.give_up.delay(tag)
    with pytest.raises(ValueError, match=f"no luck for {tag}"):
        result.get(timeout=30)
    row = platform.job(result.id).row()
    assert row["status"] == s.DEAD and row["attempts"] == 2
    letter = dead_letter_for(platform, result.id)
    assert letter["error_type"] == "ValueError" and "gave up after 2 of 2 attempts" in letter["message"]


def test_kombu_json_values_round_trip_through_body_result_and_next_link(
    platform: Any, calls: Any, worker: Any
) -> None:
    values = {
        "bytes": b"\x00\xffbinary",
        "text_bytes": b"plain",
        "datetime": dt.datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC),
        "decimal": Decimal("1.10"),
        "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    }
    flow = (calls.echo.s(values) | calls.echo.s()).apply_async()
    assert flow.get(timeout=30) == values
    assert flow.parent.get(timeout=10) == values
    row = platform.job(flow.id).row()
    assert row["payload"]["value"]["bytes"]["__type__"] == "base64"  # stored as kombu tags it
    assert platform.job(flow.id).result == values
    # A stage declared with a payload model takes them as well, binary bytes included.
    sent = {"data": b"\x00\xff", "at": values["datetime"]}
    assert calls.blob.delay(**sent).get(timeout=30) == sent


def test_bytes_are_sized_in_kombu_json_against_the_limit(platform: Any, calls: Any) -> None:
    limit = platform.settings.max_payload_bytes
    # Base64 grows binary by a third: what fits raw does not fit encoded.
    with pytest.raises(PayloadTooLarge, match="bytes of JSON, over the limit"):
        calls.echo.apply_async((b"\xff" * (limit * 3 // 4 + 100),), countdown=3600)
    handle = calls.echo.apply_async((b"\xff" * (limit * 3 // 4 - 200),), countdown=3600).job
    assert handle.status() == s.QUEUED
    platform.cancel(handle.id)


def test_bytes_in_a_link_signature_are_stored_and_arrive_as_bytes(
    platform: Any, calls: Any, worker: Any
) -> None:
    """A link's own arguments are kept in the job's options in kombu's JSON (before: a
    ``TypeError`` at submit; test_canvas.py::test_group::test_callback_called_by_group)."""
    res = calls.add.apply_async((1, 2), link=calls.echo.si(b"\x00raw"))
    assert res.get(timeout=30) == 3

    def child() -> Any:
        with platform.engine.connect() as conn:
            query = select(s.jobs).where(s.jobs.c.parent_id == res.id)
            return conn.execute(query).mappings().first()

    link = eventually(lambda: (row := child()) is not None and row["status"] == s.SUCCEEDED and row)
    assert platform.job(link["id"]).result == b"\x00raw"
    text = calls.echo.delay("a\x00b")
    assert text.get(timeout=30) == "a\x00b"
    # Postgres fails a ->> over any json row holding \u0000: a NUL in one job's bytes or
    # text must not break the queries over every job's payload (found by CI in files').
    with platform.engine.connect() as conn:
        query = select(s.jobs.c.id).where(s.jobs.c.payload["file_id"].as_string() == "none")
        assert conn.execute(query).all() == []
