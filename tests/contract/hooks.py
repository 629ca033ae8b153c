"""Schemathesis hooks of the contract run (schemathesis.toml names this file).

A submit's ``stage`` is any string to the document (stages are the deployment's), so
generated submits would almost all be 422 ``unknown-stage`` and the stateful phase would
rarely get a job to follow links from. Half the generated submit and dry-run bodies whose
``stage`` and ``payload`` are valid to the document therefore name a registered stage with
a payload it accepts instead: valid stays valid, and a body generated invalid elsewhere
(a negative case) stays invalid.
"""

from __future__ import annotations

from typing import Any

import schemathesis

STAGE = "conveyor.demo.square"


@schemathesis.hook("map_body").apply_to(operation_id=["submitJob", "dryRunJob"])
def registered_stage(context: schemathesis.HookContext, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    stage, payload = body.get("stage"), body.get("payload", {})
    if isinstance(stage, str) and 1 <= len(stage) <= 200 and isinstance(payload, dict) and len(stage) % 2:
        return {**body, "stage": STAGE, "payload": {"n": len(stage)}}
    return body


@schemathesis.hook("before_call").apply_to(operation_id="getJob")
def short_waits(context: schemathesis.HookContext, case: Any, kwargs: dict[str, Any]) -> None:
    """``wait`` holds the request open up to 30 s by design (no worker runs these jobs): a
    valid one is cut to half a second here, in every phase, so each call stays within the
    run's request timeout (an invalid one, over 30, is left to be refused)."""
    query = case.query
    if not isinstance(query, dict) or isinstance(query.get("wait"), bool):
        return
    try:
        wait = float(query.get("wait"))  # a number, or its text (the coverage phase's)
    except (TypeError, ValueError):
        return
    if 0.5 < wait <= 30:
        query["wait"] = 0.5
