"""The chaos run's client: ``python -m tests.chaos.submitter PLAN.json``.

A separate process, bound (through ``CONVEYOR_REDIS_URL``) to the private Redis the run
restarts. It submits the plan's items (single ``effect`` jobs and two-link chains, with
the job ids fixed by the plan) at a pace that ends them by the plan's deadline, never
with more than ``cap`` of its jobs waiting to be claimed. A submit that raises (Redis is down) is
retried with the same ids: the insert is idempotent by id. It prints ``OK <index>`` for
every accepted item and ``DONE`` at the end. ``deadline <monotonic>`` on stdin moves the
deadline (``time.monotonic`` is system-wide on Linux).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(plan_path: str) -> int:
    from celery import chain
    from sqlalchemy import text

    import tasks.demo as demo
    from config.celery_app import platform

    plan = json.loads(Path(plan_path).read_text())
    items: list[dict[str, Any]] = plan["items"]
    cap = int(plan["cap"])
    deadline = [float(plan["deadline"])]

    def read_stdin() -> None:
        for line in sys.stdin:
            word, _, value = line.strip().partition(" ")
            if word == "deadline":
                deadline[0] = float(value)

    threading.Thread(target=read_stdin, daemon=True).start()

    submitted: list[str] = []

    def waiting() -> int:
        with platform.engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM jobs WHERE id = ANY(:ids) "
                        "AND status IN ('queued', 'retrying', 'throttled')"
                    ),
                    {"ids": submitted},
                ).scalar_one()
            )

    def submit(item: dict[str, Any]) -> None:
        ids, notes, sleeps = item["ids"], item["notes"], item["sleeps"]
        if item["kind"] == "single":
            demo.effect.s(note=notes[0], sleep=sleeps[0]).apply_async(task_id=ids[0])
        else:
            chain(
                demo.effect.s(note=notes[0], sleep=sleeps[0]).set(task_id=ids[0]),
                demo.effect.si(note=notes[1], sleep=sleeps[1]).set(task_id=ids[1]),
            ).apply_async()

    last = time.monotonic()
    for index, item in enumerate(items):
        left = len(items) - index
        due = last + max(0.0, deadline[0] - last) / left
        while time.monotonic() < due:
            time.sleep(min(0.05, max(0.0, due - time.monotonic())))
        while True:
            try:
                if waiting() < cap:
                    break
            except Exception as exc:  # Postgres is not what the run breaks; say so and go on
                print(f"backlog query failed: {exc!r}", file=sys.stderr, flush=True)
                break
            time.sleep(0.05)
        failures = 0
        while True:
            try:
                submit(item)
                break
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    print(
                        f"submit of item {index} failed ({failures}x): {exc!r}", file=sys.stderr, flush=True
                    )
                time.sleep(0.1)
        submitted.extend(item["ids"])  # a chain's second link counts once its row exists
        last = time.monotonic()
        print(f"OK {index}", flush=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
