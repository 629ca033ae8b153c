"""What a stage returns is stored as Celery's JSON backend stores it."""

from __future__ import annotations

from celery import Celery
from celery.result import AsyncResult, GroupResult

from conveyor.stage import to_jsonable


def test_a_returned_async_result_is_stored_as_its_tuple_as_celery_does() -> None:
    app = Celery(set_as_current=False)
    parent = AsyncResult("p", app=app)
    child = AsyncResult("c", parent=parent, app=app)
    group = GroupResult("g", [child], app=app)
    assert to_jsonable(child) == [["c", [["p", None], None]], None]
    assert to_jsonable({"flow": group}) == {"flow": [["g", None], [[["c", [["p", None], None]], None]]]}
