"""A local stand-in for a user's web ERP (stdlib ``ThreadingHTTPServer``, HTML forms, a session
cookie, PDFs from fpdf2) for the tests, demo and bench of the operations family. Run it with
``python -m pipelines.operations.peers.erp --port P`` (:func:`main`); it prints
``erp=http://127.0.0.1:P`` and serves until SIGTERM.

Pages (all but ``/login`` redirect (303) to ``/login?next=...`` without a session):

- ``GET/POST /login``: fields ``login``, ``password`` (``#login``, ``#password``, ``#submit``);
  any login with the peer's password gets the ``erp_session`` cookie and a 303 to ``next``; a
  wrong password or an empty login answers 401 with the form and ``#error``. ``/logout``.
  Each login sees its own records, generated from the seed and the login: customers
  ``C00001…``, products ``P00001…``, orders ``O00001…`` (client references ``RIF-00001…``).
- ``GET /customers`` (``?vat=`` exact lookup), ``/orders`` (``?clientRef=`` exact lookup),
  ``/products``: ``#export-pdf``, ``#lookup`` + ``#lookup-submit``, ``table#records`` with rows
  ``tr.record[data-code]``, ``#no-results`` when a lookup finds nothing, ``?page=`` (100 rows)
  with ``#page-info``, ``#prev-page``, ``#next-page``; ``#new-customer``, ``#new-order``.
- ``GET /{customers,orders,products}/export.pdf``: a PDF attachment; every page starts with a
  title ("Customers export") and the header line of column names, ends with "Page i of n";
  one record per line joined by ``" | "`` (customers: code, name, VAT number, city;
  orders: number, client reference, customer, date, lines ``P00001 x 2, …``, sent yes/no;
  products: code, description, unit, price).
- ``GET/POST /customers/new``: ``#vat`` (``vatNumber``), ``#name`` (``name``), ``#submit``;
  answers 200 with the code in ``#new-code``.
- ``GET/POST /orders/new`` (``GET ?lines=K`` for K line rows): ``#client-ref`` (``clientRef``),
  ``#customer-code`` (``customerCode``), ``#product-code-K``/``#qty-K`` (``productCode``/``qty``,
  repeated), ``#submit``; answers 200 with the number in ``#new-number``.
  A refused form (a missing field, a bad quantity, an unknown customer or product code, a name
  the PDFs cannot print or holding ``|``) answers **422** with the form and ``#error``
  (``data-code``: the unknown code), and stores nothing. A repeated client reference or VAT
  number is *not* refused (like the real ERP): a double write shows in ``/_peer/*``.
- ``GET /orders/{number}``: ``#order-number``, ``#client-ref``, ``#customer-code``,
  ``#sent-state`` ("sent"/"not sent", ``data-sent``), ``#send-to-verona`` (``POST
  /orders/{number}/send``, then 303 back here), ``#ddt-pdf`` (``/orders/{number}/ddt.pdf``).

Control, no auth, for tests only (never subject to faults, never in the log):
``POST /_peer/faults`` ``{"slow": {prefix: ms}, "hang": [prefixes], "fail": [prefixes],
"clear": true}`` (``clear`` first; a path under a ``hang`` prefix gets no answer until the
prefix is cleared, then is served; ``fail``: 500); ``GET /_peer/orders?login=L``,
``/_peer/customers?login=L``, ``/_peer/products?login=L``; ``GET /_peer/log`` (``?login=``)
``[{"login", "method", "path", "status", "start", "end"}]`` (epoch seconds), ``DELETE`` clears.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler
from types import FrameType
from typing import Any, Self
from urllib.parse import parse_qs, quote, urlsplit

from pipelines.loopback import LoopbackPeer
from pipelines.operations.peers import erp_pages as pages
from pipelines.operations.peers.erp_pages import Books, Customer, Order, generate_books
from pipelines.operations.peers.erp_pdf import as_json, ddt_pdf, export_pdf, export_rows

__all__ = ["ErpPeer", "main"]

COOKIE = "erp_session"
_MAX_BODY = 1 << 20
_HTML = "text/html; charset=utf-8"


@dataclass
class _Reply:
    status: int
    body: bytes = b""
    content_type: str = _HTML
    headers: dict[str, str] = field(default_factory=dict)
    login: str | None = None  # the login a successful POST /login opened


def _html(status: int, text: str) -> _Reply:
    return _Reply(status, text.encode("utf-8"))


def _redirect(location: str, **headers: str) -> _Reply:
    return _Reply(303, headers={"Location": location, **headers})


def _json(status: int, value: Any) -> _Reply:
    return _Reply(status, json.dumps(value).encode("utf-8"), "application/json")


def _pdf(body: bytes, filename: str) -> _Reply:
    return _Reply(200, body, "application/pdf", {"Content-Disposition": f'attachment; filename="{filename}"'})


class ErpPeer(LoopbackPeer):
    """The ERP on ``host``/``port`` (0: a free port): :meth:`start`, :meth:`stop` (idempotent;
    :meth:`start` listens again on the same port, records kept), :attr:`url`, a context
    manager. ``customers``/``orders``/``products``: how many each login starts with."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        password: str = "erp-pass",
        customers: int = 50,
        orders: int = 50,
        products: int = 20,
        seed: int = 0,
    ) -> None:
        if min(customers, orders, products) < 0:
            raise ValueError("customers, orders and products must be >= 0")
        if orders and not (customers and products):
            raise ValueError("orders need at least one customer and one product")
        super().__init__(host, port)
        self.seed = seed
        self._password = password
        self._sizes = (customers, orders, products)
        self._lock = threading.Lock()
        self._faults_changed = threading.Condition(self._lock)
        self._books: dict[str, Books] = {}
        self._sessions: dict[str, str] = {}
        self._slow: dict[str, float] = {}
        self._hang: list[str] = []
        self._fail: list[str] = []
        self._stopping = False
        self._log: list[dict[str, Any]] = []

    name = "erp"

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The handler of the ERP's pages and the control routes."""
        return self._handler_class()

    def start(self) -> Self:
        """Bind (a free port when ``port`` is 0) and serve in a daemon thread; returns the peer."""
        with self._lock:
            self._stopping = False
        return super().start()

    def stop(self) -> None:
        """Stop serving and close the socket; hung requests are let go (idempotent)."""
        with self._lock:
            self._stopping = True
            self._faults_changed.notify_all()
        super().stop()

    # Control (the same as the /_peer routes)

    def faults(
        self,
        slow: dict[str, float] | None = None,
        hang: list[str] | None = None,
        fail: list[str] | None = None,
        clear: bool = False,
    ) -> dict[str, Any]:
        """Add faults by path prefix (``clear`` first drops all and lets hung requests go);
        returns the faults in force. Raises ``ValueError`` on a bad value."""
        slow, hang, fail = dict(slow or {}), list(hang or []), list(fail or [])
        if not all(isinstance(p, str) and isinstance(ms, int | float) and ms >= 0 for p, ms in slow.items()):
            raise ValueError("slow must map path prefixes to milliseconds >= 0")
        if not all(isinstance(p, str) and p for p in [*hang, *fail]):
            raise ValueError("hang and fail must be lists of path prefixes")
        with self._lock:
            if clear:
                self._slow, self._hang, self._fail = {}, [], []
            self._slow.update({p: float(ms) for p, ms in slow.items()})
            self._hang += [p for p in hang if p not in self._hang]
            self._fail += [p for p in fail if p not in self._fail]
            self._faults_changed.notify_all()
            return {"slow": dict(self._slow), "hang": list(self._hang), "fail": list(self._fail)}

    def orders(self, login: str) -> list[dict[str, Any]]:
        """``login``'s orders: number, clientRef, customerCode, sent, sends, lines."""
        with self._lock:
            return as_json("orders", self._books_of(login))

    def customers(self, login: str) -> list[dict[str, Any]]:
        """``login``'s customers: code, name, vatNumber, city."""
        with self._lock:
            return as_json("customers", self._books_of(login))

    def products(self, login: str) -> list[dict[str, Any]]:
        """``login``'s products: code, description, unit, priceCents."""
        with self._lock:
            return as_json("products", self._books_of(login))

    def log(self, login: str | None = None) -> list[dict[str, Any]]:
        """Every request served but ``/_peer/*``, in order of their end (``login`` filters)."""
        with self._lock:
            return [dict(e) for e in self._log if login is None or e["login"] == login]

    def clear_log(self) -> None:
        """Forget the log."""
        with self._lock:
            self._log.clear()

    def _books_of(self, login: str) -> Books:
        # Under self._lock. Generated on first sight: the same records whenever they are made.
        books = self._books.get(login)
        if books is None:
            customers, orders, products = self._sizes
            books = self._books[login] = generate_books(self.seed, login, customers, orders, products)
        return books

    # Serving (the handler's threads)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # answers go out in two writes on kept-alive connections

            def _serve(self) -> None:
                peer._handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the peer keeps its own log

        return Handler

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        start = time.time()
        split = urlsplit(handler.path)
        path, method = split.path or "/", handler.command
        try:
            length = int(handler.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            handler.close_connection = True
            self._send(handler, _html(413, pages.error_page("Request body too large.", None)))
            return
        raw = handler.rfile.read(length) if length else b""
        query = parse_qs(split.query, keep_blank_values=True)
        if path.startswith("/_peer/"):
            self._send(handler, self._control(method, path, query, raw))
            return
        login = self._session(handler)
        if self._await_faults(path):
            reply = _html(500, pages.error_page("Internal server error.", login))
        else:
            try:
                reply = self._route(method, path, query, raw, login, split.query)
            except Exception:
                reply = _html(500, pages.error_page("Internal server error.", login))
        self._send(handler, reply)
        entry = {"login": reply.login or login, "method": method, "path": path, "status": reply.status}
        with self._lock:
            self._log.append({**entry, "start": start, "end": time.time()})

    def _send(self, handler: BaseHTTPRequestHandler, reply: _Reply) -> None:
        try:
            handler.send_response(reply.status)
            handler.send_header("Content-Type", reply.content_type)
            handler.send_header("Content-Length", str(len(reply.body)))
            handler.send_header("Cache-Control", "no-store")
            for name, value in reply.headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(reply.body)
        except OSError:
            handler.close_connection = True  # the client went away (e.g. timed out)

    def _session(self, handler: BaseHTTPRequestHandler) -> str | None:
        cookie = SimpleCookie()
        try:
            cookie.load(handler.headers.get("Cookie") or "")
        except CookieError:
            return None
        morsel = cookie.get(COOKIE)
        with self._lock:
            return self._sessions.get(morsel.value) if morsel is not None else None

    def _await_faults(self, path: str) -> bool:
        """Hold a hung path until its prefix is cleared, sleep a slow one; True: answer 500."""
        with self._lock:
            while not self._stopping and any(path.startswith(p) for p in self._hang):
                self._faults_changed.wait()
            delay = max((ms for p, ms in self._slow.items() if path.startswith(p)), default=0.0)
            fail = any(path.startswith(p) for p in self._fail)
        if delay:
            time.sleep(delay / 1000)
        return fail

    def _control(self, method: str, path: str, query: dict[str, list[str]], raw: bytes) -> _Reply:
        name = path.removeprefix("/_peer/")
        if name == "faults" and method == "POST":
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                return _json(200, self.faults(**body))
            except (TypeError, ValueError) as exc:
                return _json(400, {"error": str(exc)})
        if name == "log" and method == "GET":
            return _json(200, self.log(query.get("login", [None])[0]))
        if name == "log" and method == "DELETE":
            self.clear_log()
            return _json(200, {"cleared": True})
        if name in ("orders", "customers", "products") and method == "GET":
            login = query.get("login", [""])[0]
            if not login:
                return _json(400, {"error": "login is required"})
            return _json(200, getattr(self, name)(login))
        return _json(404, {"error": f"no route {method} {path}"})

    def _route(
        self, method: str, path: str, query: dict[str, list[str]], raw: bytes, login: str | None, qs: str
    ) -> _Reply:
        parts = [p for p in path.split("/") if p]
        form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True) if method == "POST" else {}
        if parts == ["login"]:
            return self._login(method, query, form)
        if parts == ["logout"]:
            return _redirect("/login", **{"Set-Cookie": f"{COOKIE}=; Path=/; Max-Age=0"})
        if login is None:
            return _redirect("/login?next=" + quote(path + (f"?{qs}" if qs else ""), safe=""))
        page = _int(query.get("page", ["1"])[0], 1)
        with self._lock:
            books = self._books_of(login)
            if parts == []:
                return _html(200, pages.home_page(login, books))
            if parts[0] in ("customers", "products", "orders") and len(parts) <= 2:
                kind = parts[0]
                if parts[1:] == ["new"] and kind != "products":
                    status, text = pages.form_page(kind, method, login, books, form, query)
                    return _html(status, text)
                if method != "GET":
                    return _html(405, pages.error_page("Method not allowed.", login))
                if parts[1:] == ["export.pdf"]:
                    title, columns, rows = export_rows(kind, books)
                elif len(parts) == 1:
                    return _html(200, pages.records_page(kind, login, books, query, page))
                else:
                    order = books.orders.get(parts[1]) if kind == "orders" else None
                    if order is None:
                        return _html(404, pages.error_page(f"No such record: {parts[1]}", login))
                    return _html(200, pages.order_page(login, order, _customer(books, order), books.products))
            elif len(parts) == 3 and parts[0] == "orders" and parts[2] in ("ddt.pdf", "send"):
                order = books.orders.get(parts[1])
                if order is None:
                    return _html(404, pages.error_page(f"No such order: {parts[1]}", login))
                if parts[2] == "send":
                    if method != "POST":
                        return _html(405, pages.error_page("Method not allowed.", login))
                    order.sends += 1
                    return _redirect(f"/orders/{order.number}")
                return _pdf(
                    ddt_pdf(order, _customer(books, order), books.products), f"DDT-{order.number}.pdf"
                )
            else:
                return _html(404, pages.error_page(f"No page {path}", login))
        # Rendered outside the lock: a large export takes a while.
        return _pdf(export_pdf(title, columns, rows), f"{parts[0]}.pdf")

    def _login(self, method: str, query: dict[str, list[str]], form: dict[str, list[str]]) -> _Reply:
        if method == "GET":
            return _html(200, pages.login_page(None, query.get("next", ["/"])[0]))
        login, password = _field(form, "login"), form.get("password", [""])[0]
        next_path = _field(form, "next") or "/"
        if not next_path.startswith("/") or next_path.startswith("//"):
            next_path = "/"
        if not login or not secrets.compare_digest(password.encode(), self._password.encode()):
            return _html(401, pages.login_page("Login refused: wrong login or password.", next_path))
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._books_of(login)
            self._sessions[token] = login
        cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax"
        reply = _redirect(next_path, **{"Set-Cookie": cookie})
        reply.login = login
        return reply


def _field(form: dict[str, list[str]], name: str) -> str:
    return (form.get(name) or [""])[0].strip()


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def _customer(books: Books, order: Order) -> Customer | None:
    return books.customers.get(order.customer_code)


def main(argv: Sequence[str] | None = None) -> int:
    """``conveyor ops erp-peer``: serve the ERP in the foreground until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="conveyor ops erp-peer", description="A local ERP for tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--password", default="erp-pass")
    parser.add_argument("--customers", type=int, default=50)
    parser.add_argument("--orders", type=int, default=50)
    parser.add_argument("--products", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    done = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    peer = ErpPeer(args.host, args.port, args.password, args.customers, args.orders, args.products, args.seed)
    with peer:
        print(f"erp={peer.url}", flush=True)
        while not done.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
