"""Pieces of ``bench.trading``: the users' broker rows, ``conveyor serve`` in a subprocess,
and an SSE client of ``GET /events/stream`` that times each ``coach.reflect`` against the
commit of its batch."""

from __future__ import annotations

import datetime as dt
import json
import math
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import select

from bench.common import BenchError, log
from tasks.trading import tables as t

if TYPE_CHECKING:
    from redis import Redis

    from conveyor.platform import Platform

HEALTH_TIMEOUT = 30.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (as the other benches)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def spread_rows(rows: list[dict[str, Any]], start: dt.datetime, end: dt.datetime) -> list[dict[str, Any]]:
    """Coinbase-shaped ``rows`` with their times set evenly over ``[start, end)`` (oldest
    first): a window the bench chooses (a week for a digest, the score's 30 days)."""
    step = (end - start) / max(1, len(rows))
    spread = []
    for i, row in enumerate(rows):
        at = (start + step * i).astimezone(dt.UTC)
        stamp = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        spread.append({**row, "created_at": stamp})
    return spread


def delete_keys(redis: Redis, pattern: str) -> None:
    """Every key matching ``pattern`` (the bench's own Redis DB)."""
    keys = list(redis.scan_iter(match=pattern, count=1000))
    if keys:
        redis.delete(*keys)


@contextmanager
def serving(platform: Platform, logs: Path) -> Iterator[str]:
    """``conveyor serve`` on a free loopback port, on the bench's services: its base URL.
    SIGTERM at the end (which also ends its open streams)."""
    from conveyor.client import registry
    from conveyor.delivery.procs import service_env
    from pipelines.email.peers import free_port

    registry.write(platform.engine, platform.stages.values())
    port = free_port()
    logs.mkdir(exist_ok=True)
    with open(logs / "serve.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=service_env(platform.settings),
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise BenchError(f"conveyor serve exited with {proc.returncode}; see {logs / 'serve.log'}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"conveyor serve not healthy within {HEALTH_TIMEOUT:g}s")
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@dataclass
class Received:
    """One ``coach.reflect`` as the SSE client got it."""

    job_id: str
    ordinal: int  # 1-based, within its score job, in stream order
    received: float  # wall clock (time.time()) when its data line was read
    created: float  # the event row's created_at (the DB clock at its insert)


@dataclass
class ReflectClock:
    """An SSE client of ``GET /events/stream`` (a thread) and a resolver (another) that puts
    a commit time beside each ``coach.reflect``: the score cursor's ``updated_at``, written
    last in the batch's transaction, read as soon as the batch's events arrive (before the
    job's next batch commits: seconds later); when that row has already moved on, the latest
    ``created_at`` among the batch's events (a little earlier than the commit)."""

    platform: Platform
    base: str
    token: str
    batch: int
    received: list[Received] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    from_cursor: int = 0
    from_events: int = 0
    _queue: queue.Queue[Received | None] = field(default_factory=queue.Queue)
    _counts: dict[str, int] = field(default_factory=dict)
    _commits: dict[tuple[str, int], float] = field(default_factory=dict)
    _connected: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    error: str | None = None

    def start(self) -> None:
        """Open the stream (from now on: ``since`` the newest event) and wait until it answers."""
        cursor: str | None = None
        with httpx.Client(base_url=self.base, headers=self._auth(), timeout=10) as client:
            while True:
                params: dict[str, str | int] = {"limit": 1000, **({"since": cursor} if cursor else {})}
                page = client.get("/events", params=params).raise_for_status().json()
                cursor = page["cursor"]
                if not page["events"]:
                    break
        reader = threading.Thread(target=self._read, args=(cursor,), name="sse-reader", daemon=True)
        resolver = threading.Thread(target=self._resolve, name="reflect-resolver", daemon=True)
        self._threads = [reader, resolver]
        for thread in self._threads:
            thread.start()
        if not self._connected.wait(15):
            raise BenchError(f"the event stream did not open: {self.error}")

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _read(self, cursor: str | None) -> None:
        try:
            timeout = httpx.Timeout(10, read=None)
            with (
                httpx.Client(base_url=self.base, headers=self._auth(), timeout=timeout) as client,
                client.stream(
                    "GET", "/events/stream", params={"since": cursor} if cursor else {}
                ) as response,
            ):
                response.raise_for_status()
                self._connected.set()
                topic = ""
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        topic = line[7:]
                    elif line.startswith("data: ") and topic == "coach.reflect":
                        now = time.time()
                        event = json.loads(line[6:])
                        job = str(event["job_id"])
                        self._counts[job] = ordinal = self._counts.get(job, 0) + 1
                        created = dt.datetime.fromisoformat(event["created_at"])
                        created = created if created.tzinfo else created.replace(tzinfo=dt.UTC)
                        self._queue.put(Received(job, ordinal, now, created.timestamp()))
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._connected.set()
            self._queue.put(None)

    def _resolve(self) -> None:
        while (got := self._queue.get()) is not None:
            self.received.append(got)
            block = (got.ordinal - 1) // self.batch
            if (got.job_id, block) not in self._commits:
                self._read_cursor(got.job_id, block)

    def _read_cursor(self, job_id: str, block: int) -> None:
        query = select(t.scores.c.reflected, t.scores.c.updated_at).where(t.scores.c.job_id == job_id)
        with self.platform.engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None:
            return
        reflected, updated = int(row[0]), row[1]
        # The row is this block's batch only if its count ends inside the block.
        if block * self.batch < reflected <= (block + 1) * self.batch:
            stamp = updated if updated.tzinfo else updated.replace(tzinfo=dt.UTC)
            self._commits[(job_id, block)] = stamp.timestamp()

    def wait_for(self, expected: int, timeout: float) -> None:
        """Until ``expected`` events arrived, the stream failed, or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while sum(self._counts.values()) < expected and time.monotonic() < deadline:
            if self.error is not None:
                break
            time.sleep(0.1)

    def finish(self) -> None:
        """After the server ended the stream: each event's latency (ms, receive - commit)."""
        for thread in self._threads:
            thread.join(timeout=15)
        last_created: dict[tuple[str, int], float] = {}
        for got in self.received:
            key = (got.job_id, (got.ordinal - 1) // self.batch)
            last_created[key] = max(got.created, last_created.get(key, 0.0))
        for got in self.received:
            key = (got.job_id, (got.ordinal - 1) // self.batch)
            commit = self._commits.get(key)
            if commit is None:
                self.from_events += 1
                commit = last_created[key]
            else:
                self.from_cursor += 1
            self.latencies_ms.append((got.received - commit) * 1000)
        if self.from_events:
            log(f"  reflect: {self.from_events} events timed from their batch's last created_at")

    @property
    def count(self) -> int:
        """``coach.reflect`` events received."""
        return sum(self._counts.values())


__all__ = ["Received", "ReflectClock", "delete_keys", "percentile", "serving", "spread_rows"]
