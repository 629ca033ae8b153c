"""The ERP's PDF exports and DDTs, read back with pypdf: pure parsing, no I/O.

An export (``/customers/export.pdf``, ``/orders/export.pdf``, ``/products/export.pdf``) is the
text pypdf's ``extract_text()`` reads page by page: a title line, the header line of column
names joined by ``" | "`` (on every page), one record per line with its fields joined the same
way, and a "Page i of n" footer. :func:`parse_export` turns it into frozen records keyed by
code (customers, products) or number (orders):

- a page without the header, a PDF pypdf cannot open or read, a footer that disagrees with the
  page count (a truncated or spliced file): :class:`ExportUnreadable`, a transient error (an
  unreadable export is most likely a cut-off download, worth another attempt);
- a line after the header that is not a record (the footer, "No records.", a blank line):
  skipped; a record line with the wrong number of fields or a field that does not parse (a bad
  code, date, price, order lines): one :class:`Rejected` (page, line number, reason) that never
  quotes the line, and the export goes on;
- a code seen twice: the first record is kept, the repeat counted in :attr:`Export.duplicates`.
"""

from __future__ import annotations

import datetime as dt
import io
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, overload

from pypdf import PdfReader
from pypdf.errors import PyPdfError

from conveyor.errors import TransientError

__all__ = [
    "COLUMNS",
    "DELIMITER",
    "Customer",
    "Export",
    "ExportUnreadable",
    "Kind",
    "Order",
    "OrderLine",
    "Product",
    "Record",
    "Rejected",
    "parse_ddt",
    "parse_export",
]

Kind = Literal["customers", "orders", "products"]

DELIMITER = " | "
COLUMNS: dict[str, tuple[str, ...]] = {
    "customers": ("Code", "Name", "VAT number", "City"),
    "orders": ("Number", "Client reference", "Customer", "Date", "Lines", "Sent"),
    "products": ("Code", "Description", "Unit", "Price"),
}

_CUSTOMER_CODE = re.compile(r"C\d{5,}")
_PRODUCT_CODE = re.compile(r"P\d{5,}")
_ORDER_NUMBER = re.compile(r"O\d{5,}")
_ORDER_LINE = re.compile(r"(P\d{5,}) x (\d+)")
_PRICE = re.compile(r"(\d+)\.(\d{2})")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_FOOTER = re.compile(r"Page (\d+) of (\d+)")
_NOT_RECORDS = frozenset({"", "No records."})

# Besides its own errors, a malformed PDF can make pypdf raise any of these (the list
# tasks.files.extract keeps for the same reason).
_PDF_FAILURES: tuple[type[Exception], ...] = (
    PyPdfError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    AssertionError,
    RecursionError,
    OverflowError,
    NotImplementedError,
    zlib.error,
)


class ExportUnreadable(TransientError):
    """The PDF cannot be read as the export (or DDT) it should be; ``page`` (1-based) names the
    page at fault, ``None`` when the file as a whole is. Transient: most likely a download cut
    short, which another attempt fixes. The message never quotes the document's bytes."""

    def __init__(self, message: str, *, page: int | None = None) -> None:
        super().__init__(message)
        self.page = page


@dataclass(frozen=True, slots=True)
class Customer:
    """A customer row: code (``C00001``), name, VAT number, city."""

    code: str
    name: str
    vat_number: str
    city: str

    @property
    def key(self) -> str:
        """The code."""
        return self.code


@dataclass(frozen=True, slots=True)
class Product:
    """A product row: code (``P00001``), description, unit, price in euro cents."""

    code: str
    description: str
    unit: str
    price_cents: int

    @property
    def key(self) -> str:
        """The code."""
        return self.code


@dataclass(frozen=True, slots=True)
class OrderLine:
    """One line of an order: a product code and a quantity above 0."""

    product_code: str
    qty: int


@dataclass(frozen=True, slots=True)
class Order:
    """An order row: number (``O00001``), client reference, customer code, date, lines, and
    whether it was sent to Verona."""

    number: str
    client_ref: str
    customer_code: str
    date: dt.date
    lines: tuple[OrderLine, ...]
    sent: bool

    @property
    def key(self) -> str:
        """The number."""
        return self.number


