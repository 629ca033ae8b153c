"""How jobs reach workers: the broker (Redis or RabbitMQ through kombu), this process's
connections, the Celery configuration, the embedded services and starting them."""
