"""The syncs' PDF parsing (tasks.operations.exports) on real exports: the ERP peer renders them
over HTTP on loopback (a logged-in client downloads ``/{kind}/export.pdf`` and the DDT), the
peer's control routes give the truth; damaged and odd exports are built with fpdf2."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fpdf import FPDF

from conveyor.errors import TransientError
from pipelines.operations.peers.erp import ErpPeer
from tasks.operations.exports import (
    Customer,
    ExportUnreadable,
    Order,
    OrderLine,
    Product,
    Rejected,
    parse_ddt,
    parse_export,
)

PASSWORD = "erp-pass"
LOGIN = "mario"
CUSTOMERS_HEADER = "Code | Name | VAT number | City"


@pytest.fixture(scope="module")
def peer() -> Iterator[ErpPeer]:
    with ErpPeer(password=PASSWORD, customers=300, orders=150, products=40, seed=11) as running:
        yield running


@contextmanager
def _client(peer: ErpPeer, login: str = LOGIN) -> Iterator[httpx.Client]:
    """A browser-like client (cookie jar), logged in as ``login``."""
    with httpx.Client(base_url=peer.url, timeout=10.0) as client:
        answer = client.post("/login", data={"login": login, "password": PASSWORD, "next": "/"})
        assert answer.status_code == 303
        yield client


def _download(client: httpx.Client, path: str) -> bytes:
    answer = client.get(path)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/pdf"
    assert answer.headers["content-disposition"].startswith("attachment;")
    return answer.content


def _truth(peer: ErpPeer, kind: str, login: str = LOGIN) -> list[dict[str, Any]]:
    answer = httpx.get(f"{peer.url}/_peer/{kind}", params={"login": login}, timeout=10.0)
    assert answer.status_code == 200
    records: list[dict[str, Any]] = answer.json()
    return records


def _pdf(pages: list[list[str]]) -> bytes:
    """A PDF laid out like the ERP's exports: each page's lines, one per line, never wrapped."""
    pdf = FPDF(orientation="L", unit="mm", format="A4")
    pdf.core_fonts_encoding = "windows-1252"
    pdf.set_auto_page_break(False)
    for lines in pages:
        pdf.add_page()
        pdf.set_font("Helvetica", size=9)
        for line in lines:
            pdf.cell(0, 5, line, new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def test_customers_export_holds_every_record_once_with_accents_intact(peer: ErpPeer) -> None:
    with _client(peer) as client:
        export = parse_export("customers", _download(client, "/customers/export.pdf"))
    truth = _truth(peer, "customers")
    assert len(truth) == 300 and export.pages > 1
    assert export.rejected == [] and export.duplicates == 0
    expected = [Customer(c["code"], c["name"], c["vatNumber"], c["city"]) for c in truth]
    assert export.records == expected
    assert export.by_key()["C00300"] == expected[-1]
    accented = [c.name for c in export.records if not c.name.isascii()]
    assert accented and any(ch in "".join(accented) for ch in "àèéìòùäöüÈ")
    assert any(not c.city.isascii() for c in export.records)


def test_orders_and_products_exports_match_the_peer(peer: ErpPeer) -> None:
    with _client(peer) as client:
        orders = parse_export("orders", _download(client, "/orders/export.pdf"))
        products = parse_export("products", _download(client, "/products/export.pdf"))
    assert orders.pages > 1 and orders.rejected == [] and orders.duplicates == 0
    truth = _truth(peer, "orders")
    assert [(o.number, o.client_ref, o.customer_code, o.sent) for o in orders.records] == [
        (o["number"], o["clientRef"], o["customerCode"], o["sent"]) for o in truth
    ]
    assert [list(o.lines) for o in orders.records] == [
        [OrderLine(line["productCode"], line["qty"]) for line in o["lines"]] for o in truth
    ]
    assert all(isinstance(o.date, dt.date) for o in orders.records)
    assert any(o.sent for o in orders.records) and not all(o.sent for o in orders.records)
    assert products.rejected == [] and products.pages >= 1
    assert products.records == [
        Product(p["code"], p["description"], p["unit"], p["priceCents"]) for p in _truth(peer, "products")
    ]


def test_an_empty_export_has_no_records() -> None:
    with ErpPeer(password=PASSWORD, customers=0, orders=0, products=0) as empty, _client(empty) as client:
        for kind in ("customers", "orders", "products"):
            export = parse_export(kind, _download(client, f"/{kind}/export.pdf"))
            assert (export.records, export.pages, export.rejected, export.duplicates) == ([], 1, [], 0)


def test_a_truncated_or_foreign_file_is_unreadable_and_transient(peer: ErpPeer) -> None:
    with _client(peer) as client:
        whole = _download(client, "/customers/export.pdf")
    for damaged in (whole[: len(whole) // 2], whole[: len(whole) - 200], b"", b"<html>Login</html>"):
        with pytest.raises(ExportUnreadable) as caught:
            parse_export("customers", damaged)
        assert isinstance(caught.value, TransientError)
        assert "customers export unreadable" in str(caught.value)
        assert "C000" not in str(caught.value) and "html" not in str(caught.value)


def test_a_page_without_the_header_is_unreadable_naming_the_page() -> None:
    pdf = _pdf(
        [
            [
                "Customers export",
                CUSTOMERS_HEADER,
                "C00001 | Caffè Nerò | IT01234567890 | Forlì",
                "Page 1 of 3",
            ],
            ["Customers export", "C00002 | Enoteca Müller | IT01234567891 | Cantù", "Page 2 of 3"],
            [
                "Customers export",
                CUSTOMERS_HEADER,
                "C00003 | Noël & C. | IT01234567892 | Aosta",
                "Page 3 of 3",
            ],
        ]
    )
    with pytest.raises(ExportUnreadable, match="page 2 of 3 has no header line") as caught:
        parse_export("customers", pdf)
    assert caught.value.page == 2


def test_an_export_of_another_kind_or_a_spliced_one_is_unreadable(peer: ErpPeer) -> None:
    with _client(peer) as client:
        orders = _download(client, "/orders/export.pdf")
    with pytest.raises(ExportUnreadable, match="page 1 ") as caught:
        parse_export("customers", orders)
    assert caught.value.page == 1
    # Two pages whose footers say there were three: pages went missing.
    row = "C00001 | Caffè Nerò | IT01234567890 | Forlì"
    pdf = _pdf([["Customers export", CUSTOMERS_HEADER, row, f"Page {i} of 3"] for i in (1, 2)])
    with pytest.raises(ExportUnreadable, match="numbered 1 of 3") as caught:
        parse_export("customers", pdf)
    assert caught.value.page == 1


def test_malformed_lines_are_rejected_without_their_text_and_repeats_kept_once() -> None:
    pdf = _pdf(
        [
            [
                "Customers export",
                CUSTOMERS_HEADER,
                "C00001 | Società Agricola Gröber S.r.l. | IT01234567890 | Sant'Agata",  # 3
                "C00002 | Trattoria Zanè | IT01234567891",  # 4: a field short
                "X00003 | Caseificio Rossi | IT01234567892 | Trento",  # 5: bad code
                "",
                "C00001 | Società Agricola Gröber S.r.l. | IT01234567890 | Sant'Agata",  # 7: repeat
                "Page 1 of 2",
            ],
            [
                "Customers export",
                CUSTOMERS_HEADER,
                "C00004 | Caffè Nerò | IT01234567893 | Forlì | extra",  # 3: a field too many
                "C00005 | Pasticceria Lüthi | IT01234567894 | Mölten",
                "Page 2 of 2",
            ],
        ]
    )
    export = parse_export("customers", pdf)
    assert [c.code for c in export.records] == ["C00001", "C00005"]
    assert export.records[0].name == "Società Agricola Gröber S.r.l." and export.records[1].city == "Mölten"
    assert export.duplicates == 1 and export.pages == 2
    assert [(r.page, r.line_no) for r in export.rejected] == [(1, 4), (1, 5), (2, 3)]
    assert export.rejected[0] == Rejected(1, 4, "3 fields where the header has 4")
    assert export.rejected[1].reason == "bad customer code"
    for rejected in export.rejected:
        assert not any(word in rejected.reason for word in ("Zanè", "X00003", "Rossi", "extra", "IT0"))


def test_bad_order_and_product_fields_are_rejected() -> None:
    header = "Number | Client reference | Customer | Date | Lines | Sent"
    orders = _pdf(
        [
            [
                "Orders export",
                header,
                "O00001 | RIF-00001 | C00004 | 2026-03-01 | P00001 x 2, P00007 x 10 | yes",
                "O00002 | RIF-00002 | C00004 | 01/03/2026 | P00001 x 2 | no",
                "O00003 | RIF-00003 | C00004 | 2026-03-01 | P00001 x 0 | no",
                "O00004 | RIF-00004 | C00004 | 2026-03-01 | P00001 x 2 | maybe",
                "O00005 | RIF-00005 | 42 | 2026-03-01 | P00001 x 2 | no",
                "Page 1 of 1",
            ]
        ]
    )
    export = parse_export("orders", orders)
    assert export.records == [
        Order(
            "O00001",
            "RIF-00001",
            "C00004",
            dt.date(2026, 3, 1),
            (OrderLine("P00001", 2), OrderLine("P00007", 10)),
            True,
        )
    ]
    assert [(r.line_no, r.reason) for r in export.rejected] == [
        (4, "bad date"),
        (5, "bad order lines"),
        (6, "bad sent state"),
        (7, "bad customer code"),
    ]
    products = _pdf(
        [
            [
                "Products export",
                "Code | Description | Unit | Price",
                "P00001 | Tè verde 100 g | pz | 2,50",
                "P00002 | Pâté | pz | 3.10",
            ]
        ]
    )
    export_p = parse_export("products", products)
    assert export_p.records == [Product("P00002", "Pâté", "pz", 310)]
    assert export_p.rejected == [Rejected(1, 3, "bad price")]


def test_ddt_page_count(peer: ErpPeer) -> None:
    with _client(peer) as client:
        ddt = _download(client, "/orders/O00001/ddt.pdf")
    assert parse_ddt(ddt) == 1
    with pytest.raises(ExportUnreadable, match="DDT unreadable"):
        parse_ddt(ddt[: len(ddt) // 2])
