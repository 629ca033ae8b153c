"""``conveyor.web.wsgi``: the HTTP API mounted in a WSGI application (what
``conveyor.contrib.flask.mount_api`` and ``conveyor.contrib.django.api.mount`` use), served
by a real threaded WSGI server (werkzeug's) in this process. The Flask and Django test
projects mount it the ordinary way (tests/integration/test_flask_app.py,
tests/projects/djangoshop/tests/test_api.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from werkzeug.serving import make_server

import conveyor
from conveyor.web import events, tokens
from conveyor.web.wsgi import Mounted, mount
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(60)


def shop(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [f"shop {environ.get('SCRIPT_NAME', '')}|{environ['PATH_INFO']}".encode()]


@pytest.fixture
def served(client: conveyor.Client) -> Iterator[tuple[str, Mounted]]:
    mounted = mount(shop, "/api/conveyor/", lambda: client)
    server = make_server("127.0.0.1", 0, mounted, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", mounted
    finally:
        server.shutdown()
        thread.join(10)


def api_tasks(mounted: Mounted) -> int:
    """How many of the API's requests are still running in a2wsgi's event loop."""

    async def count() -> int:
        return len(asyncio.all_tasks() - {asyncio.current_task()})

    loop = mounted.api._wsgi.loop
    return asyncio.run_coroutine_threadsafe(count(), loop).result(5)


def test_under_the_prefix_the_api_answers_with_prefixed_locations(
    served: tuple[str, Mounted], platform: Any
) -> None:
    base, mounted = served
    assert requests.get(f"{base}/api/conveyorx/jobs", timeout=5).text == "shop |/api/conveyorx/jobs"
    assert mounted.api._api is None  # nothing built before a request under the prefix
    bearer = {
        "Authorization": f"Bearer {tokens.create(platform.engine, owner='w', scopes=('submit',)).secret}"
    }
    created = requests.post(
        f"{base}/api/conveyor/jobs",
        json={"stage": "conveyor.demo.square", "payload": {"n": 2}, "delay": 3600},
        headers=bearer,
        timeout=10,
    )
    assert created.status_code == 201, created.text
    assert created.headers["Location"] == f"/api/conveyor/jobs/{created.json()['id']}"
    cancelled = requests.post(f"{base}{created.headers['Location']}/cancel", headers=bearer, timeout=10)
    assert cancelled.json()["status"] == "cancelled"
    assert requests.get(f"{base}/api/conveyor/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{base}/", timeout=5).text == "shop |/"


def test_an_event_stream_flows_and_ends_when_its_client_goes(
    served: tuple[str, Mounted], platform: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames reach the client as written; once the client is gone, the server's next
    write fails and the stream's task ends (a2wsgi alone would leave it waiting)."""
    monkeypatch.setattr(events, "HEARTBEAT_SECONDS", 0.2)  # the write that finds the client gone
    base, mounted = served
    secret = tokens.create(platform.engine, owner="w", scopes=("admin",)).secret
    admin = {"Authorization": f"Bearer {secret}"}
    stream_url = f"{base}/api/conveyor/events/stream"
    for _ in range(3):
        with requests.get(
            stream_url, params={"job": "none"}, headers=admin, stream=True, timeout=10
        ) as stream:
            lines = stream.iter_lines(decode_unicode=True)
            assert next(lines) == "retry: 2000"
            assert next(lines) == "" and next(lines) == ": keep-alive"
    eventually(lambda: api_tasks(mounted) == 0, timeout=10)
