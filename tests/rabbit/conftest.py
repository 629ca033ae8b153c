"""The RabbitMQ tier (CONVEYOR_TEST_BROKER=amqp): real prefork workers, as the fault tier."""

from tests.fault.conftest import spawn

__all__ = ["spawn"]
