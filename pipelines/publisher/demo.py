"""The publisher family in ``conveyor demo``: a Graph-like peer the demo starts before its
worker (the worker's ``CONVEYOR_PUBLISHER`` names it, with a blackout window for the brand
``demo-quiet`` from the demo's start for :data:`WINDOW_S` seconds), and two posts scheduled
when the self-check starts: one runs at once, the other waits for the window's end."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conveyor.platform import Platform
from pipelines.publisher.peers import GraphPeer

WINDOW_S = 25
ZONE = "Europe/Rome"
_running: dict[str, Any] = {}


@contextmanager
def peers() -> Iterator[dict[str, str]]:
    """Start the Graph peer; yield the worker's extra environment naming it."""
    from zoneinfo import ZoneInfo

    with GraphPeer(token="demo-token") as graph:
        start = dt.datetime.now(ZoneInfo(ZONE))
        end = start + dt.timedelta(seconds=WINDOW_S)
        window = {
            "name": "demo quiet hours",
            "start": start.strftime("%H:%M:%S"),
            "end": end.strftime("%H:%M:%S"),
            "timezone": ZONE,
            "brands": ["demo-quiet"],
        }
        settings = {"graph_url": graph.url, "tokens": {"*": graph.token}, "blackout_windows": [window]}
        _running.update(graph=graph, settings=settings, until=end.replace(microsecond=0))
        try:
            yield {"CONVEYOR_PUBLISHER": json.dumps(settings)}
        finally:
            _running.clear()


def _with_settings(platform: Platform) -> Any:
    from tasks.publisher.settings import PublisherSettings

    before = getattr(platform.settings, "publisher", None)
    platform.settings.publisher = PublisherSettings.model_validate(_running["settings"])  # type: ignore[attr-defined]
    return before


def start(platform: Platform) -> None:
    """Schedule the demo's two posts (due now), if the peer runs."""
    from pipelines.publisher.posts import Plan, schedule_post

    if "graph" not in _running:
        return
    before = _with_settings(platform)
    now = dt.datetime.now(dt.UTC)
    try:
        for brand in ("demo", "demo-quiet"):
            plan = Plan(
                brand=brand,
                channel="facebook",
                account=f"{brand}-page",
                caption=f"Hello from conveyor demo ({brand}, {now:%H:%M:%S})",
                scheduled_at=now,
            )
            _running[brand] = schedule_post(platform, plan).id
    finally:
        if before is not None:
            platform.settings.publisher = before  # type: ignore[attr-defined]


def check(platform: Platform) -> list[tuple[str, bool, str]]:
    """Both posts published once; the quiet brand's only after its window ended."""
    from pipelines.publisher.posts import show_post

    graph: GraphPeer | None = _running.get("graph")
    if graph is None or "demo" not in _running:
        return [
            ("publisher: skipped", True, "the running worker's CONVEYOR_PUBLISHER decides where posts go")
        ]
    deadline = time.monotonic() + 60
    shown = {b: show_post(platform, _running[b]) for b in ("demo", "demo-quiet")}
    while any(s["status"] != "completed" for s in shown.values()) and time.monotonic() < deadline:
        time.sleep(0.3)
        shown = {b: show_post(platform, _running[b]) for b in ("demo", "demo-quiet")}
    posts = {b: graph.posts(f"{b}-page") for b in ("demo", "demo-quiet")}
    quiet = posts["demo-quiet"]
    held_until = _running["until"]
    after = bool(quiet) and _graph_time(quiet[0]["created_time"]) >= held_until.astimezone(dt.UTC)
    held = platform.job(_running["demo-quiet"]).events()[0]
    window = next((e.body.get("window") for e in held if e.topic == "job.blackout"), None)
    return [
        (
            "1 post published at once through the local Graph peer",
            shown["demo"]["status"] == "completed" and len(posts["demo"]) == 1,
            f"status {shown['demo']['status']}, {len(posts['demo'])} post(s)",
        ),
        (
            f"1 post held by the blackout window until {held_until:%H:%M:%S} {ZONE}, then published",
            shown["demo-quiet"]["status"] == "completed" and len(quiet) == 1 and after and window is not None,
            f"status {shown['demo-quiet']['status']}, window {window!r}",
        ),
    ]


def _graph_time(text: str) -> dt.datetime:
    from tasks.publisher.graph import parse_graph_time

    return parse_graph_time(text)
