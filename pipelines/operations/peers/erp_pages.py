"""What the ERP peer shows: its records (one :class:`Books` per login, generated from the seed
and the login) and the HTML of its pages. The element ids are listed in
:mod:`pipelines.operations.peers.erp`'s docstring; the pages are plain HTML, no scripts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import date, timedelta
from html import escape
from urllib.parse import quote

__all__ = [
    "PAGE_SIZE",
    "Books",
    "Customer",
    "Order",
    "OrderLine",
    "Product",
    "Refused",
    "customer_created",
    "customer_form",
    "error_page",
    "form_page",
    "generate_books",
    "home_page",
    "list_page",
    "login_page",
    "new_customer",
    "new_order",
    "order_created",
    "order_form",
    "order_page",
    "records_page",
]

PAGE_SIZE = 100
ORDER_FORM_ROWS = 5

# Every name prints in a PDF core font (cp1252) and none holds the exports' " | " delimiter.
_TRADES = (
    "Società Agricola", "Caffè", "Trattoria", "Pasticceria", "Ferramenta", "Cantina",
    "Macelleria", "Oleificio", "Caseificio", "Panificio", "Enoteca", "Gelateria", "Distilleria",
)  # fmt: skip
_FAMILIES = (
    "Müller", "Nerò", "Bianchi", "Rossi", "Zanè", "Bortolàn", "D'Agostino", "Ferrè", "Cortès",
    "Gröber", "Lüthi", "Pavanèllo", "Sartori", "Benedètti", "Noël", "Hofstätter", "Dalla Fontàna",
)  # fmt: skip
_FORMS = ("& Figli", "S.r.l.", "S.p.A.", "S.n.c.", "& C.", "")
_CITIES = ("Verona", "Bolzano", "Forlì", "Cantù", "Canicattì", "Sant'Agata", "Mölten", "Aosta", "Trento")
_GOODS = (
    ("Caffè in grani 1 kg", "kg"), ("Parmigiano Reggiano 24 mesi", "kg"), ("Pâté di fegato 200 g", "pz"),
    ("Crème fraîche 250 ml", "pz"), ("Olio extra vergine 1 L", "lt"), ("Speck Alto Adige IGP", "kg"),
    ("Grappa di Moscato 70 cl", "pz"), ("Farina tipo 00 25 kg", "cf"), ("Würstel di suino", "cf"),
    ("Tè verde 100 g", "pz"), ("Amaretti di Saronno", "cf"), ("Gnocchi di patate 500 g", "pz"),
)  # fmt: skip


@dataclass
class Customer:
    """A customer: ``C00001``-style code, name, VAT number (``IT`` + 11 digits), city."""

    code: str
    name: str
    vat_number: str
    city: str


@dataclass
class Product:
    """A product: ``P00001``-style code, description, unit, price in euro cents."""

    code: str
    description: str
    unit: str
    price_cents: int


@dataclass
class OrderLine:
    """One line of an order."""

    product_code: str
    qty: int


@dataclass
class Order:
    """An order: ``O00001``-style number, the client's reference, its customer, its day, lines,
    and how many times it was sent to Verona (sent when at least once)."""

    number: str
    client_ref: str
    customer_code: str
    day: date
    lines: list[OrderLine]
    sends: int = 0

    @property
    def sent(self) -> bool:
        """Whether the order was sent to Verona."""
        return self.sends > 0


@dataclass
class Books:
    """One login's records, by code, in creation order."""

    customers: dict[str, Customer] = field(default_factory=dict)
    products: dict[str, Product] = field(default_factory=dict)
    orders: dict[str, Order] = field(default_factory=dict)

    def next_customer_code(self) -> str:
        """The code the next customer gets."""
        return f"C{len(self.customers) + 1:05d}"

    def next_order_number(self) -> str:
        """The number the next order gets."""
        return f"O{len(self.orders) + 1:05d}"


def generate_books(seed: int, login: str, customers: int, orders: int, products: int) -> Books:
    """``login``'s records: the same for the same seed and login, different for another login."""
    rng = random.Random(f"erp:{seed}:{login}")
    books = Books()
    vats: set[str] = set()
    for i in range(1, customers + 1):
        name = f"{rng.choice(_TRADES)} {rng.choice(_FAMILIES)} {rng.choice(_FORMS)}".strip()
        vat = f"IT{rng.randrange(10**11):011d}"
        while vat in vats:
            vat = f"IT{rng.randrange(10**11):011d}"
        vats.add(vat)
        books.customers[f"C{i:05d}"] = Customer(f"C{i:05d}", name, vat, rng.choice(_CITIES))
    for i in range(1, products + 1):
        description, unit = rng.choice(_GOODS)
        code = f"P{i:05d}"
        books.products[code] = Product(code, description, unit, rng.randrange(150, 9000))
    customer_codes, product_codes = list(books.customers), list(books.products)
    for i in range(1, orders + 1):
        lines = [
            OrderLine(code, rng.randrange(1, 25))
            for code in rng.sample(product_codes, min(len(product_codes), rng.randrange(1, 4)))
        ]
        number = f"O{i:05d}"
        books.orders[number] = Order(
            number,
            f"RIF-{i:05d}",
            rng.choice(customer_codes),
            date(2026, 1, 2) + timedelta(days=rng.randrange(300)),
            lines,
            sends=1 if rng.random() < 0.3 else 0,
        )
    return books


