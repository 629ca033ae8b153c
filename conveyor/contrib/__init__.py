"""Integrations with the frameworks and libraries Conveyor is called from (Django, Flask, a
caller's own Celery app): each module imports its framework, and nothing else does."""
