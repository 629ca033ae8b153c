"""Dedup policies a client can apply without the stage's code.

The worker side resolves a dedup key from the payload model (:meth:`Dedup.resolve`); a
client holds only the payload's JSON. :func:`policy_as_data` accepts a policy only when the
two agree exactly: a key read from plain fields (str, int, float, bool, datetime, date,
time, UUID, str/int enums, literals, optional or not) that no validator, serializer,
alias, string transform or default factory touches. :func:`model_value` turns a JSON value
back into what the model holds (``5`` -> ``5.0`` for a float field, a datetime string ->
a datetime), guided by the field's JSON Schema. Model validators are assumed not to
rewrite the fields a key reads.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import re
import string
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any

import annotated_types
from pydantic import BaseModel, TypeAdapter

from conveyor.dedup import Dedup

_SCALARS: tuple[type, ...] = (str, int, float, bool, dt.datetime, dt.date, dt.time, uuid.UUID)
_HARMLESS_METADATA = ("Strict", "_PydanticGeneralMetadata")  # pattern, strict: never rewrite


def policy_as_data(dedup: Dedup | None, model: type[BaseModel]) -> tuple[dict[str, Any] | None, str | None]:
    """``(the policy as data, None)`` when a client holding the payload as JSON computes
    the same key as ``dedup.resolve`` does from ``model``; else ``(None, why not)``."""
    if dedup is None:
        return None, None
    if callable(dedup.key):
        return None, "its dedup key is computed by a function"
    try:
        names = list(dedup.fields) if dedup.fields else template_names(dedup.key or "")
    except ValueError as exc:
        return None, f"its dedup key template is malformed ({exc})"
    for name in names:
        reason = _unportable(model, name)
        if reason:
            return None, f"its dedup key reads {name!r}, {reason}"
    policy = {
        "mode": dedup.mode,
        "key": dedup.key,
        "fields": list(dedup.fields) if dedup.fields else None,
        "ttl": dedup.ttl,
        "window": dedup.window,
        "max_wait": dedup.max_wait,
        "scope": dedup.scope,
    }
    return policy, None


def template_names(template: str) -> list[str]:
    """The payload fields a key template reads (``"u:{user.id}"`` reads ``user``)."""
    parsed = string.Formatter().parse(template)
    return [re.split(r"[.\[]", f, maxsplit=1)[0] for _, f, _, _ in parsed if f is not None]


def _unportable(model: type[BaseModel], name: str) -> str | None:
    """Why a client holding JSON may not get the value ``model`` holds for field ``name``."""
    info = model.model_fields.get(name)
    if info is None:
        return "which is not a declared field of its payload model"
    if {info.alias, info.validation_alias} - {None, name}:
        return "which has an alias"
    if info.default_factory is not None:
        return "whose default is computed by a function"
    decorators = model.__pydantic_decorators__
    covered = [d.info.fields for d in decorators.field_validators.values()]
    covered += [d.info.fields for d in decorators.field_serializers.values()]
    if any(name in fields or "*" in fields for fields in covered):
        return "which a field validator or serializer rewrites"
    config = model.model_config
    transforms = ("str_strip_whitespace", "str_to_lower", "str_to_upper")
    rewriting = [t for t in transforms if config.get(t)]
    if rewriting and _holds_text(info.annotation):
        return f"which its model's config rewrites ({rewriting[0]})"
    if not all(_harmless(m) for m in info.metadata):
        return "whose value its annotation may rewrite"
    if not _plain(info.annotation):
        return f"of type {_type_name(info.annotation)}, which JSON does not carry exactly"
    return None


def _harmless(meta: Any) -> bool:
    """Constraints that check a value but never rewrite it."""
    if meta is None or type(meta).__name__ in _HARMLESS_METADATA:
        return True
    if any(getattr(meta, t, None) for t in ("strip_whitespace", "to_lower", "to_upper")):
        return False
    return isinstance(meta, (annotated_types.BaseMetadata, annotated_types.GroupedMetadata))


def _plain(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return len(rest) == 1 and _plain(rest[0])
    if origin is typing.Literal:
        return all(a is None or type(a) in (str, int, bool) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return issubclass(tp, (str, int))
    return tp in _SCALARS


def _holds_text(tp: Any) -> bool:
    """Whether ``tp`` (optional or not) may hold a string a str_* setting rewrites."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType or origin is typing.Literal:
        return any(a is str or isinstance(a, str) or _holds_text(a) for a in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, str)


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


_FORMATS: dict[str, type] = {"date-time": dt.datetime, "date": dt.date, "time": dt.time, "uuid": uuid.UUID}


@functools.cache
def _adapter(fmt: str) -> TypeAdapter[Any]:
    return TypeAdapter(_FORMATS[fmt])


def model_value(value: Any, prop: Mapping[str, Any]) -> Any:
    """A JSON value as the model holds it, by the field's schema (see the module doc)."""
    if value is None or not isinstance(prop, Mapping):
        return value
    alts = [a for a in prop.get("anyOf", [prop]) if isinstance(a, Mapping) and a.get("type") != "null"]
    if len(alts) != 1:
        return value
    kind, fmt = alts[0].get("type"), alts[0].get("format")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind == "string" and fmt in _FORMATS and isinstance(value, str):
        return _adapter(fmt).validate_python(value)
    return value
