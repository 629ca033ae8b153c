"""JSON Schema validation errors as one readable line per problem.

In the style of :func:`conveyor.stage.readable_validation_error` (pydantic's words): the
field's path and what is wrong, never the submitted value (an enum's allowed values and a
pattern come from the schema and are shown, shortened).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jsonschema

MAX_PROBLEMS = 5  # problems a message lists; the rest are counted

_KINDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}

_BOUNDS = {
    "minimum": "Input should be greater than or equal to {}",
    "exclusiveMinimum": "Input should be greater than {}",
    "maximum": "Input should be less than or equal to {}",
    "exclusiveMaximum": "Input should be less than {}",
    "multipleOf": "Input should be a multiple of {}",
    "minLength": "String should have at least {} characters",
    "maxLength": "String should have at most {} characters",
    "minItems": "Array should have at least {} items",
    "maxItems": "Array should have at most {} items",
    "minProperties": "Object should have at least {} fields",
    "maxProperties": "Object should have at most {} fields",
}


def readable_schema_errors(errors: Iterable[jsonschema.ValidationError]) -> list[str]:
    """``field.path: what is wrong``, one per problem, up to :data:`MAX_PROBLEMS` and a
    count of the rest; in the words pydantic uses, and never the submitted values."""
    lines: dict[str, None] = {}
    for err in errors:
        for path, message in _explain(err):
            lines.setdefault(f"{_loc(path)}: {message}", None)
    out = list(lines)
    if len(out) > MAX_PROBLEMS:
        return [*out[:MAX_PROBLEMS], f"and {len(out) - MAX_PROBLEMS} more"]
    return out


def _explain(err: jsonschema.ValidationError) -> list[tuple[list[Any], str]]:
    path, kw, value = list(err.absolute_path), err.validator, err.validator_value
    if kw == "required" and isinstance(err.instance, Mapping):
        return [([*path, n], "Field required") for n in value if n not in err.instance]
    if kw == "additionalProperties" and isinstance(err.instance, Mapping):
        declared = err.schema.get("properties", {}) if isinstance(err.schema, Mapping) else {}
        patterns = err.schema.get("patternProperties", {}) if isinstance(err.schema, Mapping) else {}
        extra = [
            k for k in err.instance if k not in declared and not any(re.search(p, str(k)) for p in patterns)
        ]
        return [([*path, k], "Extra inputs are not permitted") for k in extra]
    if kw in ("anyOf", "oneOf"):
        return _alternatives(err, path)
    if kw == "type":
        return [(path, f"Input should be {_kinds(value)}")]
    if kw == "enum":
        return [(path, f"Input should be {or_list([_show(v) for v in value])}")]
    if kw == "const":
        return [(path, f"Input should be {_show(value)}")]
    if kw == "pattern":
        return [(path, f"String should match pattern {_show(value)}")]
    if kw == "uniqueItems":
        return [(path, "Array items should be unique")]
    if kw in _BOUNDS:
        return [(path, _BOUNDS[kw].format(value))]
    if kw is None or value is False:
        return [(path, "Input is not permitted here")]
    return [(path, f"Input does not satisfy the schema's {kw!r} rule")]


def _alternatives(err: jsonschema.ValidationError, path: list[Any]) -> list[tuple[list[Any], str]]:
    """anyOf/oneOf: the problems of the first alternative of the input's own kind, else
    what kinds the input could have been (``Input should be an integer or null``)."""
    groups: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in err.context or []:
        groups.setdefault(sub.relative_schema_path[0], []).append(sub)
    if not groups:
        return [(path, "Input matches more than one of the allowed forms")]
    fitting = [subs for subs in groups.values() if not any(_kind_mismatch(s) for s in subs)]
    if fitting:
        return [item for sub in fitting[0] for item in _explain(sub)]
    options: list[str] = []
    for index in groups:
        alt = err.validator_value[index] if isinstance(index, int) else {}
        if isinstance(alt, Mapping) and "enum" in alt:
            options.extend(_show(v) for v in alt["enum"])
        elif isinstance(alt, Mapping) and "const" in alt:
            options.append(_show(alt["const"]))
        else:
            options.extend(_kinds(s.validator_value) for s in groups[index] if _kind_mismatch(s))
    return [(path, f"Input should be {or_list(list(dict.fromkeys(options)))}")]


def _kind_mismatch(err: jsonschema.ValidationError) -> bool:
    return err.validator == "type" and not err.relative_path


def _kinds(value: Any) -> str:
    names = value if isinstance(value, list) else [value]
    return or_list([_KINDS.get(str(n), str(n)) for n in names])


def or_list(items: list[str]) -> str:
    """``a, b or c`` (the first eight and a count of the rest)."""
    if not items:
        return "another value"
    if len(items) > 8:
        items = [*items[:8], f"{len(items) - 8} more"]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc(path: Sequence[Any]) -> str:
    parts = [str(p) if len(str(p)) <= 40 else str(p)[:37] + "..." for p in path]
    return ".".join(parts) or "payload"
