"""The ERP peer's PDFs (fpdf2, core font Helvetica in cp1252): list exports, one record per line
joined by :data:`DELIMITER` under a header line repeated on every page, and an order's DDT.
Only visible text: no attachments, no XMP, no producer, a fixed creation date. Also the
records as the control routes answer them in JSON (:func:`as_json`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fpdf import FPDF

from pipelines.operations.peers.erp_pages import Books, Customer, Order, Product

__all__ = ["DELIMITER", "as_json", "ddt_pdf", "export_pdf", "export_rows"]

DELIMITER = " | "
_LINE_MM = 5.0
_FIXED_DATE = datetime(2026, 1, 1, tzinfo=UTC)


class _Document(FPDF):
    """An A4 document repeating ``title`` and ``header_line`` at the top of every page."""

    def __init__(self, title: str, header_line: str, landscape: bool) -> None:
        super().__init__(orientation="L" if landscape else "P", unit="mm", format="A4")
        # Accented Latin names and the euro sign print with the core fonts in cp1252.
        self.core_fonts_encoding = "windows-1252"
        self.set_producer("")
        self.set_creation_date(_FIXED_DATE)
        self.set_auto_page_break(True, margin=15)
        self.doc_title = title
        self.header_line = header_line

    def header(self) -> None:
        self.set_font("Helvetica", "B", 11)
        self.cell(0, 7, self.doc_title, new_x="LMARGIN", new_y="NEXT")
        if self.header_line:
            self.set_font("Helvetica", "B", 9)
            self.cell(0, _LINE_MM, self.header_line, new_x="LMARGIN", new_y="NEXT")
        self.set_font("Helvetica", "", 9)

    def footer(self) -> None:
        self.set_y(-12)
        self.set_font("Helvetica", "", 8)
        self.cell(0, 5, f"Page {self.page_no()} of {{nb}}", align="R")

    def line_of_text(self, text: str) -> None:
        """One line, never wrapped (a long line runs past the margin rather than split)."""
        self.cell(0, _LINE_MM, text, new_x="LMARGIN", new_y="NEXT")

    def to_bytes(self) -> bytes:
        """The finished PDF."""
        return bytes(self.output())


def export_pdf(title: str, columns: list[str], rows: list[list[str]]) -> bytes:
    """A list export: ``title`` and the columns joined by :data:`DELIMITER` on every page, then
    each row on its own line."""
    pdf = _Document(title, DELIMITER.join(columns), landscape=True)
    pdf.add_page()
    if not rows:
        pdf.line_of_text("No records.")
    for row in rows:
        pdf.line_of_text(DELIMITER.join(row))
    return pdf.to_bytes()


def ddt_pdf(order: Order, customer: Customer | None, products: dict[str, Product]) -> bytes:
    """An order's transport document (DDT): number, date, client reference, consignee, lines."""
    pdf = _Document(f"Documento di trasporto (DDT) {order.number}", "", landscape=False)
    pdf.add_page()
    pdf.line_of_text(f"Order: {order.number}")
    pdf.line_of_text(f"Date: {order.day.isoformat()}")
    pdf.line_of_text(f"Client reference: {order.client_ref}")
    if customer is not None:
        pdf.line_of_text(f"Consignee: {customer.code}{DELIMITER}{customer.name}{DELIMITER}{customer.city}")
        pdf.line_of_text(f"VAT number: {customer.vat_number}")
    else:
        pdf.line_of_text(f"Consignee: {order.customer_code}")
    pdf.line_of_text("")
    pdf.line_of_text(DELIMITER.join(("Product", "Description", "Unit", "Qty")))
    for line in order.lines:
        product = products.get(line.product_code)
        description, unit = (product.description, product.unit) if product else ("", "")
        pdf.line_of_text(DELIMITER.join((line.product_code, description, unit, str(line.qty))))
    pdf.line_of_text("")
    pdf.line_of_text(f"Sent to Verona: {'yes' if order.sent else 'no'}")
    return pdf.to_bytes()


def export_rows(kind: str, books: Books) -> tuple[str, list[str], list[list[str]]]:
    """The title, columns and rows of ``kind``'s export (``customers``, ``orders``, ``products``)."""
    title = f"{kind.capitalize()} export"
    if kind == "customers":
        rows = [[c.code, c.name, c.vat_number, c.city] for c in books.customers.values()]
        return title, ["Code", "Name", "VAT number", "City"], rows
    if kind == "orders":
        rows = [
            [
                o.number, o.client_ref, o.customer_code, o.day.isoformat(),
                ", ".join(f"{line.product_code} x {line.qty}" for line in o.lines), "yes" if o.sent else "no",
            ]
            for o in books.orders.values()
        ]  # fmt: skip
        return title, ["Number", "Client reference", "Customer", "Date", "Lines", "Sent"], rows
    rows = [[p.code, p.description, p.unit, f"{p.price_cents / 100:.2f}"] for p in books.products.values()]
    return title, ["Code", "Description", "Unit", "Price"], rows


def as_json(kind: str, books: Books) -> list[dict[str, Any]]:
    """``kind``'s records as the control routes answer them (``/_peer/orders`` etc.)."""
    if kind == "orders":
        return [
            {
                "number": o.number,
                "clientRef": o.client_ref,
                "customerCode": o.customer_code,
                "sent": o.sent,
                "sends": o.sends,
                "lines": [{"productCode": line.product_code, "qty": line.qty} for line in o.lines],
            }
            for o in books.orders.values()
        ]
    if kind == "customers":
        return [
            {"code": c.code, "name": c.name, "vatNumber": c.vat_number, "city": c.city}
            for c in books.customers.values()
        ]
    return [
        {"code": p.code, "description": p.description, "unit": p.unit, "priceCents": p.price_cents}
        for p in books.products.values()
    ]
