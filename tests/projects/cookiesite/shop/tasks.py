"""The site's own Celery task, found by autodiscovery: Conveyor's router leaves it alone."""

from celery import shared_task


@shared_task
def total(n: int) -> int:
    return n