Record = Customer | Order | Product
R = TypeVar("R", Customer, Order, Product)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record line that did not parse: its page (1-based), its line number in that page's
    extracted text (1-based, the title is line 1) and why, never the line itself."""

    page: int
    line_no: int
    reason: str


@dataclass(frozen=True, slots=True)
class Export(Generic[R]):
    """A parsed export: its records (each code once, in the export's order), its page count,
    the lines rejected, and how many repeated codes were dropped."""

    kind: Kind
    records: list[R]
    pages: int
    rejected: list[Rejected]
    duplicates: int = 0

    def by_key(self) -> dict[str, R]:
        """The records by code (customers, products) or number (orders)."""
        return {record.key: record for record in self.records}


@overload
def parse_export(kind: Literal["customers"], pdf: bytes) -> Export[Customer]: ...
@overload
def parse_export(kind: Literal["orders"], pdf: bytes) -> Export[Order]: ...
@overload
def parse_export(kind: Literal["products"], pdf: bytes) -> Export[Product]: ...
def parse_export(kind: Kind, pdf: bytes) -> Export[Customer] | Export[Order] | Export[Product]:
    """Parse the ERP's ``kind`` export PDF (see the module docstring for what is skipped,
    rejected and refused). Raises :class:`ExportUnreadable` for a PDF pypdf cannot open or
    read, a page without the header, or a footer that disagrees with the page count."""
    if kind == "customers":
        return _parse(kind, pdf, _customer)
    if kind == "orders":
        return _parse(kind, pdf, _order)
    if kind == "products":
        return _parse(kind, pdf, _product)
    raise ValueError(f"unknown export kind {kind!r}: customers, orders or products")


def parse_ddt(pdf: bytes) -> int:
    """The page count of an order's DDT PDF, once every page's text could be read. Raises
    :class:`ExportUnreadable` for a PDF pypdf cannot open or read, or one without pages."""
    return len(_page_texts("DDT", pdf))


def _parse(kind: Kind, pdf: bytes, parse_row: Callable[[list[str]], R | str]) -> Export[R]:
    texts = _page_texts(f"{kind} export", pdf)
    columns = list(COLUMNS[kind])
    records: dict[str, R] = {}
    rejected: list[Rejected] = []
    duplicates = 0
    for page, text in enumerate(texts, start=1):
        lines = [line.strip() for line in text.splitlines()]
        fields = [_fields(line) for line in lines]
        try:
            header = fields.index(columns)
        except ValueError:
            raise ExportUnreadable(
                f"{kind} export unreadable: page {page} of {len(texts)} has no header line", page=page
            ) from None
        # Lines above the header are the page's title.
        for line_no in range(header + 2, len(lines) + 1):
            line = lines[line_no - 1]
            if line in _NOT_RECORDS:
                continue
            footer = _FOOTER.fullmatch(line)
            if footer is not None:
                if (int(footer[1]), int(footer[2])) != (page, len(texts)):
                    raise ExportUnreadable(
                        f"{kind} export unreadable: page {page} of {len(texts)} is numbered "
                        f"{footer[1]} of {footer[2]}",
                        page=page,
                    )
                continue
            row = fields[line_no - 1]
            if len(row) != len(columns):
                reason = f"{len(row)} fields where the header has {len(columns)}"
                rejected.append(Rejected(page, line_no, reason))
                continue
            parsed = parse_row(row)
            if isinstance(parsed, str):
                rejected.append(Rejected(page, line_no, parsed))
            elif parsed.key in records:
                duplicates += 1
            else:
                records[parsed.key] = parsed
    return Export(kind, list(records.values()), len(texts), rejected, duplicates)


def _page_texts(what: str, pdf: bytes) -> list[str]:
    """Every page's extracted text; :class:`ExportUnreadable` naming no bytes of the file."""
    try:
        reader = PdfReader(io.BytesIO(pdf))
        count = len(reader.pages)
    except _PDF_FAILURES:
        raise ExportUnreadable(f"{what} unreadable: not a complete PDF (cut short or damaged)") from None
    if count == 0:
        raise ExportUnreadable(f"{what} unreadable: the PDF has no pages")
    texts: list[str] = []
    for page in range(1, count + 1):
        try:
            texts.append(reader.pages[page - 1].extract_text())
        except _PDF_FAILURES:
            raise ExportUnreadable(
                f"{what} unreadable: page {page} of {count} cannot be read", page=page
            ) from None
    return texts


def _fields(line: str) -> list[str]:
    # Split on the bare bar and strip: extraction may not keep the spaces around it exactly,
    # and the ERP refuses "|" inside any field.
    return [field.strip() for field in line.split("|")]


def _customer(row: list[str]) -> Customer | str:
    code, name, vat_number, city = row
    if not _CUSTOMER_CODE.fullmatch(code):
        return "bad customer code"
    if not name or not vat_number or not city:
        return "empty name, VAT number or city"
    return Customer(code, name, vat_number, city)


def _product(row: list[str]) -> Product | str:
    code, description, unit, price = row
    if not _PRODUCT_CODE.fullmatch(code):
        return "bad product code"
    if not description or not unit:
        return "empty description or unit"
    cents = _PRICE.fullmatch(price)
    if cents is None:
        return "bad price"
    return Product(code, description, unit, int(cents[1]) * 100 + int(cents[2]))


def _order(row: list[str]) -> Order | str:
    number, client_ref, customer_code, day, lines_text, sent = row
    if not _ORDER_NUMBER.fullmatch(number):
        return "bad order number"
    if not client_ref:
        return "empty client reference"
    if not _CUSTOMER_CODE.fullmatch(customer_code):
        return "bad customer code"
    try:
        # fromisoformat alone would also take "20260917" and week dates.
        date = dt.date.fromisoformat(day) if _DATE.fullmatch(day) else None
    except ValueError:
        date = None
    if date is None:
        return "bad date"
    lines: list[OrderLine] = []
    for part in lines_text.split(","):
        line = _ORDER_LINE.fullmatch(part.strip())
        if line is None or int(line[2]) <= 0:
            return "bad order lines"
        lines.append(OrderLine(line[1], int(line[2])))
    if sent not in ("yes", "no"):
        return "bad sent state"
    return Order(number, client_ref, customer_code, date, tuple(lines), sent == "yes")
