"""Retry policies, payload handling and the error tree."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from conveyor.errors import PayloadInvalid, PermanentError, TransientError, is_permanent
from conveyor.retry import Backoff, Schedule, requeue_delay
from conveyor.settings import ConveyorSettings
from conveyor.stage import StageSpec, payload_from_call
from conveyor.store.events import EventCursor
from conveyor.store.jobs import parse_cursor


def test_backoff_is_exponential_jittered_and_capped() -> None:
    b = Backoff(base=1, cap=10)
    for attempt, raw in [(1, 1), (2, 2), (3, 4), (5, 10), (9, 10)]:
        d = b.delay(attempt, default_base=99, default_cap=99)
        assert raw / 2 <= d <= raw
    assert Backoff(jitter=False).delay(3, default_base=0.5, default_cap=100) == 2.0


def test_backoff_takes_a_factor_and_keeps_its_jitter() -> None:
    b = Backoff(base=2, cap=300, factor=3, jitter=False)
    assert [b.delay(a, default_base=0, default_cap=0) for a in (1, 2, 3, 6)] == [2, 6, 18, 300]
    jittered = Backoff(base=2, cap=300, factor=3)
    assert all(9 <= jittered.delay(3, default_base=0, default_cap=0) <= 18 for _ in range(50))
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)


def test_a_keyed_stage_counts_each_key_against_its_own_limit() -> None:
    class P(BaseModel):
        channel: str

    def spec(**policy: object) -> StageSpec:
        return StageSpec(name="a.b.c", fn=lambda c, p: None, payload=P, queue="q", max_attempts=1, **policy)  # type: ignore[arg-type]

    assert spec().concurrency_of({"channel": "x"}) is None
    assert spec(concurrency=3).concurrency_of({"channel": "x"}) == ("", 3)
    keyed = spec(
        concurrency=2,
        concurrency_key="channel:{channel}",
        concurrency_limit=lambda key: 5 if key == "channel:ig" else None,
        concurrency_keys=(("channel:fb", 7),),
    )
    assert keyed.concurrency_of({"channel": "tw"}) == ("channel:tw", 2)
    assert keyed.concurrency_of({"channel": "ig"}) == ("channel:ig", 5)
    assert keyed.concurrency_of({"channel": "fb"}) == ("channel:fb", 7)  # CONVEYOR_STAGES wins
    assert spec(concurrency_key="channel:{channel}").concurrency_of({"channel": "x"}) is None


def test_explicit_schedule_repeats_last() -> None:
    s = Schedule((1, 5, 30, 120, 600))
    assert [s.delay(a, default_base=0, default_cap=0) for a in (1, 2, 5, 6, 9)] == [1, 5, 600, 600, 600]


def test_uncounted_requeues_by_default_outlast_a_ten_minute_outage() -> None:
    """Requeue n (0-based) waits min(cap, base * 2**n): with the defaults (1 s, 60 s, 20
    requeues) a job is dead-lettered for "infrastructure kept failing" only after at least
    1+2+4+8+16+32+14*60 = 903 s of requeue waits."""
    fields = ConveyorSettings.model_fields
    base, cap = fields["infra_backoff"].default, fields["infra_backoff_cap"].default
    delays = [requeue_delay(n, base=base, cap=cap) for n in range(fields["max_requeues"].default)]
    assert delays[:4] == [1, 2, 4, 8] and max(delays) == delays[-1] == cap
    assert sum(delays) >= 600


def test_error_tree_drives_policy() -> None:
    assert is_permanent(PayloadInvalid("x")) and is_permanent(PermanentError("x"))
    assert not is_permanent(TransientError("x")) and not is_permanent(ValueError("x"))


class P(BaseModel):
    n: int


def test_payload_validation_is_readable_and_hides_values() -> None:
    spec = StageSpec(name="conveyor.t.x", fn=lambda c, p: None, payload=P, queue="q", max_attempts=1)
    with pytest.raises(PayloadInvalid) as info:
        spec.validate({"n": "secret-value"})
    assert "n: " in str(info.value) and "secret-value" not in str(info.value)


def test_payload_from_call_merges_chain_results_and_chord_lists() -> None:
    spec = StageSpec(name="conveyor.t.x", fn=lambda c, p: None, payload=P, queue="q", max_attempts=1)
    assert payload_from_call(spec, ({"n": 1, "m": 2},), {}) == {"n": 1, "m": 2}  # a dict result merges whole
    assert payload_from_call(spec, ({"n": 1},), {"n": 3}) == {"n": 3}  # under the keywords
    assert payload_from_call(spec, ([1, 2],), {}) == {"results": [1, 2]}
    assert payload_from_call(spec, (), {"n": 1, "results": []}) == {"n": 1, "results": []}  # as a chord calls
    assert payload_from_call(spec, (5,), {}) == {"n": 5}  # positional: the fields in order (#29)
    with pytest.raises(PayloadInvalid, match="takes 1 positional argument but 2 were given"):
        payload_from_call(spec, (5, 6), {})
    plain = StageSpec(
        name="conveyor.t.y", fn=lambda c, p: None, payload=P, queue="q", max_attempts=1, positional=True
    )
    assert payload_from_call(plain, ({"a": 1},), {}) == {"n": {"a": 1}}  # Celery's rule


def test_cursor_round_trip() -> None:
    assert parse_cursor(None) == EventCursor()
    assert parse_cursor("1234") == EventCursor(after=1234)
    # A cursor from before migration 0009 ("txid:id") resumes after event id.
    assert parse_cursor("12:34") == EventCursor(legacy_id=34)
    for bad in ("x", "-1", "1:x"):
        with pytest.raises(ValueError):
            parse_cursor(bad)


def test_a_refused_stage_name_says_the_rule_it_breaks() -> None:
    """A Celery user's ``tasks.add`` is refused with the rule, not only an example of it."""
    from celery import Celery

    from conveyor.errors import ConfigurationError
    from conveyor.settings import ConveyorSettings
    from conveyor.stages import Stages

    class Carrier:
        settings = ConveyorSettings()

    declared = Stages(Celery(set_as_current=False), Carrier(), queue_names={"demo"}, default_queue="demo")
    with pytest.raises(ConfigurationError, match="three or more dot-separated lower-case parts"):
        declared.declare(
            "tasks.add", payload=BaseModel, queue=None, max_attempts=None, retry=None,
            time_limit=None, soft_time_limit=None, concurrency=None,
        )  # fmt: skip
