"""The throughput bench's measuring helpers and its frozen baseline, without services."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import CpuMeter, process_tree
from bench.frozen_config import frozen_celery_config
from config.queues import QUEUES
from conveyor.settings import ConveyorSettings

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def burner(seconds: float) -> subprocess.Popen[bytes]:
    """A child that uses ``seconds`` of CPU, then exits."""
    return subprocess.Popen([sys.executable, "-c", BURN.format(seconds=seconds)])


def test_process_tree_has_children_and_grandchildren() -> None:
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid
        assert len(tree) == 2
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(timeout=10)


def test_cpu_meter_counts_a_process_born_and_gone_in_the_window() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    meter = CpuMeter({"burners": lambda: [p.pid for p in procs]}, interval=0.05)
    meter.start()
    procs.append(burner(0.4))
    procs[0].wait(timeout=30)
    used = meter.stop()["burners"]
    # Born after the window opened (counted from zero), gone before it closed (its last
    # sample counts): most of its 0.4 s, never more than it can have used.
    assert 0.2 <= used <= 0.6, used


def test_the_same_config_baseline_keeps_its_costly_choices() -> None:
    """Frozen on purpose (issue #16): Conveyor may drop these, the baseline may not."""
    settings = ConveyorSettings(redis_url="redis://127.0.0.1:6379/13", database_url="postgresql://x/y")
    conf = frozen_celery_config(settings, queues=QUEUES)
    assert conf["result_backend"] == "redis://127.0.0.1:6379/13"
    assert conf["task_send_sent_event"] is True
    assert conf["worker_send_task_events"] is True
    assert conf["task_acks_late"] is True
    assert conf["worker_disable_prefetch"] is True
    assert conf["worker_prefetch_multiplier"] == 1
