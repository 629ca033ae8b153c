"""The trading family, the caller's side (the stages are ``tasks/trading/``).

- :mod:`pipelines.trading.jobs`: connect a broker, submit imports and scores, a user's standing;
- :mod:`pipelines.trading.cli`: ``conveyor trading …`` (``CLI_EXTENSIONS`` in ``config``);
- :mod:`pipelines.trading.http`: ``/trading/…`` (``HTTP_EXTENSIONS``);
- :mod:`pipelines.trading.peers`: the broker, AI coach and market-data peers for tests,
  ``conveyor demo`` and the bench; :mod:`pipelines.trading.demo`: the demo's step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.trading.jobs import check_user, connect_broker, submit_import, submit_score, user_status

__all__ = ["check_user", "connect_broker", "submit_import", "submit_score", "user_status"]


def __getattr__(name: str) -> Any:
    # `conveyor --help` imports pipelines.trading.cli, hence this package: the jobs module
    # (and the platform it needs) loads on first use only.
    if name in __all__:
        from pipelines.trading import jobs

        return getattr(jobs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
