"""The publisher benchmark's arithmetic (:mod:`bench.publisher` runs it): the plan of a run
(who posts when, which brand a window holds), each post's start lag against its reference
instant, the peer's overlaps per channel and per account, and duplicates on the peer.

Nothing here touches a service: it works on :class:`Observed` posts (read from Postgres by
the bench) and on the peer's :class:`~pipelines.publisher.peers.RequestRecord` log, whose
``time.monotonic()`` instants are moved onto the wall clock with one offset.
"""

from __future__ import annotations

import bisect
import datetime as dt
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHANNELS = ("facebook", "instagram")
BRANDS = 10
HELD_BRAND = "brand-0"
WINDOW_NAME = "bench-quiet"


@dataclass(frozen=True)
class Planned:
    """One post of the run: its account, brand, caption and due instant (epoch seconds)."""

    index: int
    channel: str
    account: str
    brand: str
    caption: str
    due: float


def plan_run(n: int, accounts: int, spread_s: float, first_due: float, tag: str) -> list[Planned]:
    """``n`` posts due evenly over ``spread_s`` seconds from ``first_due``, alternating the
    channels, round-robin over ``accounts`` accounts per channel, ``BRANDS`` brands by
    account number; every caption unique (the key and the duplicate count rely on it)."""
    out = []
    for i in range(n):
        channel = CHANNELS[i % len(CHANNELS)]
        j = (i // len(CHANNELS)) % accounts
        due = first_due + spread_s * i / max(1, n - 1) if n > 1 else first_due
        out.append(
            Planned(
                index=i,
                channel=channel,
                account=f"{channel[:2]}-acct-{j:03d}",
                brand=f"brand-{j % BRANDS}",
                caption=f"Bench post {i} ({tag}): new arrivals this week",
                due=due,
            )
        )
    return out


def window_bounds(first_due: float, spread_s: float, fraction: float) -> tuple[float, float]:
    """A window over the middle ``fraction`` of the spread, on whole seconds (a window's
    bounds are ``HH:MM:SS``)."""
    middle = first_due + spread_s / 2
    start = math.ceil(middle - spread_s * fraction / 2)
    return float(start), float(max(start + 1, math.floor(middle + spread_s * fraction / 2)))


def window_json(start: float, end: float) -> dict[str, Any]:
    """The blackout window (UTC) for ``HELD_BRAND`` between two instants."""

    def hms(at: float) -> str:
        return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%H:%M:%S")

    return {
        "name": WINDOW_NAME,
        "start": hms(start),
        "end": hms(end),
        "timezone": "UTC",
        "brands": [HELD_BRAND],
    }


@dataclass(frozen=True)
class Observed:
    """A post after the run, instants in epoch seconds: ``start`` its body's start (its
    first ``publisher.processing`` event), ``end`` its completion, ``held_until`` the end
    of the blackout window that parked it (None: never held)."""

    id: str
    channel: str
    account: str
    caption: str
    status: str
    due: float
    start: float | None
    end: float | None
    held_until: float | None


Interval = tuple[float, float]


def eligible(post: Observed) -> float:
    """When a post may first start: its due time, or the end of the window that held it."""
    return max(post.due, post.held_until or post.due)


def full_drops(intervals: Iterable[Interval], limit: int) -> list[float]:
    """The instants, in order, at which an interval ended while ``limit`` were open: a
    slot of a full key freed."""
    events = sorted(e for begin, end in intervals for e in ((begin, 1), (end, -1)))
    drops, current = [], 0
    for at, delta in events:
        if delta < 0 and current >= limit:
            drops.append(at)
        current += delta
    return drops


def lags_ms(
    posts: Sequence[Observed],
    channel_intervals: Mapping[str, Sequence[Interval]],
    account_intervals: Mapping[str, Sequence[Interval]],
    limits: Mapping[str, int],
    *,
    strict: bool = False,
) -> dict[str, float]:
    """Each started post's ``start - reference`` in milliseconds, by id. The reference is
    :func:`eligible`, or, if later, the freed slot it took: the last instant before its
    start at which its channel's intervals dropped from ``limit`` open (its account's
    from one: the lease). ``strict`` (the issue's wording): the last end of the channel's
    intervals before its start, only if ``limit`` were open at :func:`eligible`."""
    drops = {c: full_drops(i, limits[c]) for c, i in channel_intervals.items()}
    account_drops = {a: full_drops(i, 1) for a, i in account_intervals.items()}
    out = {}
    for post in posts:
        if post.start is None:
            continue
        ref = eligible(post)
        if strict:
            channel = channel_intervals.get(post.channel, ())
            if sum(1 for begin, end in channel if begin <= ref < end) >= limits[post.channel]:
                ref = max([ref, *(end for _, end in channel if end <= post.start)])
        else:
            for instants in (drops.get(post.channel, []), account_drops.get(post.account, [])):
                taken = bisect.bisect_right(instants, post.start)
                if taken:
                    ref = max(ref, instants[taken - 1])
        out[post.id] = max(0.0, (post.start - ref) * 1000.0)
    return out


def body_intervals(posts: Iterable[Observed]) -> tuple[dict[str, list[Interval]], dict[str, list[Interval]]]:
    """Each post's body ``[start, end)`` by channel and by account (the slots it held)."""
    channels: dict[str, list[Interval]] = defaultdict(list)
    accounts: dict[str, list[Interval]] = defaultdict(list)
    for post in posts:
        if post.start is not None:
            interval = (post.start, post.end if post.end is not None else math.inf)
            channels[post.channel].append(interval)
            accounts[post.account].append(interval)
    return channels, accounts


def post_spans(
    posts: Iterable[Observed], requests: Iterable[Any], offset: float, account_of: Callable[[Any], str]
) -> tuple[dict[str, list[Interval]], dict[str, list[Interval]], int]:
    """Each post's span on the peer, ``[its first request's start, its last one's end)`` on
    the wall clock (``monotonic + offset``), by channel and by account, and how many
    requests fell in no body of their account.

    A request belongs to every post of its account (``account_of(record)``) whose body
    ``[start, end]`` holds its start: with the lease kept that is one post; bodies that
    overlapped share the requests between them, so their spans overlap too. The peer stamps
    a request's end after writing its reply (late when its process is busy), so a post's
    next request may be logged as starting before the previous one ended, and a request as
    ending after its post completed: a post's requests are one span, clipped at its end
    (the client had every reply before its completion committed).
    """
    bodies: dict[str, list[Observed]] = defaultdict(list)
    for post in posts:
        if post.start is not None:
            bodies[post.account].append(post)
    spans: dict[str, list[float]] = {}
    channels: dict[str, list[Interval]] = defaultdict(list)
    accounts: dict[str, list[Interval]] = defaultdict(list)
    stray = 0
    for r in requests:
        begin = r.started + offset
        end = (r.ended if r.ended is not None else math.inf) + offset
        account = account_of(r)
        owners = [
            p
            for p in bodies.get(account, ())
            if p.start is not None and p.start <= begin <= (p.end if p.end is not None else math.inf)
        ]
        if not owners:
            stray += 1
            channels[r.channel].append((begin, end))
            accounts[account].append((begin, end))
        for post in owners:
            # Its reply reached the client before the post's completion committed.
            clipped = min(end, post.end if post.end is not None else math.inf)
            span = spans.setdefault(post.id, [begin, clipped])
            span[0], span[1] = min(span[0], begin), max(span[1], clipped)
    for post in posts:
        if post.id in spans:
            begin, end = spans[post.id]
            channels[post.channel].append((begin, end))
            accounts[post.account].append((begin, end))
    return channels, accounts, stray


def max_overlap(intervals: Iterable[Interval]) -> int:
    """The most intervals ever open at once (an end sorts before a start at equal times,
    as ``GraphPeer.max_overlap``)."""
    events = sorted(e for begin, end in intervals for e in ((begin, 1), (end, -1)))
    current = best = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (as bench/latency.py)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def duplicates(
    records: Iterable[tuple[str, str, str]], peer_objects: Iterable[tuple[str, str, str]]
) -> tuple[int, int]:
    """``(duplicates, published)`` on the peer: objects beyond one per record (a second
    object of a record's ``(channel, account, caption)``, or one matching no record) and
    the records with an object."""
    wanted = set(records)
    seen = Counter(peer_objects)
    extra = sum(count - 1 for key, count in seen.items() if key in wanted)
    extra += sum(count for key, count in seen.items() if key not in wanted)
    return extra, sum(1 for key in wanted if seen[key])
