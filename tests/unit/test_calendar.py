"""conveyor.calendar: local windows to UTC instants, across both daylight-saving changes of
Europe/Rome in 2025 (spring 2025-03-30 02:00 -> 03:00, autumn 2025-10-26 03:00 -> 02:00).
Every instant is passed in and every expected one is written out in UTC."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from conveyor.calendar import Window, blocking, parse_windows
from conveyor.errors import ConfigurationError

ROME = "Europe/Rome"
SPRING = datetime.date(2025, 3, 30)
AUTUMN = datetime.date(2025, 10, 26)


def utc(text: str) -> datetime.datetime:
    """An aware UTC instant from ``YYYY-MM-DDTHH:MM[:SS]``."""
    return datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.UTC)


def window(start: str, end: str, name: str = "w", **extra: Any) -> Window:
    return Window.from_json({"name": name, "start": start, "end": end, "timezone": ROME, **extra})


def test_spring_start_in_the_missing_hour_is_clamped_to_the_jump() -> None:
    assert window("02:30", "04:00").occurrence(SPRING) == (utc("2025-03-30T01:00"), utc("2025-03-30T02:00"))


def test_spring_end_in_the_missing_hour_is_clamped_to_the_jump() -> None:
    assert window("01:00", "02:30").occurrence(SPRING) == (utc("2025-03-30T00:00"), utc("2025-03-30T01:00"))


def test_spring_window_inside_the_missing_hour_is_empty() -> None:
    w = window("02:10", "02:50")
    assert w.occurrence(SPRING) == (utc("2025-03-30T01:00"), utc("2025-03-30T01:00"))
    assert w.active_at(utc("2025-03-30T01:00")) is None


def test_autumn_window_over_the_repeated_hour_covers_both() -> None:
    w = window("02:00", "03:00")
    assert w.occurrence(AUTUMN) == (utc("2025-10-26T00:00"), utc("2025-10-26T02:00"))
    occurrence = (utc("2025-10-26T00:00"), utc("2025-10-26T02:00"))
    assert w.active_at(utc("2025-10-26T00:30")) == occurrence  # 02:30 CEST, the first time
    assert w.active_at(utc("2025-10-26T01:30")) == occurrence  # 02:30 CET, the second time
    assert w.active_at(utc("2025-10-26T02:00")) is None  # 03:00 CET
    assert w.active_at(utc("2025-10-25T23:59:59")) is None  # 01:59:59 CEST


def test_autumn_bounds_inside_the_repeated_hour() -> None:
    # The start at its first occurrence (CEST), the end at its second (CET).
    assert window("02:15", "02:45").occurrence(AUTUMN) == (utc("2025-10-26T00:15"), utc("2025-10-26T01:45"))


def test_ordinary_winter_and_summer_days() -> None:
    w = window("09:00", "17:30")
    assert w.occurrence(datetime.date(2025, 1, 15)) == (utc("2025-01-15T08:00"), utc("2025-01-15T16:30"))
    assert w.occurrence(datetime.date(2025, 7, 15)) == (utc("2025-07-15T07:00"), utc("2025-07-15T15:30"))
    # The day before and after each change keeps its own offset.
    assert w.occurrence(datetime.date(2025, 3, 29)) == (utc("2025-03-29T08:00"), utc("2025-03-29T16:30"))
    assert w.occurrence(datetime.date(2025, 3, 31)) == (utc("2025-03-31T07:00"), utc("2025-03-31T15:30"))


def test_seconds_are_kept() -> None:
    w = window("09:00:15", "09:00:45")
    assert w.occurrence(datetime.date(2025, 1, 15)) == (
        utc("2025-01-15T08:00:15"),
        utc("2025-01-15T08:00:45"),
    )


def test_overnight_window_ends_the_next_local_day() -> None:
    w = window("22:00", "06:00")
    occurrence = (utc("2025-01-15T21:00"), utc("2025-01-16T05:00"))
    assert w.occurrence(datetime.date(2025, 1, 15)) == occurrence
    assert w.active_at(utc("2025-01-15T22:00")) == occurrence  # 23:00 local
    assert w.active_at(utc("2025-01-16T04:00")) == occurrence  # 05:00 local, the next day
    assert w.active_at(utc("2025-01-16T05:00")) is None  # 06:00 local: the end is outside
    assert w.active_at(utc("2025-01-15T21:00")) == occurrence  # 22:00 local: the start is inside
    assert w.active_at(utc("2025-01-15T20:59:59")) is None


def test_overnight_window_across_the_spring_change() -> None:
    # 22:00 CET on Saturday to 06:00 CEST on Sunday: seven hours.
    w = window("22:00", "06:00")
    assert w.occurrence(datetime.date(2025, 3, 29)) == (utc("2025-03-29T21:00"), utc("2025-03-30T04:00"))


def test_whole_day_window_when_start_equals_end() -> None:
    w = window("08:00", "08:00")
    assert w.occurrence(datetime.date(2025, 1, 15)) == (utc("2025-01-15T07:00"), utc("2025-01-16T07:00"))
    assert w.occurrence(datetime.date(2025, 3, 29)) == (utc("2025-03-29T07:00"), utc("2025-03-30T06:00"))


def test_days_filter_by_the_day_the_occurrence_starts() -> None:
    w = window("22:00", "06:00", days=["wed"])  # 2025-01-15 is a Wednesday
    assert w.occurrence(datetime.date(2025, 1, 14)) is None
    assert w.occurrence(datetime.date(2025, 1, 16)) is None
    # Thursday 05:00 local belongs to Wednesday's occurrence; Thursday 23:00 to none.
    assert w.active_at(utc("2025-01-16T04:00")) == (utc("2025-01-15T21:00"), utc("2025-01-16T05:00"))
    assert w.active_at(utc("2025-01-16T22:00")) is None
    assert w.active_at(utc("2025-01-14T22:00")) is None


def test_dates_filter_and_either_applies() -> None:
    w = window("10:00", "11:00", days=["mon"], dates=["2025-01-15"])
    assert w.occurrence(datetime.date(2025, 1, 15)) == (utc("2025-01-15T09:00"), utc("2025-01-15T10:00"))
    assert w.occurrence(datetime.date(2025, 1, 13)) == (utc("2025-01-13T09:00"), utc("2025-01-13T10:00"))
    assert w.occurrence(datetime.date(2025, 1, 14)) is None
    assert w.occurrence(datetime.date(2025, 1, 22)) is None


def test_an_instant_in_another_zone_is_compared_as_an_instant() -> None:
    w = window("09:00", "10:00")
    new_york = datetime.datetime(2025, 1, 15, 3, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=-5)))
    assert w.active_at(new_york) == (utc("2025-01-15T08:00"), utc("2025-01-15T09:00"))


def test_naive_instants_are_refused() -> None:
    naive = datetime.datetime(2025, 1, 15, 9, 30)
    with pytest.raises(ValueError):
        window("09:00", "10:00").active_at(naive)
    with pytest.raises(ValueError):
        blocking([window("09:00", "10:00")], naive)
    with pytest.raises(ValueError):
        blocking([], naive)


def test_blocking_follows_chained_windows() -> None:
    first, second = window("09:00", "10:00", "first"), window("10:00", "11:00", "second")
    for windows in ([first, second], [second, first]):
        assert blocking(windows, utc("2025-01-15T08:30")) == (second, utc("2025-01-15T10:00"))
        assert blocking(windows, utc("2025-01-15T09:00")) == (second, utc("2025-01-15T10:00"))
    assert blocking([first, second], utc("2025-01-15T10:00")) is None  # 11:00 local is free
    assert blocking([first, second], utc("2025-01-15T07:59:59")) is None


def test_blocking_follows_overlapping_windows() -> None:
    long, inner = window("09:00", "12:00", "long"), window("10:00", "11:00", "inner")
    assert blocking([inner, long], utc("2025-01-15T09:30")) == (long, utc("2025-01-15T11:00"))
    early, late = window("09:00", "10:30", "early"), window("10:00", "11:00", "late")
    assert blocking([early, late], utc("2025-01-15T08:15")) == (late, utc("2025-01-15T10:00"))
    assert blocking([early, late], utc("2025-01-15T09:45")) == (late, utc("2025-01-15T10:00"))


def test_blocking_with_no_window_holding_the_instant() -> None:
    assert blocking([window("09:00", "10:00")], utc("2025-01-15T12:00")) is None
    assert blocking([], utc("2025-01-15T12:00")) is None


def test_blocking_chains_across_days() -> None:
    night, day = window("22:00", "06:00", "night"), window("06:00", "22:00", "day", days=["wed"])
    # From Wednesday 07:00 local: day, night, then Thursday 06:00 is free.
    assert blocking([night, day], utc("2025-01-15T06:00")) == (night, utc("2025-01-16T05:00"))


def test_blocking_follows_a_long_run_of_dates() -> None:
    dates = [(datetime.date(2025, 1, 1) + datetime.timedelta(days=i)).isoformat() for i in range(60)]
    holiday = window("00:00", "00:00", "holiday", dates=dates)
    assert blocking([holiday], utc("2025-01-01T12:00")) == (holiday, utc("2025-03-01T23:00"))


@pytest.mark.parametrize(
    "windows",
    [
        [("00:00", "00:00")],
        [("00:00", "12:00"), ("12:00", "00:00")],
        [("22:00", "06:00"), ("06:00", "22:00")],
        [("02:00", "02:30"), ("02:30", "02:00")],  # bounds inside both changes' hours
    ],
)
def test_windows_covering_every_instant_are_refused(windows: list[tuple[str, str]]) -> None:
    parsed = [window(start, end, f"w{i}") for i, (start, end) in enumerate(windows)]
    for instant in ("2025-01-15T12:00", "2025-03-29T12:00", "2025-10-25T12:00"):
        with pytest.raises(ConfigurationError, match="windows cover every instant"):
            blocking(parsed, utc(instant))


def test_a_weekly_hole_is_found() -> None:
    every_day_but_sunday = window(
        "00:00", "00:00", "weekdays", days=["mon", "tue", "wed", "thu", "fri", "sat"]
    )
    # From Wednesday 2025-01-15: free at Sunday 00:00 local.
    assert blocking([every_day_but_sunday], utc("2025-01-15T12:00")) == (
        every_day_but_sunday,
        utc("2025-01-18T23:00"),
    )


BASE = {"name": "nightly", "start": "22:00", "end": "06:00", "timezone": ROME}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timezone": "Europe/Rom"}, "blackout_windows[2].timezone: unknown time zone 'Europe/Rom'"),
        ({"timezone": "../etc/passwd"}, "blackout_windows[2].timezone: unknown time zone '../etc/passwd'"),
        ({"timezone": 3}, "blackout_windows[2].timezone: unknown time zone 3"),
        (
            {"days": ["mon", "mondy"]},
            "blackout_windows[2].days[1]: 'mondy' is not a day (mon, tue, wed, thu, fri, sat, sun)",
        ),
        ({"days": ["Mon"]}, "blackout_windows[2].days[0]: 'Mon' is not a day"),
        ({"days": "mon"}, "blackout_windows[2].days: expected a list, got str"),
        ({"dates": ["2025-02-30"]}, "blackout_windows[2].dates[0]: '2025-02-30' is not a date (YYYY-MM-DD)"),
        ({"dates": ["2025-01-01", "20250301"]}, "blackout_windows[2].dates[1]: '20250301' is not a date"),
        ({"start": "25:00"}, r"blackout_windows[2].start: '25:00' is not HH:MM[:SS]"),
        ({"end": "6:00"}, "blackout_windows[2].end: '6:00' is not HH:MM"),
        ({"end": "06:00:60"}, "blackout_windows[2].end: '06:00:60' is not HH:MM"),
        ({"start": 2200}, "blackout_windows[2].start: 2200 is not HH:MM"),
        ({"name": None}, "blackout_windows[2].name: None is not a non-empty string"),
        ({"name": ""}, "blackout_windows[2].name: '' is not a non-empty string"),
        ({"label": "x"}, "blackout_windows[2]: unknown key 'label'"),
    ],
)
def test_from_json_errors_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Window.from_json({**BASE, **change}, where="blackout_windows[2]")
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("missing", ["name", "start", "end", "timezone"])
def test_from_json_requires_its_fields(missing: str) -> None:
    data = {key: value for key, value in BASE.items() if key != missing}
    with pytest.raises(ConfigurationError, match=rf"^window\.{missing}: required$"):
        Window.from_json(data)


def test_construction_validates_the_time_zone() -> None:
    with pytest.raises(ConfigurationError, match="unknown time zone 'Europe/Rom'"):
        Window("w", datetime.time(9), datetime.time(10), "Europe/Rom")
    with pytest.raises(ConfigurationError, match="days"):
        Window("w", datetime.time(9), datetime.time(10), ROME, days=frozenset({7}))


def test_to_json_round_trips() -> None:
    data = {**BASE, "start": "22:00:30", "days": ["mon", "fri"], "dates": ["2025-01-06", "2025-12-25"]}
    w = Window.from_json({**data, "days": ["fri", "mon", "fri"], "dates": ["2025-12-25", "2025-01-06"]})
    assert w.days == frozenset({0, 4})
    assert w.to_json() == data
    assert Window.from_json(w.to_json()) == w
    plain = Window.from_json(BASE)
    assert plain.to_json() == BASE and plain.days == frozenset() and plain.dates == frozenset()


def test_parse_windows() -> None:
    parsed = parse_windows([BASE, {**BASE, "name": "other"}], where="blackout_windows")
    assert [w.name for w in parsed] == ["nightly", "other"]
    assert parse_windows([], where="blackout_windows") == ()
    with pytest.raises(ConfigurationError, match=r"^blackout_windows: expected a list"):
        parse_windows({"name": "x"}, where="blackout_windows")
    with pytest.raises(ConfigurationError, match=r"^blackout_windows\[1\]: expected an object"):
        parse_windows([BASE, "nightly"], where="blackout_windows")
    with pytest.raises(ConfigurationError, match=r"^blackout_windows\[0\]\.timezone: unknown"):
        parse_windows([{**BASE, "timezone": "Mars/Olympus"}], where="blackout_windows")
