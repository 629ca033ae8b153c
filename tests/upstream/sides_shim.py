"""The two sides Celery's canvas tests run against (``CONVEYOR_CANVAS_SIDE``).

``plain``: a plain Celery app on this session's Redis (broker and backend), its worker
``celery -A t.integration.sides worker``. ``stages``: the deployment's app and platform
(``config.celery_app``) with Celery's tasks declared as stages, its worker
``conveyor worker`` with ``CONVEYOR_APP=t.integration.sides``. Installed as
``t/integration/sides.py`` by :mod:`tests.upstream.canvas_suite`.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

SIDE = os.environ["CONVEYOR_CANVAS_SIDE"]
TASKS_REDIS_URL = os.environ["CONVEYOR_CANVAS_REDIS_URL"]
QUEUE = "default"
# Whether the tests that show a listed difference run (as xfail) or are only listed.
RUN_DIFFERENCES = os.environ.get("CONVEYOR_CANVAS_RUN_DIFFERENCES", "1") == "1"

platform: Any = None
if SIDE == "stages":
    from config.celery_app import app, platform  # noqa: F401  # CONVEYOR_APP reads both names
else:
    app = Celery("t.integration", broker=TASKS_REDIS_URL, backend=TASKS_REDIS_URL, set_as_current=False)
    app.conf.update(result_extended=True, task_create_missing_queues=False, worker_hijack_root_logger=False)

import t.integration.tasks  # noqa: E402, F401  # declares the tasks on the side's app
