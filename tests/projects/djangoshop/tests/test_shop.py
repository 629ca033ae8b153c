"""The shop calls Conveyor as a Django developer would: inside and outside atomic(), with
a rollback, with a savepoint rolled back; and runs its own stage on its own worker."""

import uuid

import pytest
from django.db import transaction
from shop.models import Order

from conveyor.contrib import django as conveyor

pytestmark = pytest.mark.django_db(transaction=True)


def number() -> str:
    return f"o-{uuid.uuid4().hex[:10]}"


def test_a_job_submitted_in_atomic_commits_with_the_order(deployment_worker: object) -> None:
    with transaction.atomic():
        order = Order.objects.create(number=number())
        job = conveyor.submit("conveyor.demo.square", {"n": 7})
        order.job_id = job.id
        order.save()
    assert job.wait(30) == "succeeded" and job.result == {"n": 49}
    assert Order.objects.get(pk=order.pk).job_id == job.id


def test_a_job_committed_but_never_published_is_published_by_the_relay(deployment_worker: object) -> None:
    """An app hook registered first raises, so Django runs no later hook (Conveyor's
    publish among them): the job is recorded, and the workers' relay publishes it at its
    next pass, not ``CONVEYOR_REPUBLISH_AFTER`` (300 s) later."""

    def crash() -> None:
        raise ZeroDivisionError("the app's own on_commit hook failed")

    with pytest.raises(ZeroDivisionError), transaction.atomic():
        transaction.on_commit(crash)
        job = conveyor.submit("conveyor.demo.square", {"n": 6})
    assert job.row()["status"] in ("queued", "running", "succeeded")  # committed
    assert job.wait(15) == "succeeded" and job.result == {"n": 36}


def test_outside_atomic_it_commits_at_once(deployment_worker: object) -> None:
    job = conveyor.submit("conveyor.demo.square", {"n": 3}, idempotency_key=number())
    assert job.wait(30) == "succeeded" and job.result == {"n": 9}


def test_a_rollback_leaves_no_order_and_no_job(deployment_worker: object) -> None:
    ref = number()
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.create(number=ref)
        job = conveyor.submit("conveyor.demo.square", {"n": 5})
        raise RuntimeError("payment declined")
    assert not Order.objects.filter(number=ref).exists()
    with pytest.raises(LookupError):
        job.row()


def test_a_savepoint_rolled_back_drops_only_its_job(deployment_worker: object) -> None:
    with transaction.atomic():
        kept_order = Order.objects.create(number=number())
        kept = conveyor.submit("conveyor.demo.square", {"n": 2})
        try:
            with transaction.atomic():
                Order.objects.create(number=number())
                dropped = conveyor.submit("conveyor.demo.square", {"n": 4})
                raise ValueError("this line item is out of stock")
        except ValueError:
            pass
    assert kept.wait(30) == "succeeded"
    assert Order.objects.filter(pk=kept_order.pk).exists() and Order.objects.count() == 1
    with pytest.raises(LookupError):
        dropped.row()


def test_an_order_created_earlier_in_the_block_survives_the_submit(deployment_worker: object) -> None:
    """SQLAlchemy's first connect rolls back: it must never happen on Django's connection."""
    with transaction.atomic():
        first = Order.objects.create(number=number())
        conveyor.submit("conveyor.demo.square", {"n": 1})
        second = Order.objects.create(number=number())
    assert set(Order.objects.values_list("pk", flat=True)) == {first.pk, second.pk}


def test_the_shops_own_stage_runs_on_its_own_worker(conveyor_worker: object) -> None:
    order = Order.objects.create(number=number())
    with transaction.atomic():
        job = conveyor.submit("shop.orders.ship", {"number": order.number})
    assert job.wait(30) == "succeeded"
    order.refresh_from_db()
    assert order.shipped


def test_tests_use_the_test_database_and_the_test_redis(conveyor_database: str) -> None:
    from django.conf import settings
    from django.db import connection

    used = conveyor.client().settings
    assert connection.settings_dict["NAME"].startswith("test_") and used.database_url == conveyor_database
    assert connection.settings_dict["NAME"] in conveyor_database
    assert used.redis_url == settings.CONVEYOR["TEST"]["REDIS_URL"]


def test_without_a_test_redis_conveyor_refuses_to_start() -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from conveyor.contrib.django import conf

    only_dev = override_settings(CONVEYOR={"REDIS_URL": "redis://127.0.0.1:6379/0"})
    with only_dev, pytest.raises(ImproperlyConfigured, match=r"CONVEYOR\['TEST'\]\['REDIS_URL'\]"):
        conf.conveyor_settings()
