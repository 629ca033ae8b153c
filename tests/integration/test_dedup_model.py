"""The three dedup modes against a model, on real Redis and Postgres, with a virtual clock.

Workers are not involved: jobs finish (or start) when the state machine says so, through
the same compare-and-set transitions a worker uses.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sqlalchemy import update

from conveyor.dedup import Dedup
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs

pytestmark = pytest.mark.timeout(600)

TTL, WINDOW, MAX_WAIT = 3.0, 2.0, 5.0
POLICIES = {
    "simple": Dedup(mode="simple", key="k:{note}"),
    "throttle": Dedup(mode="throttle", key="k:{note}", ttl=TTL),
    "debounce": Dedup(mode="debounce", key="k:{note}", window=WINDOW, max_wait=MAX_WAIT),
}
KEYS = ["a", "b"]

settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci")


class DedupModel(RuleBasedStateMachine):
    """Model: per (mode, key) the expected holder, its window and its state."""

    platform: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000_000.0 + uuid.uuid4().int % 1_000_000
        self.run = uuid.uuid4().hex[:8]
        self.platform.deduper.clock = lambda: self.now
        self.holders: dict[tuple[str, str], dict[str, Any]] = {}
        self.seen: list[tuple[str, bool, str | None]] = []

    @initialize()
    def start(self) -> None:
        pass

    def _scope(self, mode: str) -> Dedup:
        p = POLICIES[mode]
        return Dedup(
            mode=p.mode,
            key=p.key,
            ttl=p.ttl,
            window=p.window,
            max_wait=p.max_wait,
            scope=f"{self.run}-{mode}",
        )

    def _expect_hit(self, mode: str, h: dict[str, Any] | None) -> bool:
        if h is None:
            return False
        if mode == "simple":
            return not h["terminal"]
        if mode == "throttle":
            return self.now < h["expires"]
        return self.now < h["expires"] and not h["started"]

    @rule(mode=st.sampled_from(list(POLICIES)), key=st.sampled_from(KEYS), value=st.integers(0, 10**6))
    def submit(self, mode: str, key: str, value: int) -> None:
        h = self.holders.get((mode, key))
        hit = self._expect_hit(mode, h)
        handle = self.platform.submit(
            "conveyor.demo.effect", {"note": key, "sleep": value / 10**9}, dedup=self._scope(mode)
        )
        assert handle.deduplicated == hit, (mode, key, h, self.now)
        if hit:
            assert h is not None and handle.id == h["job"]
            if mode == "debounce":
                h["expires"] = min(self.now + WINDOW, h["first"] + MAX_WAIT)
                h["payload"] = value
        else:
            assert h is None or handle.id != h["job"]
            expires = {"simple": float("inf"), "throttle": self.now + TTL, "debounce": self.now + WINDOW}[
                mode
            ]
            self.holders[(mode, key)] = {
                "job": handle.id,
                "expires": expires,
                "first": self.now,
                "terminal": False,
                "started": False,
                "payload": value,
            }

    @rule(dt=st.floats(0.1, 4.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(mode=st.sampled_from(list(POLICIES)), key=st.sampled_from(KEYS))
    def finish(self, mode: str, key: str) -> None:
        h = self.holders.get((mode, key))
        if h is None or h["terminal"]:
            return
        with self.platform.engine.begin() as conn:
            conn.execute(
                update(jobs)
                .where(jobs.c.id == h["job"])
                .values(status=s.SUCCEEDED, published_at=s.jobs.c.created_at)
            )
        self.platform.finished(h["job"], s.SUCCEEDED, dedup_key="x")
        h["terminal"] = h["started"] = True

    @rule(key=st.sampled_from(KEYS))
    def debounce_starts(self, key: str) -> None:
        h = self.holders.get(("debounce", key))
        if h is None or h["started"]:
            return
        with self.platform.engine.begin() as conn:
            conn.execute(
                update(jobs)
                .where(jobs.c.id == h["job"])
                .values(status=s.RUNNING, published_at=s.jobs.c.created_at)
            )
        h["started"] = True

    @invariant()
    def debounce_payload_is_the_last_submitted(self) -> None:
        for (mode, _), h in self.holders.items():
            if mode == "debounce" and not h["started"]:
                with self.platform.engine.connect() as conn:
                    row = self.platform.store.get(conn, h["job"])
                assert row is not None and row["payload"]["sleep"] == h["payload"] / 10**9

    def teardown(self) -> None:
        self.platform.deduper.clock = self.platform.deduper.redis_time


def test_dedup_modes_match_the_model(platform: Any) -> None:
    DedupModel.platform = platform
    try:
        DedupModel.TestCase().runTest()
    finally:
        platform.deduper.clock = platform.deduper.redis_time
