"""The seal racing the last file's completion: whichever commits last completes the batch,
and ``batch.completed`` is written exactly once. Real threads on real Postgres and SQLite."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.orm import Session

from conveyor.store.jobs import new_event
from pipelines.files import Upload, new_batch, seal_batch, upload
from tasks.files import flow
from tasks.files.models import EMBEDDING, READY, UPLOADED
from tests.integration.files_support import batch_row, completed_events

pytestmark = pytest.mark.timeout(300)



def _emit(platform: Any, session: Session) -> flow.Emit:
    return lambda topic, body: platform.store.emit(session.connection(), [new_event(None, topic, dict(body))])


def _finish(platform: Any, file_id: str, pause: float) -> None:
    with Session(platform.engine) as session:
        assert flow.transition(session.connection(), file_id, [EMBEDDING], READY, _emit(platform, session))
        time.sleep(pause)  # hold the batch row a moment: the seal must wait, not miss it
        session.commit()


def _race(platform: Any, trials: int, tag: str) -> None:
    orders: list[str] = []
    for trial in range(trials):
        owner = f"{tag}-{trial}"
        batch_id = new_batch(platform, owner)
        last = Upload("last.txt", b"the last file of the batch")
        file_id = upload(platform, owner, last, batch_id=batch_id)
        with Session(platform.engine) as session:
            flow.transition(session.connection(), file_id, [UPLOADED], EMBEDDING, _emit(platform, session))
            session.commit()
        gate = threading.Barrier(2)
        errors: list[BaseException] = []
        finished_at: dict[str, float] = {}

        def run(
            name: str,
            fn: Callable[[], Any],
            gate: threading.Barrier = gate,
            errors: list[BaseException] = errors,
            finished_at: dict[str, float] = finished_at,
        ) -> None:
            try:
                gate.wait(10)
                time.sleep(random.uniform(0, 0.004))
                fn()
                finished_at[name] = time.monotonic()
            except BaseException as exc:
                errors.append(exc)

        pause = random.choice([0.0, 0.0, 0.01])
        threads = [
            threading.Thread(target=run, args=("seal", lambda b=batch_id: seal_batch(platform, b))),
            threading.Thread(target=run, args=("file", lambda f=file_id, p=pause: _finish(platform, f, p))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        orders.append(min(finished_at, key=finished_at.__getitem__))
        batch = batch_row(platform, batch_id)
        assert batch["status"] == "completed", (trial, dict(batch))
        assert (batch["total"], batch["terminal"], batch["ready"]) == (1, 1, 1)
        assert completed_events(platform, batch_id) == 1, trial
    # Both orders happened: the race was a race.
    assert set(orders) == {"seal", "file"}, orders


def test_seal_racing_the_last_file_completes_once_on_postgres(platform: Any, tag: str) -> None:
    _race(platform, 100, tag)


@pytest.mark.sqlite
def test_seal_racing_the_last_file_completes_once_on_sqlite(on_sqlite: Any, tag: str) -> None:
    _race(on_sqlite, 30, tag)
