"""How this deployment is wired: settings, queues and routes, the one Celery app."""