class Refused(Exception):
    """A form the ERP refuses: the message for ``#error`` and the code it names, if any."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _printable(text: str, what: str) -> None:
    try:
        text.encode("cp1252")
    except UnicodeEncodeError:
        raise Refused(f"{what} holds characters the ERP cannot print.") from None
    if "|" in text:
        raise Refused(f"{what} must not hold '|'.")


def new_customer(books: Books, vat: str, name: str) -> Customer:
    """Store a customer under the next code; :class:`Refused` when a field is missing or unprintable."""
    if not vat or not name:
        raise Refused("VAT number and name are required.")
    _printable(name, "The name")
    _printable(vat, "The VAT number")
    customer = Customer(books.next_customer_code(), name[:120], vat.upper().replace(" ", ""), "Verona")
    books.customers[customer.code] = customer
    return customer


def new_order(books: Books, client_ref: str, customer_code: str, pairs: list[tuple[str, str]]) -> Order:
    """Store an order of (product code, qty text) lines under the next number; :class:`Refused`
    (naming the code) for an unknown customer or product, a bad quantity, a missing field."""
    if not client_ref:
        raise Refused("Client reference is required.")
    _printable(client_ref, "The client reference")
    if customer_code not in books.customers:
        raise Refused(f"Unknown customer code: {customer_code or '(empty)'}", customer_code)
    if not pairs:
        raise Refused("An order needs at least one line.")
    lines: list[OrderLine] = []
    for product, qty in pairs:
        if product not in books.products:
            raise Refused(f"Unknown product code: {product or '(empty)'}", product)
        if not qty.isdigit() or int(qty) <= 0:
            raise Refused(f"Quantity for {product} must be a whole number above 0.", product)
        lines.append(OrderLine(product, int(qty)))
    order = Order(books.next_order_number(), client_ref, customer_code, date.today(), lines)
    books.orders[order.number] = order
    return order


def _field(form: dict[str, list[str]], name: str) -> str:
    return (form.get(name) or [""])[0].strip()


def form_page(
    kind: str, method: str, login: str, books: Books, form: dict[str, list[str]], query: dict[str, list[str]]
) -> tuple[int, str]:
    """``GET``/``POST /{kind}/new`` (customers, orders): the form, or the stored record's page
    (200), or the form with ``#error`` (422). The caller holds the books' lock."""
    if kind == "customers":
        vat, name = _field(form, "vatNumber"), _field(form, "name")
        if method != "POST":
            return 200, customer_form(login, None)
        try:
            return 200, customer_created(login, new_customer(books, vat, name))
        except Refused as refused:
            return 422, customer_form(login, refused.message, vat, name)
    if method != "POST":
        wanted = query.get("lines", ["0"])[0]
        rows = min(int(wanted), 200) if wanted.isdigit() else 0
        return 200, order_form(login, None, rows=max(rows, ORDER_FORM_ROWS))
    client_ref, customer_code = _field(form, "clientRef"), _field(form, "customerCode").upper()
    products, qtys = form.get("productCode", []), form.get("qty", [])
    pairs = [
        (p.strip().upper(), q.strip()) for p, q in zip(products, qtys + [""] * len(products), strict=False)
    ]
    try:
        order = new_order(books, client_ref, customer_code, [(p, q) for p, q in pairs if p or q])
    except Refused as refused:
        return 422, order_form(login, refused.message, refused.code, client_ref, customer_code, pairs)
    return 200, order_created(login, order)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _layout(title: str, body: str, login: str | None) -> str:
    nav = ""
    if login is not None:
        nav = (
            '<nav><a id="nav-customers" href="/customers">Customers</a> '
            '<a id="nav-orders" href="/orders">Orders</a> '
            '<a id="nav-products" href="/products">Products</a> '
            f'<span id="user">{_e(login)}</span> <a id="logout" href="/logout">Log out</a></nav>'
        )
    return (
        '<!DOCTYPE html><html lang="it"><head><meta charset="utf-8">'
        f'<title>{_e(title)} - ERP</title></head><body>{nav}<h1 id="title">{_e(title)}</h1>'
        f"{body}</body></html>"
    )


