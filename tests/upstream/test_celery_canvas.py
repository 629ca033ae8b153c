"""Celery's own canvas tests pass against stages (#29): ``t/integration/test_canvas.py`` of
the installed Celery runs against a plain Celery worker and, at the same time on another
Redis DB, against ``conveyor worker`` with Celery's task module declared as stages; every
test that passes on the plain side passes on the stages side, but for the tests that show
one of the README's "Differences from Celery" (xfail there, ``tests/upstream/differences.py``).

``--celery-canvas=subset`` (CI's: chains, groups, chords and link_error, without the tests
over 4 s on a plain worker, the differences listed but not run), ``all`` (the whole file,
the differences run as xfail), or test classes/ids, comma-separated.
``--celery-canvas-sides=stages`` skips the plain side.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import delete

from conveyor.delivery.procs import service_env
from conveyor.store.db.schema import stages
from tests.helpers import cancelling_leftovers
from tests.locks import claim_numbered
from tests.upstream import canvas_suite

pytestmark = pytest.mark.timeout(3600)

SUBSET = ("test_chain", "test_group", "test_chord", "test_link_error")
# The subset's tests that take over 4 s on a plain Celery 5.7.0 worker (most wait on purpose:
# sleeps, long timeouts, large headers); the whole file runs them.
SLOW = (
    "test_chain::test_chain_error_handler_with_eta",
    "test_chain::test_chaining_upgraded_chords_pure_groups",
    "test_chain::test_chaining_upgraded_chords_starting_with_chord",
    "test_chain::test_chaining_upgraded_chords_mixed_canvas",
    "test_chain::test_chaining_upgraded_chords_mixed_canvas_protocol_2",
    "test_group::test_generator_group_iterated_while_calling_len",
    "test_group::test_nested_group",
    "test_group::test_large_group",
    "test_chord::test_generator",
    "test_chord::test_chain_to_a_chord_with_large_header",
    "test_chord::test_error_propagates_from_chord",
    "test_chord::test_immutable_errback_called_by_chord_from_simple",
    "test_chord::test_mutable_errback_called_by_chord_from_simple",
    "test_chord::test_immutable_errback_called_by_chord_from_chain",
    "test_chord::test_immutable_errback_called_by_chord_from_chain_tail",
    "test_chord::test_immutable_errback_called_by_chord_from_group",
    "test_chord::test_immutable_errback_called_by_chord_from_group_fail_multiple",
    "test_chord::test_mutable_errback_called_by_chord_from_group_fail_multiple_on_header_failure",
    "test_chord::test_nested_chord_header_link_error",
    "test_chord::test_enabling_flag_allow_error_cb_on_chord_header",
    "test_chord::test_disabling_flag_allow_error_cb_on_chord_header",
    "test_chord::test_flag_allow_error_cb_on_chord_header_on_upgraded_chord",
)


def test_celery_canvas_tests_pass_against_stages(
    platform: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    option = request.config.getoption("--celery-canvas")
    subset = option == "subset"
    selection: tuple[str, ...] = (
        SUBSET
        if subset
        else ("",)
        if option == "all"
        else tuple(p.strip() for p in option.split(",") if p.strip())
    )
    if not selection:
        raise pytest.UsageError("--celery-canvas: 'subset', 'all', or test ids of test_canvas.py")
    both = request.config.getoption("--celery-canvas-sides") == "both"
    cache = Path(os.path.expanduser("~/.cache/conveyor-tests"))
    tree = canvas_suite.materialize(canvas_suite.celery_sdist(cache), tmp_path / "celery")
    env = {**service_env(platform.settings), "CONVEYOR_CANVAS_REDIS_URL": platform.settings.redis_url}
    logs = tmp_path / "logs"
    logs.mkdir()
    run = {"selection": selection, "logs": logs, "deselect": SLOW if subset else ()}
    claimed = claim_numbered("conveyor-test-redis-db", range(1, 12)) if both else None
    assert claimed is not None or not both, "no free Redis DB for the plain side"
    try:
        with ThreadPoolExecutor(2) as pool:
            plain = None
            if claimed is not None:
                # The plain side on a Redis DB of its own: both sides use the same fixed keys.
                plain_url = platform.settings.redis_url.rsplit("/", 1)[0] + f"/{claimed[0]}"
                redis.Redis.from_url(plain_url).flushdb()
                plain = pool.submit(
                    canvas_suite.run_side,
                    "plain",
                    tree,
                    env={**env, "CONVEYOR_CANVAS_REDIS_URL": plain_url},
                    run_differences=not subset,
                    **run,  # type: ignore[arg-type]
                )
            with cancelling_leftovers(platform):
                ours = canvas_suite.run_side("stages", tree, env=env, run_differences=not subset, **run)  # type: ignore[arg-type]
            plain_outcomes = plain.result() if plain is not None else None
    finally:
        if claimed is not None:
            os.close(claimed[1])
        with platform.engine.begin() as conn:  # the registry tests expect the deployment's stages
            conn.execute(delete(stages).where(stages.c.name.like("t.integration.tasks.%")))
    if plain_outcomes is not None:
        print(f"celery_canvas plain {plain_outcomes.counts()}")
    print(f"celery_canvas stages {ours.counts()}")
    expected = plain_outcomes.passed if plain_outcomes is not None else {*ours.passed, *ours.failed}
    broken = {
        test_id: ours.failed.get(test_id, "not run")
        for test_id in sorted(expected)
        if test_id not in ours.passed and test_id not in ours.xfailed
    }
    assert plain_outcomes is None or plain_outcomes.passed, f"nothing passed on the plain side: see {logs}"
    assert not broken, (
        f"{len(broken)} tests pass on plain Celery but not against stages (logs: {logs}):\n"
        + "\n".join(f"{t}: {why}" for t, why in broken.items())
    )
