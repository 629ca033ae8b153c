"""Stages declared on the signatures Celery users write (#29): ``*args``, ``**kwargs``,
keyword-only parameters, and the keywords no parameter names (refused, as Celery's
``TypeError``)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from conveyor.errors import ConfigurationError, PayloadInvalid
from conveyor.settings import ConveyorSettings
from conveyor.stage import StageSpec, payload_from_call
from conveyor.stages import Stages


class _Carrier:
    settings = ConveyorSettings()


def _declare(fn: Any, *, bind: bool = False) -> StageSpec:
    declared = Stages(Celery(set_as_current=False), _Carrier(), queue_names={"demo"}, default_queue="demo")
    return declared.declare(
        f"conveyor.sig.{fn.__name__}",
        bind=bind,
        payload=None,
        queue=None,
        max_attempts=None,
        retry=None,
        time_limit=None,
        soft_time_limit=None,
        concurrency=None,
    )(fn)


def _run(spec: StageSpec, *args: Any, **kwargs: Any) -> Any:
    return spec.fn(None, spec.validate(payload_from_call(spec, args, kwargs)))


def fail(*args):  # type: ignore[no-untyped-def]  # as Celery's integration tasks write it
    return ("Task expected to fail", *args)


def retry_once(x, *args, expires=None, countdown=0.1):  # type: ignore[no-untyped-def]
    return x, args, expires, countdown


def sleeping(i, **_):  # type: ignore[no-untyped-def]
    return i, _


def add(x: int, y: int, z: int | None = None) -> int:
    return x + y + (z or 0)


def test_star_args_collects_the_positional_arguments_past_the_named_ones() -> None:
    spec = _declare(fail)
    assert spec.var_positional == "args" and spec.var_keyword is None
    assert payload_from_call(spec, ("test", 2), {}) == {"args": ["test", 2]}
    assert _run(spec, "test") == ("Task expected to fail", "test")
    assert _run(spec) == ("Task expected to fail",)


def test_keyword_only_parameters_after_star_args_stay_keywords() -> None:
    spec = _declare(retry_once)
    assert _run(spec, 1, 2, 3, countdown=5) == (1, (2, 3), None, 5)
    with pytest.raises(PayloadInvalid, match="unexpected keyword argument 'count'"):
        payload_from_call(spec, (1,), {"count": 5})


def test_double_star_collects_unknown_keywords_under_kwargs_when_named_underscore() -> None:
    spec = _declare(sleeping)
    assert spec.var_keyword == "kwargs"
    assert _run(spec, 0, colour="red") == (0, {"colour": "red"})


def test_an_unknown_or_misspelt_keyword_is_refused_with_the_fields() -> None:
    spec = _declare(add)
    with pytest.raises(PayloadInvalid, match=r"unexpected keyword argument 'zz' \(its fields: x, y, z\)"):
        payload_from_call(spec, (1, 2), {"zz": 3})
    with pytest.raises(PayloadInvalid, match="takes 3 positional arguments but 4 were given"):
        payload_from_call(spec, (1, 2, 3, 4), {})
    assert _run(spec, 1, 2, z=3) == 6


def test_positional_only_parameters_are_refused_at_declaration() -> None:
    def pos(x, /):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(ConfigurationError, match="positional-only"):
        _declare(pos)


def test_a_keyword_only_parameter_takes_no_positional_argument() -> None:
    def scale(x, *, factor=2):  # type: ignore[no-untyped-def]
        return x * factor

    spec = _declare(scale)
    assert _run(spec, 3) == 6 and _run(spec, 3, factor=3) == 9
    with pytest.raises(PayloadInvalid, match="takes 1 positional argument but 2 were given"):
        payload_from_call(spec, (3, 4), {})


def test_an_ignored_positional_parameter_is_a_field_named_by_its_place() -> None:
    def echo_group(_, redis_key="k"):  # type: ignore[no-untyped-def]  # as Celery's tests write it
        return redis_key

    spec = _declare(echo_group)
    assert list(spec.payload.model_fields) == ["arg0", "redis_key"]
    assert _run(spec, [1, 2]) == "k" and _run(spec, None, redis_key="r") == "r"


def test_errback_style_follows_celerys_rule() -> None:
    """Celery (``Backend._call_task_errbacks``): ``*args`` or two free positional arguments
    make a new-style errback; a bound task is always old style (its header is a partial)."""
    from celery import signature

    from conveyor.worker.continuations import _new_style

    def new_style(request, exc, tb, label=None):  # type: ignore[no-untyped-def]
        return label

    def old_style(request_id, *, label=None):  # type: ignore[no-untyped-def]
        return label

    def bound(self, *args, countdown=None):  # type: ignore[no-untyped-def]
        return args

    new_spec, old_spec, bound_spec = _declare(new_style), _declare(old_style), _declare(bound, bind=True)
    assert _new_style(new_spec, signature("x")) and not _new_style(old_spec, signature("x"))
    assert not _new_style(new_spec, signature("x", args=(1, 2, 3)))  # one positional left free
    assert _new_style(_declare(fail), signature("x")) and not _new_style(bound_spec, signature("x"))
