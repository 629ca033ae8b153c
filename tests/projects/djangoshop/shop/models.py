from django.db import models


class Order(models.Model):
    """An order: shipped by the shop's own stage, squared by the deployment it calls."""

    number = models.CharField(max_length=50, unique=True)
    shipped = models.BooleanField(default=False)
    job_id = models.CharField(max_length=36, blank=True)
