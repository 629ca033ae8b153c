"""Two hosts sharing a hostname (pods with host networking) and a Celery node name, each
with its worker as pid 1: neither takes over the other's live jobs, a dead one's jobs are
taken over only once their lease is stale, and a pid check is never trusted across hosts.
"""

from __future__ import annotations

import datetime as dt
import socket
import subprocess
import time
from typing import Any

import pytest
from sqlalchemy import update

from conveyor.runfile import local_node
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import ClaimOutcome, NewJob
from tests.conftest import ON_AMQP
from tests.helpers import effect_count, eventually, job_row
from tests.hosts.host import LEASE, TIMERS, Hosts, needs_unshare
from tests.hosts.jobs import held, release, send_copies, skipped, started, takeovers

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault, needs_unshare]


# On RabbitMQ Celery gives a node name one exclusive control queue: two workers of one name
# cannot both run there. So there the workers name themselves (`conveyor worker` on amqp:
# worker-<pid>-<random>@host), and the names still differ with both workers pid 1.
NODE = "" if ON_AMQP else "worker@%h"


def _liveness_ids(platform: Any) -> list[str]:
    keys = platform.redis.hkeys(f"{platform.settings.key_prefix}workers")
    return sorted(k.decode() for k in keys if k.decode().partition(":")[0].endswith("@twin"))


def test_hosts_of_one_name_never_take_over_each_others_live_jobs(
    platform: Any, hosts: Hosts, tag: str
) -> None:
    first = hosts.start("twin", concurrency=2, env=TIMERS, nodename=NODE)
    a_jobs = [held(platform, tag, f"{tag}-a{i}").id for i in range(2)]
    started(platform, tag, 2)
    second = hosts.start("twin", concurrency=4, env=TIMERS, nodename=NODE)
    b_jobs = [held(platform, tag, f"{tag}-b{i}").id for i in range(2)]
    started(platform, tag, 4)
    every = a_jobs + b_jobs
    assert all(first.owns(job_row(platform, j)["lease_owner"]) for j in a_jobs)
    assert all(second.owns(job_row(platform, j)["lease_owner"]) for j in b_jobs)
    # The premise: the same hostname and Celery node name, the worker being pid 1 in each.
    ids = _liveness_ids(platform)
    assert len(ids) == 2 and all(i.endswith(":1") for i in ids), ids
    names = {i.partition(":")[0] for i in ids}
    assert len(names) == (2 if ON_AMQP else 1), names

    # Copies of every job reach the hosts' free slots while every owner is alive.
    send_copies(platform, every)
    eventually(lambda: all(n >= 1 for n in skipped(platform, every).values()), timeout=30)
    assert [job_row(platform, j)["attempts"] for j in every] == [1, 1, 1, 1]

    first.kill()
    rows = {j: job_row(platform, j) for j in a_jobs}
    assert all(r["status"] == s.RUNNING and r["attempts"] == 1 for r in rows.values())
    # Copies reach the survivor at once: the dead host's pids mean nothing there.
    send_copies(platform, a_jobs)
    eventually(lambda: all(n >= 2 for n in skipped(platform, a_jobs).values()), timeout=LEASE)
    eventually(lambda: all(job_row(platform, j)["attempts"] == 2 for j in a_jobs), timeout=60)
    for job_id, row in rows.items():
        taken = takeovers(platform, job_id)
        assert len(taken) == 1, taken
        assert taken[0] - row["heartbeat_at"] >= dt.timedelta(seconds=LEASE), (taken, row["heartbeat_at"])
        assert second.owns(job_row(platform, job_id)["lease_owner"])
    # The dead host's liveness key expired under its own id: its death was seen.
    survivor = [i for i in ids if f"/{second.pid_namespace()}:" in i]
    assert len(survivor) == 1
    eventually(lambda: _liveness_ids(platform) == survivor, timeout=30)
    assert [job_row(platform, j)["attempts"] for j in b_jobs] == [1, 1]

    release(platform, tag)
    for job_id in every:
        eventually(lambda job_id=job_id: job_row(platform, job_id)["status"] == s.SUCCEEDED, timeout=60)
    assert [job_row(platform, j)["attempts"] for j in every] == [2, 2, 1, 1]
    assert all(effect_count(platform, job_id=j) == 1 for j in every)
    assert not takeovers(platform, b_jobs[0]) and not takeovers(platform, b_jobs[1])


def _foreign_owners(dead_pid: int) -> dict[str, str]:
    """Owners that name this host but are another machine's processes (same hostname,
    same root PID namespace inode, a pid that does not exist here)."""
    host, boot, namespace = local_node().split("/")
    other_boot = f"{int(boot, 16) ^ 0xFF:016x}"
    return {
        "other boot": f"{host}/{other_boot}/{namespace}:{dead_pid}",
        "old format": f"{socket.gethostname()}/{namespace}:{dead_pid}",
        "unparseable": f"{local_node()}:pid{dead_pid}",
    }


def test_a_same_named_foreign_owner_keeps_its_lease_until_it_is_stale(
    platform: Any, spawn: Any, tag: str
) -> None:
    spawn(concurrency=2, env=TIMERS)
    gone = subprocess.Popen(["true"])
    gone.wait()
    owners = _foreign_owners(gone.pid)
    store = platform.store
    job_ids: dict[str, str] = {}
    with platform.engine.begin() as conn:
        for kind, owner in owners.items():
            job_id, _ = store.insert(
                conn,
                NewJob(
                    stage="conveyor.demo.effect",
                    queue="demo",
                    payload={"note": f"{tag}-{kind}"},
                    max_attempts=4,
                ),
            )
            assert store.claim(conn, job_id, owner=owner, task_id=f"{tag}-first").outcome is ClaimOutcome.RUN
            job_ids[kind] = job_id
    with platform.engine.begin() as conn:
        conn.execute(update(jobs).where(jobs.c.id.in_(list(job_ids.values()))).values(heartbeat_at=db_now()))
    beat = {k: job_row(platform, j)["heartbeat_at"] for k, j in job_ids.items()}
    sent = time.monotonic()
    send_copies(platform, list(job_ids.values()))
    # The copies are refused while the leases are live (a real worker claimed them) ...
    eventually(lambda: all(n >= 1 for n in skipped(platform, list(job_ids.values())).values()), timeout=LEASE)
    assert time.monotonic() - sent < LEASE
    # ... and the jobs are taken over only after their leases went stale.
    for kind, job_id in job_ids.items():
        eventually(lambda job_id=job_id: job_row(platform, job_id)["status"] == s.SUCCEEDED, timeout=60)
        taken = takeovers(platform, job_id)
        assert len(taken) == 1 and taken[0] - beat[kind] >= dt.timedelta(seconds=LEASE), (kind, taken)
        assert job_row(platform, job_id)["attempts"] == 2
        assert effect_count(platform, job_id=job_id) == 1
