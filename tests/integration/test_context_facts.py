"""What a body knows of its job: ``ctx.owner`` (whose job: a tenant's data is theirs to
act on) and ``ctx.final_attempt`` (a failure now dead-letters the job, so a body with a
useful partial answer may give it instead)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from conveyor.errors import TransientError
from conveyor.retry import Backoff
from conveyor.store.db import schema as s
from tests.helpers import module_stages

pytestmark = pytest.mark.timeout(60)
PREFIX = "conveyor.facts."


class Ref(BaseModel):
    ref: str


def _facts(ctx: Any, p: Ref) -> dict[str, Any]:
    if not ctx.final_attempt:
        raise TransientError("not yet")
    return {"owner": ctx.owner, "final": ctx.final_attempt, "attempt": ctx.attempt}


@pytest.fixture(scope="module")
def declared(platform: Any) -> Iterator[Any]:
    found = {
        "facts": platform.stage(
            f"{PREFIX}facts", payload=Ref, queue="demo", max_attempts=3, retry=Backoff(base=0.05, cap=0.05)
        )(_facts)
    }
    with module_stages(platform, PREFIX, found) as stages:
        yield stages


def test_a_body_knows_its_owner_and_its_last_attempt(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    mine = platform.submit(f"{PREFIX}facts", {"ref": tag}, owner=f"alice-{tag}")
    assert mine.wait(30) == s.SUCCEEDED
    assert mine.result == {"owner": f"alice-{tag}", "final": True, "attempt": 3}
    ours = platform.submit(f"{PREFIX}facts", {"ref": f"{tag}-2"})
    assert ours.wait(30) == s.SUCCEEDED and ours.result["owner"] is None