def _error(message: str | None, code: str | None = None) -> str:
    if not message:
        return ""
    data = f' data-code="{_e(code)}"' if code else ""
    return f'<p id="error" class="error"{data}>{_e(message)}</p>'


def login_page(error: str | None, next_path: str) -> str:
    """The login form."""
    body = (
        f'{_error(error)}<form id="login-form" method="post" action="/login">'
        f'<input type="hidden" name="next" value="{_e(next_path)}">'
        '<label for="login">Login</label> <input id="login" name="login" type="text"> '
        '<label for="password">Password</label> <input id="password" name="password" type="password"> '
        '<button id="submit" type="submit">Log in</button></form>'
    )
    return _layout("Login", body, None)


def home_page(login: str, books: Books) -> str:
    """The start page after login."""
    body = (
        f'<p id="counts">{len(books.customers)} customers, {len(books.orders)} orders, '
        f"{len(books.products)} products</p>"
    )
    return _layout("ERP", body, login)


def list_page(
    kind: str,
    login: str,
    columns: list[str],
    rows: list[tuple[str, list[str]]],
    page: int,
    lookup: tuple[str, str, str] | None,
) -> str:
    """A list page of ``kind`` (``customers``, ``orders``, ``products``): the Export PDF link,
    a lookup form (``lookup``: input name, label, current value), the table of ``rows``
    (code, cells; page ``page`` of :data:`PAGE_SIZE` rows) and the pager."""
    pages = max(1, -(-len(rows) // PAGE_SIZE))
    page = min(max(page, 1), pages)
    shown = rows[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    parts = [f'<p><a id="export-pdf" href="/{kind}/export.pdf">Export PDF</a>']
    if kind in ("customers", "orders"):
        parts.append(f' <a id="new-{kind[:-1]}" href="/{kind}/new">New {kind[:-1]}</a>')
    parts.append("</p>")
    filtered = ""
    if lookup is not None:
        name, label, value = lookup
        parts.append(
            f'<form id="lookup-form" method="get" action="/{kind}"><label for="lookup">{_e(label)}</label> '
            f'<input id="lookup" name="{name}" type="text" value="{_e(value)}"> '
            '<button id="lookup-submit" type="submit">Search</button></form>'
        )
        if value:
            filtered = f"&{name}={quote(value)}"
            if not rows:
                parts.append(f'<p id="no-results">No {kind} found for {_e(value)}.</p>')
    header = "".join(f"<th>{_e(c)}</th>" for c in columns)
    parts.append(f'<table id="records" data-count="{len(rows)}"><thead><tr>{header}</tr></thead><tbody>')
    for code, cells in shown:
        tds = "".join(f"<td>{cell}</td>" for cell in cells)
        parts.append(f'<tr class="record" data-code="{_e(code)}">{tds}</tr>')
    parts.append(f'</tbody></table><p id="page-info">Page {page} of {pages}</p>')
    if page > 1:
        parts.append(f'<a id="prev-page" href="/{kind}?page={page - 1}{filtered}">Previous</a> ')
    if page < pages:
        parts.append(f'<a id="next-page" href="/{kind}?page={page + 1}{filtered}">Next</a>')
    return _layout(kind.capitalize(), "".join(parts), login)


def records_page(kind: str, login: str, books: Books, query: dict[str, list[str]], page: int) -> str:
    """The list page of ``kind``, narrowed by its lookup (``vat``, ``clientRef``) when given."""
    if kind == "customers":
        vat = query.get("vat", [""])[0].strip().upper().replace(" ", "")
        found = [c for c in books.customers.values() if not vat or c.vat_number == vat]
        rows = [(c.code, [_e(x) for x in (c.code, c.name, c.vat_number, c.city)]) for c in found]
        columns, lookup = ["Code", "Name", "VAT number", "City"], ("vat", "VAT number", vat)
    elif kind == "orders":
        ref = query.get("clientRef", [""])[0].strip()
        rows = [
            (
                o.number,
                [f'<a class="order-link" href="/orders/{o.number}">{o.number}</a>']
                + [_e(x) for x in (o.client_ref, o.customer_code, o.day.isoformat())]
                + ["sent" if o.sent else "not sent"],
            )
            for o in books.orders.values()
            if not ref or o.client_ref == ref
        ]
        columns, lookup = (
            ["Number", "Client reference", "Customer", "Date", "Verona"],
            ("clientRef", "Client reference", ref),
        )
    else:
        rows = [
            (p.code, [_e(x) for x in (p.code, p.description, p.unit, f"{p.price_cents / 100:.2f}")])
            for p in books.products.values()
        ]
        columns, lookup = ["Code", "Description", "Unit", "Price"], None
    return list_page(kind, login, columns, rows, page, lookup)


def customer_form(login: str, error: str | None, vat_number: str = "", name: str = "") -> str:
    """The new-customer form, with ``error`` (``#error``) when the last post was refused."""
    body = (
        f'{_error(error)}<form id="customer-form" method="post" action="/customers/new">'
        f'<label for="vat">VAT number</label> <input id="vat" name="vatNumber" value="{_e(vat_number)}"> '
        f'<label for="name">Name</label> <input id="name" name="name" value="{_e(name)}"> '
        '<button id="submit" type="submit">Create customer</button></form>'
    )
    return _layout("New customer", body, login)


def customer_created(login: str, customer: Customer) -> str:
    """The answer to a created customer: its code in ``#new-code``."""
    body = (
        f'<p id="created">Customer created: <span id="new-code">{_e(customer.code)}</span> '
        f'({_e(customer.name)}, {_e(customer.vat_number)})</p><a href="/customers">Customers</a>'
    )
    return _layout("Customer created", body, login)


def order_form(
    login: str,
    error: str | None,
    error_code: str | None = None,
    client_ref: str = "",
    customer_code: str = "",
    lines: list[tuple[str, str]] | None = None,
    rows: int = ORDER_FORM_ROWS,
) -> str:
    """The new-order form: ``#client-ref``, ``#customer-code`` and ``rows`` line rows
    (``#product-code-K``/``#qty-K``, K from 1); ``#error`` (``data-code``: the code refused)."""
    lines = list(lines or [])
    rows = max(rows, len(lines), 1)
    lines += [("", "")] * (rows - len(lines))
    cells = "".join(
        f'<tr><td><input id="product-code-{k}" name="productCode" value="{_e(product)}"></td>'
        f'<td><input id="qty-{k}" name="qty" value="{_e(qty)}"></td></tr>'
        for k, (product, qty) in enumerate(lines, start=1)
    )
    body = (
        f'{_error(error, error_code)}<form id="order-form" method="post" action="/orders/new">'
        f'<label for="client-ref">Client reference</label> '
        f'<input id="client-ref" name="clientRef" value="{_e(client_ref)}"> '
        f'<label for="customer-code">Customer code</label> '
        f'<input id="customer-code" name="customerCode" value="{_e(customer_code)}">'
        f'<table id="lines"><thead><tr><th>Product code</th><th>Qty</th></tr></thead><tbody>{cells}'
        '</tbody></table><button id="submit" type="submit">Create order</button></form>'
    )
    return _layout("New order", body, login)


def order_created(login: str, order: Order) -> str:
    """The answer to a created order: its number in ``#new-number``."""
    body = (
        f'<p id="created">Order created: <span id="new-number">{_e(order.number)}</span> '
        f"(client reference {_e(order.client_ref)})</p>"
        f'<a id="order-link" href="/orders/{_e(order.number)}">Open order</a>'
    )
    return _layout("Order created", body, login)


def order_page(login: str, order: Order, customer: Customer | None, products: dict[str, Product]) -> str:
    """An order: its fields, lines, ``#sent-state`` (``data-sent``), the Send to Verona button
    and the DDT link."""
    name = customer.name if customer else ""
    rows = "".join(
        f'<tr class="line"><td>{_e(line.product_code)}</td>'
        f"<td>{_e(products[line.product_code].description if line.product_code in products else '')}</td>"
        f"<td>{line.qty}</td></tr>"
        for line in order.lines
    )
    sent = "true" if order.sent else "false"
    body = (
        f'<dl><dt>Number</dt><dd id="order-number">{_e(order.number)}</dd>'
        f'<dt>Client reference</dt><dd id="client-ref">{_e(order.client_ref)}</dd>'
        f'<dt>Customer</dt><dd id="customer-code">{_e(order.customer_code)}</dd>'
        f'<dd id="customer-name">{_e(name)}</dd><dt>Date</dt><dd id="order-date">{order.day.isoformat()}</dd>'
        f'<dt>Verona</dt><dd id="sent-state" data-sent="{sent}">{"sent" if order.sent else "not sent"}</dd>'
        f'</dl><table id="lines"><thead><tr><th>Product</th><th>Description</th><th>Qty</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>"
        f'<form id="send-form" method="post" action="/orders/{_e(order.number)}/send">'
        '<button id="send-to-verona" type="submit">Send to Verona</button></form>'
        f'<p><a id="ddt-pdf" href="/orders/{_e(order.number)}/ddt.pdf">DDT PDF</a></p>'
    )
    return _layout(f"Order {order.number}", body, login)


def error_page(message: str, login: str | None) -> str:
    """A page saying what went wrong in ``#error``."""
    return _layout("Error", _error(message), login)
