"""The shop's own stage, declared as Celery's shared_task would be: found by autodiscovery."""

from pydantic import BaseModel

from conveyor.shared import stage
from shop.models import Order


class Ship(BaseModel):
    number: str


@stage("shop.orders.ship", queue="shop", payload=Ship)
def ship(ctx: object, p: Ship) -> dict[str, str]:
    Order.objects.filter(number=p.number).update(shipped=True)
    return {"shipped": p.number}
