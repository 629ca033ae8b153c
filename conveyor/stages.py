"""The stages declared on one Celery app, by name, and the policy each declaration resolves."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any, Protocol

from celery import Celery, Task
from pydantic import BaseModel

from conveyor.errors import ConfigurationError
from conveyor.retry import Backoff, RetryPolicy
from conveyor.settings import ConveyorSettings
from conveyor.stage import StageFn, StageSpec, plain_stage

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*){2,}$")


class Configured(Protocol):
    """Whatever carries the deployment's settings (the platform's connections)."""

    @property
    def settings(self) -> ConveyorSettings: ...


class Stages(dict[str, StageSpec]):
    """Every declared stage's :class:`StageSpec`, by name."""

    def __init__(
        self, app: Celery, connections: Configured, *, queue_names: Collection[str], default_queue: str
    ) -> None:
        super().__init__()
        self._app = app
        self._connections = connections
        self._queue_names = queue_names
        self._default_queue = default_queue

    def declare(
        self,
        name: str,
        *,
        payload: type[BaseModel] | None,
        queue: str | None,
        max_attempts: int | None,
        retry: RetryPolicy | None,
        time_limit: float | None,
        soft_time_limit: float | None,
        concurrency: int | None,
        bind: bool = False,
        **policy: Any,
    ) -> Callable[[StageFn], StageSpec]:
        """Check a declaration now and resolve its policy (deployment overrides from
        ``CONVEYOR_STAGES`` win); returns what registers the spec of its body.

        ``policy`` is the rest of :class:`StageSpec`'s fields, taken as declared. Without
        ``payload`` the body is an ordinary function whose parameters are the payload
        (:func:`conveyor.stage.plain_stage`).
        """
        settings = self._connections.settings
        if bind and payload is not None:
            raise ConfigurationError(
                f"stage {name}: bind=True is for a plain signature; a payload= stage's body has ctx"
            )
        if not STAGE_NAME.match(name):
            raise ConfigurationError(
                f"stage name {name!r} must be three or more dot-separated lower-case parts "
                "(letters, digits, _), like 'conveyor.<family>.<verb>' or 'shop.orders.ship'"
            )
        queue = queue or self._default_queue
        if queue not in self._queue_names:
            raise ConfigurationError(f"stage {name}: queue {queue!r} is not declared in config")
        override = settings.stage_override(name)
        hard = override.time_limit or time_limit or settings.default_time_limit
        # The soft limit must fire before the hard one, whatever was declared.
        declared_soft = override.soft_time_limit or soft_time_limit or settings.default_soft_time_limit
        soft = min(declared_soft, hard * 0.9)
        what, bound = settings.redelivery_bound()
        if hard >= bound:
            raise ConfigurationError(
                f"stage {name}: hard time limit {hard}s must be below the {what} {bound}s"
            )
        attempts = override.max_attempts or max_attempts or settings.default_max_attempts
        if override.max_deferred is not None:
            policy["max_deferred"] = override.max_deferred
        if policy.get("idempotency", "key") not in ("key", "strict"):
            raise ConfigurationError(f"stage {name}: idempotency must be 'key' or 'strict'")

        def register(fn: StageFn) -> StageSpec:
            if payload is not None:
                model, body, shape = payload, fn, dict[str, Any]()
            else:
                plain = plain_stage(name, fn, bind=bind)
                model, body = plain.model, plain.body
                shape = {
                    "positional": True,
                    "var_positional": plain.var_positional,
                    "var_keyword": plain.var_keyword,
                    "keyword_only": plain.keyword_only,
                    "bound": bind,
                }
            unknown = sorted(set(policy.get("idempotency_ignore") or ()) - set(model.model_fields))
            if unknown:
                raise ConfigurationError(
                    f"stage {name}: idempotency_ignore names no field of its payload: {', '.join(unknown)}"
                )
            spec = StageSpec(
                name=name,
                fn=body,
                payload=model,
                **shape,
                queue=queue,
                max_attempts=attempts,
                retry=retry or Backoff(),
                time_limit=hard,
                soft_time_limit=soft,
                concurrency=override.concurrency or concurrency,
                concurrency_keys=tuple(sorted(override.concurrency_keys.items())),
                **policy,
            )
            self[name] = spec
            return spec

        return register

    def spec(self, stage: str | Task | StageSpec) -> StageSpec:
        """Resolve a stage by name, task or spec."""
        if isinstance(stage, StageSpec):
            return stage
        name = stage if isinstance(stage, str) else stage.name
        if name not in self:
            # Callers (web apps, the CLI) may not have imported the stage modules yet.
            self._app.loader.import_default_modules()
        try:
            return self[name]
        except KeyError:
            raise ConfigurationError(f"unknown stage {name!r}") from None


__all__ = ["STAGE_NAME", "Stages"]
