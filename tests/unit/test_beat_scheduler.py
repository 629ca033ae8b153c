"""Beat's scheduler is built after beat's stop handler is installed, and that handler
asks for the scheduler again: a stop arriving mid-build must wait for the build (found
by CI: a SIGTERM during the build re-entered a half-done import and beat exited 1)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery import beat as celery_beat
from celery.apps.beat import Beat

from conveyor.upkeep.beat_lock import Scheduler


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class StoppedWhileBuilding(Scheduler):
    builds = 0

    def setup_schedule(self) -> None:
        type(self).builds += 1
        if type(self).builds == 1:
            signal.raise_signal(signal.SIGTERM)
        super().setup_schedule()


def test_a_stop_during_the_schedulers_build_waits_for_it(restored_handlers: None) -> None:
    app = Celery("beat-test", broker="memory://", set_as_current=False)
    service = celery_beat.Service(app, scheduler_cls=StoppedWhileBuilding, max_interval=1)
    Beat(app=app).install_sync_handler(service)
    with pytest.raises(SystemExit) as stopped:
        service.start()
    assert stopped.value.code == 0
    assert StoppedWhileBuilding.builds == 1  # built once: the stop did not re-enter the build


def test_the_handlers_are_back_after_the_build(restored_handlers: None) -> None:
    calls: list[Any] = []
    signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    Scheduler(Celery("beat-test", broker="memory://", set_as_current=False), lazy=True)
    signal.raise_signal(signal.SIGTERM)
    assert len(calls) == 1
