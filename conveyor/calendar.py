"""Calendar windows: recurring spans of local wall time (e.g. a nightly blackout 22:00-06:00
Europe/Rome on weekdays), turned into UTC instants.

A :class:`Window` holds ``start`` and ``end`` local times in an IANA time zone, and applies on
the listed weekdays or dates (with neither, every day). An occurrence belongs to the local day
it *starts* on; ``end <= start`` means it ends on the next local day, and ``start == end``
makes it a whole day (it ends at the next day's ``start``).

Local times become UTC as follows, so that both daylight-saving changes behave:

- a bound inside the missing spring hour is clamped to the transition instant (02:30 on
  2025-03-30 Europe/Rome -> 03:00 CEST = 01:00Z);
- a start bound inside the repeated autumn hour is its first occurrence (``fold=0``), an end
  bound its second (``fold=1``), so a window over the repeated hour covers both.

Every instant returned is an aware UTC datetime, and every comparison is made in UTC.
"""

from __future__ import annotations

import datetime
import re
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConfigurationError

__all__ = ["DAY_NAMES", "Window", "blocking", "parse_windows"]

UTC = datetime.UTC
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # index = datetime.weekday()
_KEYS = ("name", "start", "end", "timezone", "days", "dates")
_TIME = re.compile(r"([01]\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# Past the last listed date only the weekday pattern applies, which repeats every week; a
# chain still unbroken three weeks on (each weekday seen at least twice, so a hole that only
# a daylight-saving day happens to fill still shows) covers every instant from then on.
_COVER_HORIZON = datetime.timedelta(days=21)


def _zone(name: object, where: str) -> zoneinfo.ZoneInfo:
    if isinstance(name, str):
        try:
            return zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
            pass
    raise ConfigurationError(f"{where}: unknown time zone {name!r}")


def _parse_time(value: object, where: str) -> datetime.time:
    match = _TIME.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigurationError(f"{where}: {value!r} is not HH:MM[:SS]")
    hours, minutes, seconds = match.groups()
    return datetime.time(int(hours), int(minutes), int(seconds or 0))


def _format_time(value: datetime.time) -> str:
    return value.strftime("%H:%M:%S" if value.second else "%H:%M")


def _parse_date(value: object, where: str) -> datetime.date:
    if isinstance(value, str) and _DATE.fullmatch(value):
        try:
            return datetime.date.fromisoformat(value)
        except ValueError:
            pass
    raise ConfigurationError(f"{where}: {value!r} is not a date (YYYY-MM-DD)")


def _parse_day(value: object, where: str) -> int:
    if isinstance(value, str) and value in DAY_NAMES:
        return DAY_NAMES.index(value)
    raise ConfigurationError(f"{where}: {value!r} is not a day ({', '.join(DAY_NAMES)})")


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigurationError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _to_utc(
    local_date: datetime.date, wall: datetime.time, zone: zoneinfo.ZoneInfo, *, fold: int
) -> datetime.datetime:
    """The UTC instant of a local wall time; a wall time that does not exist (spring gap) is
    clamped to the instant the clocks jumped."""
    local = datetime.datetime.combine(local_date, wall, tzinfo=zone).replace(fold=fold)
    utc = local.astimezone(UTC)
    if utc.astimezone(zone).replace(tzinfo=None) == local.replace(tzinfo=None):
        return utc
    # Inside a gap fold=0 reads the wall time with the offset before the jump and fold=1
    # with the one after: the jump lies between the two readings. Offsets change on whole
    # seconds, so a bisection over seconds finds it in a few steps (even a skipped day).
    readings = (local.replace(fold=0).astimezone(UTC), local.replace(fold=1).astimezone(UTC))
    low, high = min(readings), max(readings)
    before = low.astimezone(zone).utcoffset()
    while high - low > datetime.timedelta(seconds=1):
        middle = low + datetime.timedelta(seconds=(high - low).total_seconds() // 2)
        if middle.astimezone(zone).utcoffset() == before:
            low = middle
        else:
            high = middle
    return high


def _require_aware(instant: datetime.datetime) -> datetime.datetime:
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"a naive datetime is not an instant: {instant.isoformat()}")
    return instant.astimezone(UTC)


@dataclass(frozen=True)
class Window:
    """A recurring span of local time: ``start`` to ``end`` in ``timezone``, on the listed
    ``days`` (0=Monday..6=Sunday) or ``dates``, or every day when both are empty."""

    name: str
    start: datetime.time
    end: datetime.time
    timezone: str
    days: frozenset[int] = field(default_factory=frozenset)
    dates: frozenset[datetime.date] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        where = f"window {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"window.name: {self.name!r} is not a non-empty string")
        for bound in ("start", "end"):
            value = getattr(self, bound)
            # Aware or sub-second times would not survive to_json: refuse them here.
            if not isinstance(value, datetime.time) or value.tzinfo is not None or value.microsecond:
                raise ConfigurationError(f"{where}.{bound}: {value!r} is not a naive HH:MM[:SS] time")
        _zone(self.timezone, f"{where}.timezone")
        days = frozenset(self.days)
        if any(isinstance(day, bool) or day not in range(7) for day in days):
            raise ConfigurationError(f"{where}.days: {sorted(days)!r} are not all weekdays 0..6")
        dates = frozenset(self.dates)
        if any(isinstance(day, datetime.datetime) or not isinstance(day, datetime.date) for day in dates):
            raise ConfigurationError(f"{where}.dates: not all dates")
        object.__setattr__(self, "days", days)
        object.__setattr__(self, "dates", dates)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "window") -> Window:
        """A window from its JSON object: ``name``, ``start``, ``end`` (``HH:MM[:SS]``) and
        ``timezone`` (IANA) required; ``days`` (``mon``..``sun``) and ``dates``
        (``YYYY-MM-DD``) optional; any other key is refused. A ConfigurationError names the
        field, e.g. ``blackout_windows[2].timezone: unknown time zone 'Europe/Rom'``."""
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{where}: expected an object, got {type(data).__name__}")
        for key in data:
            if key not in _KEYS:
                raise ConfigurationError(f"{where}: unknown key {key!r} (allowed: {', '.join(_KEYS)})")
        for key in _KEYS[:4]:
            if key not in data:
                raise ConfigurationError(f"{where}.{key}: required")
        name = data["name"]
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{where}.name: {name!r} is not a non-empty string")
        _zone(data["timezone"], f"{where}.timezone")
        days = _list(data.get("days", []), f"{where}.days")
        dates = _list(data.get("dates", []), f"{where}.dates")
        return cls(
            name=name,
            start=_parse_time(data["start"], f"{where}.start"),
            end=_parse_time(data["end"], f"{where}.end"),
            timezone=data["timezone"],
            days=frozenset(_parse_day(day, f"{where}.days[{i}]") for i, day in enumerate(days)),
            dates=frozenset(_parse_date(day, f"{where}.dates[{i}]") for i, day in enumerate(dates)),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object :meth:`from_json` reads back into an equal window (days and dates
        sorted, left out when empty)."""
        data: dict[str, Any] = {
            "name": self.name,
            "start": _format_time(self.start),
            "end": _format_time(self.end),
            "timezone": self.timezone,
        }
        if self.days:
            data["days"] = [DAY_NAMES[day] for day in sorted(self.days)]
        if self.dates:
            data["dates"] = [day.isoformat() for day in sorted(self.dates)]
        return data

    def applies_on(self, local_date: datetime.date) -> bool:
        """Whether an occurrence starts on this local date."""
        if not self.days and not self.dates:
            return True
        return local_date.weekday() in self.days or local_date in self.dates

    def occurrence(self, local_date: datetime.date) -> tuple[datetime.datetime, datetime.datetime] | None:
        """``(start_utc, end_utc)`` of the occurrence that starts on ``local_date``, or None
        when the window does not apply that day. ``end <= start`` ends on the next local
        day (``start == end``: a whole day, ending at the next day's start)."""
        if not self.applies_on(local_date):
            return None
        zone = zoneinfo.ZoneInfo(self.timezone)
        start = _to_utc(local_date, self.start, zone, fold=0)
        end_date = local_date if self.end > self.start else local_date + datetime.timedelta(days=1)
        end = _to_utc(end_date, self.end, zone, fold=1)
        # Both bounds clamped into one spring gap make an empty window, never a negative one.
        return start, max(start, end)

    def active_at(self, instant: datetime.datetime) -> tuple[datetime.datetime, datetime.datetime] | None:
        """The occurrence ``(start_utc, end_utc)`` with ``start <= instant < end``, else None.
        If two hold it (a whole-day window over a repeated autumn hour), the one ending last.
        A naive ``instant`` raises ValueError."""
        instant = _require_aware(instant)
        local_date = instant.astimezone(zoneinfo.ZoneInfo(self.timezone)).date()
        found: tuple[datetime.datetime, datetime.datetime] | None = None
        # The previous day for overnight windows; the next one too, as a zone's clocks may go
        # back across midnight.
        for offset in (-1, 0, 1):
            occurrence = self.occurrence(local_date + datetime.timedelta(days=offset))
            if occurrence is None or not occurrence[0] <= instant < occurrence[1]:
                continue
            if found is None or occurrence[1] > found[1]:
                found = occurrence
        return found


def blocking(
    windows: Iterable[Window], instant: datetime.datetime
) -> tuple[Window, datetime.datetime] | None:
    """The window holding ``instant`` and the UTC instant it ends, or None when none holds
    it. Windows that overlap or chain (one ends inside or exactly at the start of another)
    are followed: the result is the window whose end is the first instant free of all of
    them. Windows that leave no free instant raise ConfigurationError. A naive ``instant``
    raises ValueError."""
    windows = tuple(windows)
    current = _require_aware(instant)
    last_date = max((day for window in windows for day in window.dates), default=None)
    horizon = current
    if last_date is not None:
        horizon = max(horizon, datetime.datetime.combine(last_date, datetime.time(), tzinfo=UTC))
    horizon += _COVER_HORIZON
    found: tuple[Window, datetime.datetime] | None = None
    # Every hop moves strictly forward to an occurrence's end, and the occurrences before
    # the horizon are finite: the loop ends, at a free instant or past the horizon.
    while current < horizon:
        holding: tuple[Window, datetime.datetime] | None = None
        for window in windows:
            occurrence = window.active_at(current)
            if occurrence is not None and (holding is None or occurrence[1] > holding[1]):
                holding = (window, occurrence[1])
        if holding is None:
            return found
        found = holding
        current = holding[1]
    raise ConfigurationError(
        f"windows cover every instant: {', '.join(repr(window.name) for window in windows)}"
        f" leave no free time after {instant.astimezone(UTC).isoformat()}"
    )


def parse_windows(items: Any, *, where: str) -> tuple[Window, ...]:
    """A JSON list of windows (see :meth:`Window.from_json`); an item's errors name it as
    ``where[i]``, and anything but a list raises ConfigurationError naming ``where``."""
    if not isinstance(items, list):
        raise ConfigurationError(f"{where}: expected a list of windows, got {type(items).__name__}")
    return tuple(Window.from_json(item, where=f"{where}[{i}]") for i, item in enumerate(items))
