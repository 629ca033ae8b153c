"""Settings and the Celery configuration, without any broker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config.queues import QUEUES
from conveyor.delivery.celeryconfig import celery_config
from conveyor.settings import ConveyorSettings, StageOverride


@pytest.fixture(autouse=True)
def _no_broker_from_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test names its broker (a RabbitMQ session sets CONVEYOR_BROKER_URL)."""
    monkeypatch.delenv("CONVEYOR_BROKER_URL", raising=False)


def test_refuses_hard_limit_not_below_visibility_timeout() -> None:
    with pytest.raises(ValidationError, match="below the visibility"):
        ConveyorSettings(visibility_timeout=60, default_time_limit=60)
    with pytest.raises(ValidationError, match=r"conveyor\.files\.extract"):
        ConveyorSettings(
            visibility_timeout=60,
            default_time_limit=30,
            stages={"conveyor.files.extract": StageOverride(time_limit=90)},
        )


def test_reads_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_LEASE_TIMEOUT", "7")
    monkeypatch.setenv("CONVEYOR_STAGES", '{"conveyor.demo.noop": {"max_attempts": 9}}')
    s = ConveyorSettings()
    assert s.lease_timeout == 7
    assert s.stage_override("conveyor.demo.noop").max_attempts == 9


def test_celery_config_is_pure_and_safe() -> None:
    settings = ConveyorSettings(
        redis_url="redis://h:1/2", visibility_timeout=100, default_time_limit=50, default_soft_time_limit=40
    )
    conf = celery_config(settings, queues=QUEUES)
    assert conf == celery_config(settings, queues=QUEUES)
    assert conf["accept_content"] == ["json"] and conf["result_accept_content"] == ["json"]
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1 and conf["worker_disable_prefetch"]
    assert conf["broker_transport_options"]["visibility_timeout"] == 100
    assert conf["result_backend_transport_options"]["visibility_timeout"] == 100
    # Task events cost ~0.5 ms per job: off unless asked for (Flower enables them itself).
    assert not conf["worker_send_task_events"] and not conf["task_send_sent_event"]
    events = celery_config(settings.model_copy(update={"task_events": True}), queues=QUEUES)
    assert events["worker_send_task_events"] and events["task_send_sent_event"]
    # redis:// goes through conveyor.delivery.transport; other schemes keep kombu's own.
    assert conf["broker_transport"] == "conveyor.delivery.transport:Transport"
    tls = celery_config(settings.model_copy(update={"redis_url": "rediss://h:1/2"}), queues=QUEUES)
    assert "broker_transport" not in tls
    assert conf["worker_state_db"] is None and "Persistent" not in conf["beat_scheduler"]
    assert conf["task_create_missing_queues"] is False


def test_stage_declaration_refuses_long_limit() -> None:
    from celery import Celery

    from conveyor.errors import ConfigurationError
    from conveyor.platform import Platform

    settings = ConveyorSettings(visibility_timeout=100, default_time_limit=50, default_soft_time_limit=40)
    platform = Platform(Celery("t"), settings, queues=QUEUES)
    from pydantic import BaseModel

    class P(BaseModel):
        x: int

    with pytest.raises(ConfigurationError, match="visibility timeout"):
        platform.stage("conveyor.t.slow", payload=P, time_limit=100)(lambda ctx, p: None)
    with pytest.raises(ConfigurationError, match="not declared"):
        platform.stage("conveyor.t.lost", payload=P, queue="nowhere")(lambda ctx, p: None)
    with pytest.raises(ConfigurationError, match=r"conveyor\.<family>\.<verb>"):
        platform.stage("Bad Name", payload=P)(lambda ctx, p: None)


def test_the_default_queue_is_the_one_a_plain_celery_app_sends_to() -> None:
    from celery import Celery

    from conveyor.delivery.celeryconfig import celery_default_queue

    app = Celery("plain", set_as_current=False)
    plain = app.amqp.queues[app.conf.task_default_queue]
    ours = celery_default_queue()
    assert (ours.name, ours.exchange.name, ours.routing_key) == (
        plain.name,
        plain.exchange.name,
        plain.routing_key,
    )
    assert ConveyorSettings().consume_default_queue is False  # opt-in


def test_on_rabbitmq_every_time_limit_stays_below_the_consumer_timeout() -> None:
    """RabbitMQ closes a channel holding a delivery unacked past its consumer_timeout (the
    message goes back to its queue while the job still runs): limits must stay below it."""
    from celery import Celery
    from pydantic import BaseModel, ValidationError

    from conveyor.errors import ConfigurationError
    from conveyor.platform import Platform

    amqp = "amqp://u:p@rabbit:5672/conveyor"
    with pytest.raises(ValidationError, match="broker consumer timeout"):
        ConveyorSettings(broker_url=amqp, broker_consumer_timeout=60, default_time_limit=60)
    # The visibility timeout is Redis's: it does not bound a RabbitMQ deployment's limits.
    ConveyorSettings(
        broker_url=amqp, visibility_timeout=10, default_time_limit=300, default_soft_time_limit=270
    )
    settings = ConveyorSettings(broker_url=amqp, broker_consumer_timeout=100, default_time_limit=50)
    platform = Platform(Celery("t"), settings, queues=QUEUES)

    class P(BaseModel):
        x: int

    with pytest.raises(ConfigurationError, match=r"broker consumer timeout 100\.0s"):
        platform.stage("conveyor.t.slow", payload=P, time_limit=100)(lambda ctx, p: None)


def test_rabbitmq_config_confirms_publishes_and_keeps_results_in_redis() -> None:
    from conveyor.delivery.celeryconfig import celery_config

    settings = ConveyorSettings(broker_url="amqp://u:p@rabbit:5672/v", redis_url="redis://r:6379/0")
    config = celery_config(settings, queues=QUEUES)
    assert config["broker_url"] == "amqp://u:p@rabbit:5672/v"
    assert config["result_backend"] == "redis://r:6379/0"
    assert config["broker_transport_options"] == {"confirm_publish": True}
    assert "broker_transport" not in config  # kombu's own AMQP transport
    redis_only = celery_config(ConveyorSettings(redis_url="redis://r:6379/0"), queues=QUEUES)
    assert redis_only["broker_url"] == redis_only["result_backend"] == "redis://r:6379/0"
