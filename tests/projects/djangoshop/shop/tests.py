"""Django's own test runner (``manage.py test shop``): the test database gets Conveyor's
tables with Django's (post_migrate), submits land there, and nothing is left holding a
connection when Django drops it."""

from django.db import transaction
from django.test import TransactionTestCase

from conveyor.contrib import django as conveyor
from shop.models import Order


class SubmitUnderDjangosRunner(TransactionTestCase):
    def test_a_job_commits_into_the_test_database(self) -> None:
        with transaction.atomic():
            Order.objects.create(number="runner-1")
            job = conveyor.submit("shop.orders.ship", {"number": "runner-1"})
        assert job.status() == "queued"
        assert conveyor.client().settings.database_url.endswith("/test_" + self.real_name())

    def test_a_rollback_leaves_no_job(self) -> None:
        try:
            with transaction.atomic():
                job = conveyor.submit("shop.orders.ship", {"number": "runner-2"})
                raise RuntimeError("declined")
        except RuntimeError:
            pass
        with self.assertRaises(LookupError):
            job.row()

    def real_name(self) -> str:
        from django.conf import settings

        return str(settings.DATABASES["default"]["NAME"]).removeprefix("test_")
