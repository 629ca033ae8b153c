"""OpenAPI links between the API's operations: what a response's fields lead to (a submitted
job's ``id`` to ``getJob``, a dead-letter page's first entry to ``getDeadLetter``).

They document the API's workflows for people and tools, and drive the stateful phase of
the contract run (``tests/contract``), which follows them with the values a response held.
"""

from __future__ import annotations

from typing import Any


def link(operation_id: str, description: str, **parameters: str) -> dict[str, Any]:
    """A link to ``operation_id``, its ``parameters`` given as runtime expressions
    (``$response.body#/id``)."""
    return {"operationId": operation_id, "description": description, "parameters": parameters}


def job_links(pointer: str, *names: str) -> dict[str, dict[str, Any]]:
    """Links from the job id at ``pointer`` (``/id``) to the job operations named."""
    value = f"$response.body#{pointer}"
    every = {
        "GetJob": link("getJob", "the job, with its events", job_id=value),
        "CancelJob": link("cancelJob", "cancel the job", job_id=value),
        "JobEvents": link("listEvents", "the job's events in the outbox", job=value),
    }
    return {name: every[name] for name in names}


__all__ = ["job_links", "link"]
