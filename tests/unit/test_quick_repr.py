"""The bulk publish writes each message's ``kwargsrepr`` header by plain ``repr`` where that
is the very text Celery's ``saferepr`` writes, and leaves every other payload to Celery."""

from __future__ import annotations

from typing import Any

from celery.utils.saferepr import saferepr
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conveyor.delivery.reprs import quick_kwargsrepr

MAXSIZE, MAXLEVELS = 1024, 3

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(alphabet="abc XYZ09_-.:/@#()[]{}<>,;!?=+~`|'\"\\\n\té", max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(alphabet="abxy_'", max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
payloads = st.dictionaries(st.text(alphabet="abnxy_ '", max_size=12), values, max_size=6)


@settings(max_examples=1500, deadline=None)
@given(payloads)
def test_quick_repr_is_saferepr_or_nothing(payload: dict[str, Any]) -> None:
    quick = quick_kwargsrepr(payload, MAXSIZE, MAXLEVELS)
    event("quick" if quick is not None else "celery")
    if quick is not None:
        assert quick == saferepr(payload, MAXSIZE, maxlevels=MAXLEVELS)


def test_the_common_payloads_take_the_quick_path() -> None:
    for payload in (
        {"n": 7},
        {"note": "order-42", "sleep": 0.5},
        {"ids": [1, 2, 3], "opts": {"a": True}},
        {},
    ):
        assert quick_kwargsrepr(payload, MAXSIZE, MAXLEVELS) == saferepr(
            payload, MAXSIZE, maxlevels=MAXLEVELS
        )


def test_others_are_left_to_celery() -> None:
    for payload in (
        {"note": "it's"},
        {"note": "line\nbreak"},
        {"deep": {"a": {"b": 1}}},
        {"pad": "x" * 600},
        {1: "non-str key"},
    ):
        assert quick_kwargsrepr(payload, MAXSIZE, MAXLEVELS) is None
    assert quick_kwargsrepr({"n": 1}, MAXSIZE, 2) is None
