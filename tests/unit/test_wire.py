"""What a stage returns is stored as Celery's JSON backend stores it."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.result import AsyncResult, GroupResult

from conveyor.stage import to_jsonable
from conveyor.wire import from_wire, to_wire, wire_text


def test_a_returned_async_result_is_stored_as_its_tuple_as_celery_does() -> None:
    app = Celery(set_as_current=False)
    parent = AsyncResult("p", app=app)
    child = AsyncResult("c", parent=parent, app=app)
    group = GroupResult("g", [child], app=app)
    assert to_jsonable(child) == [["c", [["p", None], None]], None]
    assert to_jsonable({"flow": group}) == {"flow": [["g", None], [[["c", [["p", None], None]], None]]]}


@pytest.mark.parametrize(
    "value",
    [
        b"\x00raw",
        "a\x00b",
        {"nested": ["x\x00", {"k": b"\x00\xff"}], "plain": "ok"},
        ("\x00", b"ok", "é\x00ü"),
    ],
)
def test_no_nul_escape_is_ever_stored_and_the_value_comes_back(value: object) -> None:
    """Postgres fails every ``->>`` over a json row holding ``\\u0000``: neither bytes nor
    strings holding a NUL may put one in the stored text, and both come back as sent."""
    text = wire_text(value)
    assert "\\u0000" not in text and "\x00" not in text
    expected = list(value) if isinstance(value, tuple) else value
    assert from_wire(to_wire({"v": value}))["v"] == expected


def test_plain_strings_and_utf8_bytes_keep_kombus_own_encoding() -> None:
    assert to_wire({"s": "plain", "b": b"ok"}) == {
        "s": "plain",
        "b": {"__type__": "bytes", "__value__": "ok"},
    }
