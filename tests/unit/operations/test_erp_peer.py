"""The ERP peer over real HTTP on loopback, driven as a browser would (forms, a cookie jar):
login, per-login generated records, the PDF exports read back with pypdf, the forms and their
refusals, Send to Verona, DDTs, faults, the control routes and the foreground process."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pypdf import PdfReader

from pipelines.operations.peers.erp import ErpPeer

PASSWORD = "erp-pass"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def peer() -> Iterator[ErpPeer]:
    with ErpPeer(customers=50, orders=40, products=20, seed=7) as running:
        yield running


@contextmanager
def _client(peer: ErpPeer, login: str | None = "mario", timeout: float = 10.0) -> Iterator[httpx.Client]:
    """A browser-like client (cookie jar, no redirects followed), logged in as ``login``."""
    with httpx.Client(base_url=peer.url, timeout=timeout) as client:
        if login is not None:
            answer = client.post("/login", data={"login": login, "password": PASSWORD, "next": "/orders"})
            assert answer.status_code == 303 and answer.headers["location"] == "/orders"
        yield client


def _element(html: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', html)
    assert found, f"no #{element_id} in the page"
    return found.group(1)


def _codes(html: str) -> list[str]:
    return re.findall(r'<tr class="record" data-code="([^"]+)"', html)


def _pdf_pages(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/pdf"
    assert answer.headers["content-disposition"].startswith("attachment; filename=")
    reader = PdfReader(io.BytesIO(answer.content))
    # Nothing but the visible text: no producer, XMP, attachments or form fields.
    assert set(reader.metadata or {}) <= {"/CreationDate"}
    assert "/Metadata" not in reader.root_object and not reader.attachments
    assert reader.get_fields() is None
    return [page.extract_text() for page in reader.pages]


def test_wrong_password_and_empty_login_are_refused(peer: ErpPeer) -> None:
    with _client(peer, None) as client:
        for login, password in (("mario", "nope"), ("", PASSWORD)):
            answer = client.post("/login", data={"login": login, "password": password})
            assert answer.status_code == 401 and "Login refused" in _element(answer.text, "error")
            assert "set-cookie" not in answer.headers
        assert client.get("/customers").status_code == 303
        login_page = client.get("/login").text
        assert all(f'id="{name}"' in login_page for name in ("login", "password", "submit"))


def test_not_logged_in_redirects_to_login(peer: ErpPeer) -> None:
    with _client(peer, None) as anonymous:
        for path in ("/", "/orders?clientRef=RIF-00001", "/customers/export.pdf", "/orders/O00001/ddt.pdf"):
            answer = anonymous.get(path)
            assert answer.status_code == 303 and answer.headers["location"].startswith("/login?next=")
        assert anonymous.post("/orders/O00001/send").status_code == 303
        assert anonymous.post("/customers/new", data={"vatNumber": "IT1", "name": "X"}).status_code == 303
    with _client(peer) as client:
        assert client.get("/customers").status_code == 200
        assert client.get("/logout").status_code == 303
        client.cookies.clear()
        assert client.get("/customers").status_code == 303
    assert peer.customers("mario")[-1]["code"] == "C00050"  # nothing created by the anonymous posts


def test_each_login_sees_its_own_reproducible_records(peer: ErpPeer) -> None:
    with ErpPeer(customers=50, orders=40, products=20, seed=7) as twin:
        assert twin.customers("mario") == peer.customers("mario")
        assert twin.orders("mario") == peer.orders("mario")
    assert peer.customers("luigi") != peer.customers("mario")
    with ErpPeer(customers=50, orders=40, products=20, seed=8) as other_seed:
        assert other_seed.customers("mario") != peer.customers("mario")
    with _client(peer) as client:
        assert _codes(client.get("/customers").text) == [f"C{i:05d}" for i in range(1, 51)]
        assert _codes(client.get("/products").text) == [f"P{i:05d}" for i in range(1, 21)]
        assert _codes(client.get("/orders").text) == [f"O{i:05d}" for i in range(1, 41)]
    orders = peer.orders("mario")
    codes = {c["code"] for c in peer.customers("mario")}
    assert {o["customerCode"] for o in orders} <= codes and orders[0]["clientRef"] == "RIF-00001"
    names = " ".join(c["name"] for c in peer.customers("mario"))
    assert re.search(r"[àèéìòùäöüÀ-ÿ]", names), "the generated names carry accents"


def test_customers_export_is_multipage_with_every_record_once() -> None:
    with ErpPeer(customers=300, orders=5, products=5, seed=3) as peer, _client(peer) as client:
        for vat, name in (
            ("IT00000000001", "Società Agricola Müller & Figli"),
            ("IT00000000002", "Caffè Nerò"),
        ):
            assert client.post("/customers/new", data={"vatNumber": vat, "name": name}).status_code == 200
        page = client.get("/customers")
        assert 'id="export-pdf" href="/customers/export.pdf"' in page.text
        texts = _pdf_pages(client.get("/customers/export.pdf"))
        assert len(texts) >= 3
        lines = [line for text in texts for line in text.splitlines()]
        for text in texts:
            assert text.splitlines()[:2] == ["Customers export", "Code | Name | VAT number | City"]
        expected = [
            " | ".join((c["code"], c["name"], c["vatNumber"], c["city"])) for c in peer.customers("mario")
        ]
        assert len(expected) == 302
        assert [line for line in lines if re.match(r"C\d{5} \| ", line)] == expected
        assert "C00301 | Società Agricola Müller & Figli | IT00000000001 | Verona" in lines
        assert "C00302 | Caffè Nerò | IT00000000002 | Verona" in lines


def test_orders_and_products_exports(peer: ErpPeer) -> None:
    with _client(peer) as client:
        order_lines = [
            line for text in _pdf_pages(client.get("/orders/export.pdf")) for line in text.splitlines()
        ]
        product_lines = [
            line for text in _pdf_pages(client.get("/products/export.pdf")) for line in text.splitlines()
        ]
    records = [line for line in order_lines if re.match(r"O\d{5} \| ", line)]
    assert [line.split(" | ")[:3] for line in records] == [
        [o["number"], o["clientRef"], o["customerCode"]] for o in peer.orders("mario")
    ]
    assert order_lines[1] == "Number | Client reference | Customer | Date | Lines | Sent"
    products = [line.split(" | ") for line in product_lines if re.match(r"P\d{5} \| ", line)]
    assert [(p[0], p[1]) for p in products] == [(p["code"], p["description"]) for p in peer.products("mario")]


def test_create_customer_answers_its_code_and_vat_lookup_finds_it(peer: ErpPeer) -> None:
    with _client(peer) as client:
        assert 'id="vat"' in client.get("/customers/new").text
        answer = client.post("/customers/new", data={"vatNumber": "IT 12345678901", "name": "Caffè Nerò"})
        assert answer.status_code == 200 and _element(answer.text, "new-code") == "C00051"
        assert _codes(client.get("/customers", params={"vat": "IT12345678901"}).text) == ["C00051"]
        missing = client.get("/customers", params={"vat": "IT99999999999"}).text
        assert _codes(missing) == [] and 'id="no-results"' in missing
        refused = client.post("/customers/new", data={"vatNumber": "IT1", "name": ""})
        assert refused.status_code == 422 and "required" in _element(refused.text, "error")
    assert peer.customers("mario")[-1] == {
        "code": "C00051",
        "name": "Caffè Nerò",
        "vatNumber": "IT12345678901",
        "city": "Verona",
    }
    assert len(peer.customers("mario")) == 51 and len(peer.customers("luigi")) == 50


def test_create_order_answers_its_number_and_client_ref_lookup_finds_it(peer: ErpPeer) -> None:
    form = {
        "clientRef": "PO-77",
        "customerCode": "C00003",
        "productCode": ["P00002", "p00005", ""],
        "qty": ["2", "7", ""],
    }
    with _client(peer) as client:
        blank = client.get("/orders/new", params={"lines": "8"}).text
        assert 'id="product-code-8"' in blank and 'id="client-ref"' in blank
        answer = client.post("/orders/new", data=form)
        assert answer.status_code == 200 and _element(answer.text, "new-number") == "O00041"
        assert _codes(client.get("/orders", params={"clientRef": "PO-77"}).text) == ["O00041"]
        assert 'id="no-results"' in client.get("/orders", params={"clientRef": "PO-78"}).text
        page = client.get("/orders/O00041").text
        assert _element(page, "client-ref") == "PO-77" and _element(page, "sent-state") == "not sent"
    assert peer.orders("mario")[-1] == {
        "number": "O00041",
        "clientRef": "PO-77",
        "customerCode": "C00003",
        "sent": False,
        "sends": 0,
        "lines": [{"productCode": "P00002", "qty": 2}, {"productCode": "P00005", "qty": 7}],
    }


@pytest.mark.parametrize(
    ("customer", "product", "qty", "named"),
    [
        ("C00001", "P99999", "1", "P99999"),
        ("C99999", "P00001", "1", "C99999"),
        ("C00001", "P00001", "0", "P00001"),
        ("C00001", "P00001", "-2", "P00001"),
    ],
)
def test_a_refused_order_names_the_code_and_stores_nothing(
    peer: ErpPeer, customer: str, product: str, qty: str, named: str
) -> None:
    with _client(peer) as client:
        form = {"clientRef": "PO-1", "customerCode": customer, "productCode": product, "qty": qty}
        answer = client.post("/orders/new", data=form)
        assert answer.status_code == 422
        assert named in _element(answer.text, "error")
        assert re.search(rf'id="error"[^>]*data-code="{named}"', answer.text)
        assert 'id="order-form"' in answer.text and 'id="new-number"' not in answer.text
        assert _codes(client.get("/orders", params={"clientRef": "PO-1"}).text) == []
    assert len(peer.orders("mario")) == 40


def test_send_to_verona_shows_on_the_order_page(peer: ErpPeer) -> None:
    unsent = next(o["number"] for o in peer.orders("mario") if not o["sent"])
    with _client(peer) as client:
        page = client.get(f"/orders/{unsent}").text
        assert re.search(r'id="sent-state" data-sent="false">not sent<', page)
        assert 'id="send-to-verona"' in page
        answer = client.post(f"/orders/{unsent}/send")
        assert answer.status_code == 303 and answer.headers["location"] == f"/orders/{unsent}"
        assert re.search(r'id="sent-state" data-sent="true">sent<', client.get(f"/orders/{unsent}").text)
        assert client.get(f"/orders/{unsent}/send").status_code == 405
        assert client.post("/orders/O99999/send").status_code == 404
    sent = next(o for o in peer.orders("mario") if o["number"] == unsent)
    assert sent["sent"] is True and sent["sends"] == 1


def test_each_order_has_its_ddt_pdf(peer: ErpPeer) -> None:
    with _client(peer) as client:
        for order in peer.orders("mario")[:3]:
            answer = client.get(f"/orders/{order['number']}/ddt.pdf")
            assert f'filename="DDT-{order["number"]}.pdf"' in answer.headers["content-disposition"]
            text = "\n".join(_pdf_pages(answer))
            assert f"Order: {order['number']}" in text and f"Client reference: {order['clientRef']}" in text
            for line in order["lines"]:
                assert re.search(rf"^{line['productCode']} \| .+ \| {line['qty']}$", text, re.M)
            assert f"Consignee: {order['customerCode']} | " in text
        assert client.get("/orders/O99999/ddt.pdf").status_code == 404


def test_faults_slow_fail_hang_and_clear(peer: ErpPeer) -> None:
    control = httpx.Client(base_url=peer.url, timeout=5)
    with control, _client(peer) as client, _client(peer, "mario", timeout=0.5) as impatient:
        faults = control.post(
            "/_peer/faults", json={"slow": {"/products": 300}, "fail": ["/orders/O0"]}
        ).json()
        assert faults == {"slow": {"/products": 300.0}, "hang": [], "fail": ["/orders/O0"]}
        started = time.monotonic()
        assert client.get("/products").status_code == 200
        assert time.monotonic() - started >= 0.3
        started = time.monotonic()
        assert client.get("/customers").status_code == 200 and time.monotonic() - started < 0.3
        failed = client.get("/orders/O00001")
        assert failed.status_code == 500 and 'id="error"' in failed.text
        assert client.get("/orders").status_code == 200

        control.post("/_peer/faults", json={"hang": ["/customers"]})
        with pytest.raises(httpx.ReadTimeout):
            impatient.get("/customers")
        assert control.get("/_peer/log").status_code == 200  # control is never held
        assert control.post("/_peer/faults", json={"clear": True}).json() == {
            "slow": {},
            "hang": [],
            "fail": [],
        }
        started = time.monotonic()
        assert client.get("/customers").status_code == 200 and time.monotonic() - started < 0.3
        assert client.get("/orders/O00001").status_code == 200
        assert control.post("/_peer/faults", json={"slow": {"/x": -1}}).status_code == 400
        assert control.post("/_peer/faults", json={"storm": 3}).status_code == 400


def test_a_held_request_is_served_once_its_prefix_is_cleared(peer: ErpPeer) -> None:
    peer.faults(hang=["/orders"])
    answers: list[int] = []
    with _client(peer) as client:
        waiter = threading.Thread(target=lambda: answers.append(client.get("/orders/O00002").status_code))
        waiter.start()
        time.sleep(0.3)
        assert answers == []
        peer.faults(clear=True)
        waiter.join(5)
    assert answers == [200]


def test_control_routes(peer: ErpPeer) -> None:
    with _client(peer, "anna") as client:
        client.get("/customers")
        client.post("/customers/new", data={"vatNumber": "IT55", "name": "Noël"})
    with httpx.Client(base_url=peer.url) as control:
        orders = control.get("/_peer/orders", params={"login": "anna"}).json()
        assert len(orders) == 40 and {"number", "clientRef", "customerCode"} <= set(orders[0])
        customers = control.get("/_peer/customers", params={"login": "anna"}).json()
        assert customers[-1]["code"] == "C00051" and customers[-1]["name"] == "Noël"
        assert control.get("/_peer/orders").status_code == 400
        log = control.get("/_peer/log", params={"login": "anna"}).json()
        assert [(e["method"], e["path"], e["status"]) for e in log] == [
            ("POST", "/login", 303),
            ("GET", "/customers", 200),
            ("POST", "/customers/new", 200),
        ]
        assert all(isinstance(e["start"], float) and e["start"] <= e["end"] <= time.time() for e in log)
        assert all(not e["path"].startswith("/_peer") for e in control.get("/_peer/log").json())
        assert control.delete("/_peer/log").status_code == 200 and control.get("/_peer/log").json() == []


def test_concurrent_creations_get_distinct_codes(peer: ErpPeer) -> None:
    codes: list[str] = []

    def create(k: int) -> None:
        with _client(peer) as client:
            answer = client.post("/customers/new", data={"vatNumber": f"IT{k:011d}", "name": f"Cliente {k}"})
            codes.append(_element(answer.text, "new-code"))

    threads = [threading.Thread(target=create, args=(k,)) for k in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(codes) == [f"C{i:05d}" for i in range(51, 63)]


def test_list_pages_paginate() -> None:
    with ErpPeer(customers=250, orders=0, products=1) as peer, _client(peer) as client:
        second = client.get("/customers", params={"page": 2}).text
        assert _codes(second) == [f"C{i:05d}" for i in range(101, 201)]
        assert _element(second, "page-info") == "Page 2 of 3"
        assert 'id="next-page" href="/customers?page=3"' in second and 'id="prev-page"' in second


def test_main_serves_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipelines.operations.peers.erp",
            "--port",
            "0",
            "--customers",
            "3",
            "--seed",
            "5",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert re.fullmatch(r"erp=http://127\.0\.0\.1:\d+", line)
        url = line.removeprefix("erp=")
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/login").status_code == 200
            assert len(client.get("/_peer/customers", params={"login": "x"}).json()) == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
