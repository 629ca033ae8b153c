"""How values are stored: kombu's JSON, the encoding a Celery message carries.

Bytes, datetimes, ``Decimal`` and ``UUID`` keep kombu's ``{"__type__", "__value__"}`` tags,
so a stage receives what was sent. One change to kombu's output: JSON text never holds a
``\\u0000`` escape. Postgres keeps such a ``json`` value, but then fails every ``->>`` over
that row ("unsupported Unicode escape sequence"): one job's NUL would break every query on
the jobs' payloads. Bytes holding a NUL take kombu's own ``base64`` tag; a string holding one
is tagged ``conveyor.text`` (its UTF-8 in base64), decoded back by :func:`from_wire`; a
mapping key holding one has it written ``\\0`` (a key cannot be tagged).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import typing
from collections.abc import Mapping
from typing import Any

from celery.result import ResultBase
from kombu.utils import json as kombu_json
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

_NUL_ESCAPE = "\\u0000"


class Record(Mapping[str, Any]):
    """A read-only mapping whose keys are also attributes (``request.id`` and
    ``request["id"]``): an errback stage's ``request`` and ``exc``. Stored in kombu's JSON
    as a tagged object, so it reaches the body as it was sent; ``str()`` of an ``exc`` is
    its message."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_data")[name]
        except KeyError:
            raise AttributeError(name) from None

    def __str__(self) -> str:
        return str(self._data.get("message", self._data))

    def __repr__(self) -> str:
        return f"Record({self._data!r})"


class _NulText:
    """A string holding a NUL, on its way to its ``conveyor.text`` tag."""

    def __init__(self, text: str) -> None:
        self.text = text


def _text_from_tag(value: str) -> Any:
    return base64.b64decode(value).decode("utf-8", "surrogatepass")


kombu_json.register_type(Record, "conveyor.record", lambda r: dict(r), Record)
kombu_json.register_type(
    _NulText,
    "conveyor.text",
    lambda t: base64.b64encode(t.text.encode("utf-8", "surrogatepass")).decode("ascii"),
    _text_from_tag,
)


class _WireEncoder(kombu_json.JSONEncoder):
    """kombu's JSON (bytes, datetimes, Decimal and UUID tagged as on the wire), plus models,
    dataclasses and what pydantic can make JSON of (enums, sets...)."""

    def default(self, o: Any) -> Any:
        if isinstance(o, bytes) and b"\x00" in o:
            return {"__type__": "base64", "__value__": base64.b64encode(o).decode("ascii")}
        if isinstance(o, BaseModel):
            return o.model_dump(mode="python")
        if isinstance(o, ResultBase):  # as Celery's backends store one (prepare_value)
            return o.as_tuple()
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        try:
            return super().default(o)  # type: ignore[no-untyped-call]
        except TypeError:
            return to_jsonable_python(o)


def _dumps(value: Any) -> str:
    text = kombu_json.dumps(  # type: ignore[no-untyped-call]
        value, cls=_WireEncoder, separators=(",", ":"), ensure_ascii=False
    )
    return str(text)


def _nul_tagged(data: Any) -> Any:
    """JSON-ready ``data`` with each string holding a NUL wrapped for its tag."""
    if isinstance(data, str):
        return _NulText(data) if "\x00" in data else data
    if isinstance(data, list):
        return [_nul_tagged(v) for v in data]
    if isinstance(data, dict):
        return {k.replace("\x00", "\\0"): _nul_tagged(v) for k, v in data.items()}
    return data


def wire_text(value: Any) -> str:
    """``value`` in kombu's JSON, as a message carries it (no ``\\u0000`` in the text)."""
    text = _dumps(value)
    if "\x00" in text or _NUL_ESCAPE in text:
        # ensure_ascii=False leaves a NUL as an escape; a literal one never appears
        text = _dumps(_nul_tagged(json.loads(text)))
    return text


def to_wire(value: Any) -> Any:
    """``value`` as JSON-ready data in kombu's encoding: what a JSON column stores, with
    bytes, datetimes, Decimal and UUID kept as kombu's ``{"__type__", "__value__"}`` tags."""
    return json.loads(wire_text(value))


def from_wire(data: Any) -> Any:
    """Stored JSON data back to the values that were sent (kombu's tags decoded); anything
    but a dict or a list (a scalar, an exception) is returned as it is."""
    if not isinstance(data, (dict, list)):
        return data
    try:
        return kombu_json.loads(json.dumps(data))  # type: ignore[no-untyped-call]
    except ValueError:  # a tag of a type this process does not know: left as it is
        return data
