"""Which upstream canvas tests show one of the README's "Differences from Celery": they are
marked ``xfail`` on the stages side, with the difference as the reason.

A test is matched by its id (or the id's prefix before ``[``), or by the tasks it uses:
a task of Celery's ``tasks.py`` whose body calls ``self.<method>(`` for a method a stage
refuses, found in the upstream source itself, so a new upstream test of that kind is
matched without a list to keep.
"""

from __future__ import annotations

import ast
import re

_README = "README, Differences from Celery: "

REPLACE = _README + "a stage cannot replace itself (Task.replace raises ReplaceRefused)"
HEADER_WHOLE = (
    _README + "a chord's header is recorded whole in one transaction (a generator is consumed first)"
)
ONE_JOB_PER_ID = _README + "a task id names one job: a frozen signature applied again is deduplicated"

# Test ids (or prefixes before "[") and their difference.
BY_ID: dict[str, str] = {
    "test_chord::test_generator": HEADER_WHOLE,
    # These apply one frozen signature twice (a chord reapplied, or a chain or group used
    # as a header, then as a body): the second time its jobs are the first's.
    "test_chord::test_reapplying_frozen_chord_dispatches_body_again": ONE_JOB_PER_ID,
    "test_chord::test_mutable_errback_called_by_chord_from_group": ONE_JOB_PER_ID,
    "test_chord::test_mutable_errback_called_by_chord_from_chain": ONE_JOB_PER_ID,
    "test_chord::test_mutable_errback_called_by_chord_from_chain_tail": ONE_JOB_PER_ID,
}
# ``self.<method>(`` in a task body, and the difference a test using that task shows.
BY_TASK_METHOD: dict[str, str] = {
    "replace": REPLACE,
}


def tasks_calling(source: str) -> dict[str, str]:
    """The upstream tasks whose body calls one of :data:`BY_TASK_METHOD`, with the reason."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "self"
                and call.func.attr in BY_TASK_METHOD
            ):
                found[node.name] = BY_TASK_METHOD[call.func.attr]
    return found


def difference_of(test_id: str, test_source: str, tasks: dict[str, str]) -> str | None:
    """The difference a test shows, if any (``tasks`` from :func:`tasks_calling`)."""
    for prefix, reason in BY_ID.items():
        if test_id == prefix or test_id.startswith(prefix + "["):
            return reason
    for name, reason in tasks.items():
        if re.search(rf"\b{re.escape(name)}\b", test_source):
            return reason
    return None
