"""Integrations with the frameworks Conveyor is called from (Django, Flask, Celery)."""
