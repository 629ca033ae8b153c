"""Celery's ``t/integration/conftest.py`` for an external worker (installed under that
name by :mod:`tests.upstream.canvas_suite`): the names ``test_canvas.py`` imports from it,
the ``app`` and ``manager`` fixtures on the side's app (no in-process worker: the suite
starts one of its own), and on the ``stages`` side an ``xfail`` on each test that shows one
of the README's "Differences from Celery"."""

from __future__ import annotations

import inspect
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.manager import Manager
from t.integration import sides
from t.integration.tasks import get_redis_connection

logger = logging.getLogger(__name__)

TEST_BACKEND = str(sides.app.conf.result_backend)


def flaky(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Upstream reruns these on connection errors; here a failure is a failure."""
    return pytest.mark.timeout(300)(fn)


def get_active_redis_channels() -> Any:
    """The pub/sub channels open on the tasks' Redis."""
    return get_redis_connection().execute_command("PUBSUB CHANNELS")


def check_for_logs(caplog: Any, message: str, max_wait: float = 1.0, interval: float = 0.1) -> bool:
    """Whether a record matching ``message`` was logged within ``max_wait`` (upstream's)."""
    start_time = time.monotonic()
    while time.monotonic() - start_time < max_wait:
        if any(re.search(message, record.message) for record in caplog.records):
            return True
        time.sleep(interval)
    return False


@pytest.fixture(scope="session")
def celery_session_app() -> Celery:
    """The side's app (the external worker runs the same one)."""
    return sides.app  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def celery_session_worker() -> None:
    """The worker is external: started by the suite before pytest runs."""
    return None


@pytest.fixture
def celery_worker() -> None:
    """As upstream: no per-test workers."""
    pytest.fail("the integration suite runs against one external worker")


@pytest.fixture
def app() -> Iterator[Celery]:
    """The side's app, current and default (upstream's ``ZZZZ_set_app_current``)."""
    sides.app.set_current()
    sides.app.set_default()
    yield sides.app


@pytest.fixture
def celery_app(app: Celery) -> Celery:
    """Upstream's name for the same app."""
    return app


@pytest.fixture
def manager(app: Celery) -> Iterator[Manager]:
    """Celery's test manager on the side's app."""
    made = Manager(app)
    yield made
    try:
        made.wait_until_idle()
    except Exception as exc:  # as upstream: a test's leftovers do not fail the next one
        logger.warning("Failed to stop Celery test manager cleanly: %s", exc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the stages side, each test that shows a listed difference is expected to fail.

    Such a test often waits for a result that never comes (the refused replacement's): it
    runs bounded, or, in the CI subset, is listed without being run (and skipped on the
    plain side too, which has nothing to compare it with then)."""
    if sides.SIDE != "stages" and sides.RUN_DIFFERENCES:
        return
    from tests.upstream.differences import difference_of, tasks_calling

    tasks = tasks_calling(Path(__file__).with_name("celery_tasks.py").read_text())
    for item in items:
        function = getattr(item, "function", None)
        source = inspect.getsource(function) if function is not None else ""
        reason = difference_of(item.nodeid.split("::", 1)[-1], source, tasks)
        if reason is None:
            continue
        if sides.SIDE != "stages":
            item.add_marker(pytest.mark.skip(reason=f"not compared in this run: {reason}"))
            continue
        # Before upstream's own xfail marks (the first that applies decides).
        expected = pytest.mark.xfail(reason=reason, strict=False, run=sides.RUN_DIFFERENCES)
        item.add_marker(expected, append=False)
        item.add_marker(pytest.mark.timeout(15))
