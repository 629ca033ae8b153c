"""Count SQLAlchemy session listeners around N test-client requests that each submit a job
in the request's transaction (every other one rolled back); print the counts as JSON.

Run from this directory: ``python listeners.py 1000``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from shop import create_app, db
from sqlalchemy.orm import Session

import config

EVENTS = ("after_commit", "after_soft_rollback", "after_rollback", "after_transaction_end", "after_begin")


def listeners(app: Any) -> dict[str, int]:
    """Listeners a new request's session would run, per event: those on its own class
    (Flask-SQLAlchemy's, through the sessionmaker's subclass) and on Session, and the
    instance's own; plus those on a plain Session."""
    with app.app_context():
        session = db.session()
        counts = {f"request.{e}": len(getattr(session.dispatch, e)) for e in EVENTS}
        plain = Session()
        counts.update({f"plain.{e}": len(getattr(plain.dispatch, e)) for e in EVENTS})
        plain.close()
        db.session.remove()
    return counts


def main(requests: int) -> None:
    app = create_app()
    client = app.test_client()
    before = listeners(app)
    statuses: dict[int, int] = {}

    def order(i: int) -> None:
        # Delayed a day: nothing reaches a worker, the submit path is otherwise the same.
        response = client.post("/orders", json={"n": i, "delay": 86400, "fail": i % 2 == 1})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    order(0)
    first = listeners(app)
    for i in range(1, requests):
        order(i)
    last = listeners(app)
    print(
        json.dumps(
            {
                "config": config.SHOP_CONFIG,
                "before": before,
                "first": first,
                "last": last,
                "statuses": statuses,
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
