"""The shop serves Conveyor's HTTP API itself: ``config/wsgi.py`` mounts it under
/conveyor, on the shop's own client. Served here by a real WSGI server (wsgiref, in a
thread) running that ``application``, as gunicorn would."""

import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
import requests

from conveyor.contrib import django as conveyor
from conveyor.web import tokens

pytestmark = pytest.mark.django_db(transaction=True)


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def served() -> Iterator[str]:
    from config.wsgi import application

    server: WSGIServer = make_server("127.0.0.1", 0, application, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_job_submitted_over_the_mounted_api_runs(served: str, deployment_worker: object) -> None:
    secret = tokens.create(
        conveyor.client().connections.engine, owner="shop", scopes=("read", "submit")
    ).secret
    bearer = {"Authorization": f"Bearer {secret}"}
    created = requests.post(
        f"{served}/conveyor/jobs",
        json={"stage": "conveyor.demo.square", "payload": {"n": 8}},
        headers=bearer,
        timeout=10,
    )
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert created.headers["Location"] == f"/conveyor/jobs/{job_id}"
    # The API's client is the project's: the job is in Django's (test) database.
    assert conveyor.job(job_id).wait(30) == "succeeded"
    shown = requests.get(f"{served}{created.headers['Location']}", headers=bearer, timeout=10).json()
    assert shown["status"] == "succeeded" and shown["result"] == {"n": 64} and shown["owner"] == "shop"

    refused = requests.get(f"{served}/conveyor/jobs/{job_id}", timeout=10)
    assert refused.status_code == 401 and refused.json()["instance"] == f"/conveyor/jobs/{job_id}"
    assert requests.get(f"{served}/conveyor/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{served}/orders", timeout=10).status_code == 404  # Django's own URLs
