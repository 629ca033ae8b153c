"""A local stand-in for the brokers' trade-history APIs (Coinbase-like and Binance-like rows,
stdlib ``ThreadingHTTPServer``), for the tests, demos and benchmarks of the trading family.

- ``PUT /_peer/users/{userId}`` ``{"broker", "token", "trades": [...]}`` sets what that token
  sees; rows are served verbatim, malformed ones too (any JSON value).
- ``GET /v1/{broker}/trades?since=YYYY-MM-DD&cursor=C`` with ``Authorization: Bearer <token>``
  answers ``{"trades", "next", "percent"}``: cursor pages (opaque, stable: the same cursor gives
  the same page) over the rows not known to be before ``since`` (a row whose time does not
  parse is served), ``X-RateLimit-Remaining``/``X-RateLimit-Reset`` on every answer.
- ``POST /_peer/faults`` (``{"clear": true}`` resets): ``page_size``, ``latency_ms``,
  ``rate_per_s`` (per token, 1-second windows; 0 = unlimited), ``storm`` (the next n trade
  requests answer 429 with ``Retry-After: retry_after_s``), ``garbage_page`` (page k, 1-based
  offset // page_size + 1, answers 200 with a body that is not JSON, every time).
- ``GET /_peer/log`` / ``DELETE /_peer/log``: every trades request served, in order.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from pipelines.loopback import (
    LoopbackPeer,
    PeerError,
    json_object,
    quiet_handler,
)

__all__ = ["BROKERS", "BrokerPeer", "sample_trades"]

BROKERS = ("coinbase", "binance")
DEFAULT_PAGE_SIZE = 50
_UNLIMITED_REMAINING = 1000
_GARBAGE = b"<html><body><h1>502 Bad Gateway</h1>upstream sent an incomplete page</body></html>"
_FAULT_FIELDS = ("page_size", "latency_ms", "rate_per_s", "storm", "retry_after_s", "garbage_page")


@dataclass
class _Faults:
    page_size: int = DEFAULT_PAGE_SIZE
    latency_ms: float = 0.0
    rate_per_s: int = 0
    storm: int = 0
    retry_after_s: float = 1.0
    garbage_page: int | None = None


@dataclass
class _Account:
    user_id: str
    broker: str
    token: str
    trades: list[Any]


@dataclass
class _Window:
    started: float
    count: int = 0


@dataclass
class _Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class BrokerPeer(LoopbackPeer):
    """Broker trade-history APIs on ``host`` and ``port`` (0: the OS picks a free one); see the
    module's docstring. Usable as a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self._lock = threading.Lock()
        self._accounts: dict[tuple[str, str], _Account] = {}
        self._by_token: dict[str, _Account] = {}
        self._faults = _Faults()
        self._windows: dict[str, _Window] = {}
        self._log: list[dict[str, Any]] = []

    name = "broker"

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The handler of this peer's routes."""
        return quiet_handler(self._handle)

    # Control (the same as the /_peer routes)

    def set_user(self, user_id: str, broker: str, token: str, trades: list[Any]) -> None:
        """Make ``token`` see ``trades`` (served verbatim) at ``broker`` for ``user_id``; replaces
        that user's earlier rows and token at that broker."""
        if broker not in BROKERS:
            raise ValueError(f"unknown broker {broker!r}; expected one of {', '.join(BROKERS)}")
        if not isinstance(token, str) or not token:
            raise ValueError("token must be a non-empty string")
        if not isinstance(trades, list):
            raise ValueError("trades must be a list")
        account = _Account(user_id, broker, token, list(trades))
        with self._lock:
            old = self._accounts.get((user_id, broker))
            if old is not None:
                self._by_token.pop(old.token, None)
            other = self._by_token.get(token)
            if other is not None:
                # One token, one account: the later assignment wins.
                self._accounts.pop((other.user_id, other.broker), None)
            self._accounts[(user_id, broker)] = account
            self._by_token[token] = account

    def faults(self, **fields: Any) -> dict[str, Any]:
        """Set fault fields (see the module's docstring); ``clear=True`` first resets all.
        Returns the faults now in force. Raises ``ValueError`` on an unknown or bad field."""
        with self._lock:
            faults = _Faults() if fields.pop("clear", False) else _Faults(**vars(self._faults))
            for name, value in fields.items():
                if name not in _FAULT_FIELDS:
                    raise ValueError(f"unknown fault {name!r}; known: {', '.join(_FAULT_FIELDS)}")
                setattr(faults, name, _fault_value(name, value))
            self._faults = faults
            if "rate_per_s" in fields:
                self._windows.clear()
            return dict(vars(faults))

    def log(self) -> list[dict[str, Any]]:
        """Every trades request served, in order: ``{"user", "broker", "cursor", "page",
        "status"}`` (``user`` ``None`` for an unknown token, ``page`` ``None`` for a bad cursor)."""
        with self._lock:
            return [dict(entry) for entry in self._log]

    def clear_log(self) -> None:
        """Forget the log."""
        with self._lock:
            self._log.clear()

    # Serving (called from the handler's threads)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        split = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            reply = self._route(method, split.path, dict(parse_qsl(split.query)), handler, raw)
        except PeerError as exc:
            reply = _json_reply(exc.status, {"error": exc.message}, exc.headers)
        try:
            handler.send_response(reply.status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(reply.body)))
            for name, value in reply.headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(reply.body)
        except OSError:
            handler.close_connection = True  # the client went away (e.g. timed out)

    def _route(
        self, method: str, path: str, query: dict[str, str], handler: BaseHTTPRequestHandler, raw: bytes
    ) -> _Reply:
        parts = [unquote(p) for p in path.split("/") if p]
        if parts[:1] == ["_peer"]:
            return self._control(method, parts[1:], raw)
        if len(parts) == 3 and parts[0] == "v1" and parts[2] == "trades" and method == "GET":
            return self._trades(parts[1], query, handler.headers.get("Authorization") or "")
        raise PeerError(404, f"no route {method} {path}")

    def _control(self, method: str, parts: list[str], raw: bytes) -> _Reply:
        if parts == ["faults"] and method == "POST":
            body = json_object(raw)
            try:
                return _json_reply(200, self.faults(**body))
            except (TypeError, ValueError) as exc:
                raise PeerError(400, str(exc)) from None
        if parts == ["log"] and method == "GET":
            return _json_reply(200, self.log())
        if parts == ["log"] and method == "DELETE":
            self.clear_log()
            return _json_reply(200, {"cleared": True})
        if len(parts) == 2 and parts[0] == "users" and method == "PUT":
            body = json_object(raw)
            broker, token, trades = body.get("broker"), body.get("token"), body.get("trades")
            if not isinstance(broker, str) or not isinstance(token, str) or not isinstance(trades, list):
                raise PeerError(400, "expected {broker: str, token: str, trades: list}")
            try:
                self.set_user(parts[1], broker, token, trades)
            except ValueError as exc:
                raise PeerError(400, str(exc)) from None
            return _json_reply(200, {"user": parts[1], "broker": broker, "rows": len(trades)})
        raise PeerError(404, f"no route {method} /_peer/{'/'.join(parts)}")

    def _trades(self, broker: str, query: dict[str, str], authorization: str) -> _Reply:
        with self._lock:
            faults = self._faults
        if faults.latency_ms > 0:
            time.sleep(faults.latency_ms / 1000)
        token = authorization[len("Bearer ") :].strip() if authorization.startswith("Bearer ") else ""
        cursor = query.get("cursor") or None
        offset = _decode_cursor(cursor)
        page = offset // faults.page_size + 1 if offset is not None else None
        with self._lock:
            account = self._by_token.get(token) if token else None
            user = account.user_id if account is not None else None
            entry: dict[str, Any] = {"user": user, "broker": broker, "cursor": cursor, "page": page}
            try:
                headers = self._admit(token)
            except PeerError as exc:
                self._log.append({**entry, "status": exc.status})
                raise
            try:
                if broker not in BROKERS:
                    raise PeerError(404, f"unknown broker {broker!r}")
                if account is None or account.broker != broker:
                    raise PeerError(401, "invalid or expired token")
                if offset is None:
                    raise PeerError(400, "invalid cursor")
                since = _parse_since(query.get("since"))
                rows = [r for r in account.trades if not _before(broker, r, since)]
            except PeerError as exc:
                exc.headers.update(headers)
                self._log.append({**entry, "status": exc.status})
                raise
            self._log.append({**entry, "status": 200})
        if page == faults.garbage_page:
            return _Reply(200, _GARBAGE, headers)  # labelled JSON, like a broken gateway would
        chunk = rows[offset : offset + faults.page_size]
        end = offset + len(chunk)
        answer = {
            "trades": chunk,
            "next": _encode_cursor(end) if end < len(rows) else None,
            "percent": round(100.0 * end / len(rows), 2) if rows else 100.0,
        }
        return _json_reply(200, answer, headers)

    def _admit(self, token: str) -> dict[str, str]:
        """The rate-limit headers of an admitted request; raises a 429 ``PeerError`` during a
        storm or past the window's budget. Holds ``self._lock``."""
        faults = self._faults
        if faults.storm > 0:
            faults.storm -= 1
            wait = faults.retry_after_s
            raise PeerError(429, "rate limited (storm)", _limit_headers(0, wait, retry_after=wait))
        if faults.rate_per_s <= 0:
            return _limit_headers(_UNLIMITED_REMAINING, 0.0)
        now = time.monotonic()
        window = self._windows.get(token)
        if window is None or now - window.started >= 1.0:
            window = self._windows[token] = _Window(now)
        reset = max(0.0, window.started + 1.0 - now)
        if window.count >= faults.rate_per_s:
            raise PeerError(429, "rate limited", _limit_headers(0, reset, retry_after=reset))
        window.count += 1
        return _limit_headers(faults.rate_per_s - window.count, reset)


def _limit_headers(remaining: int, reset: float, *, retry_after: float | None = None) -> dict[str, str]:
    headers = {"X-RateLimit-Remaining": str(remaining), "X-RateLimit-Reset": f"{reset:.3f}"}
    if retry_after is not None:
        headers["Retry-After"] = f"{retry_after:.3f}".rstrip("0").rstrip(".") or "0"
    return headers


def _fault_value(name: str, value: Any) -> Any:
    if name == "garbage_page":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("garbage_page must be a page number >= 1 or null")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{name} must be a number >= 0")
    if name in ("latency_ms", "retry_after_s"):
        return float(value)
    if int(value) != value:
        raise ValueError(f"{name} must be an integer")
    if name == "page_size" and value < 1:
        raise ValueError("page_size must be >= 1")
    return int(value)


def _json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Reply:
    return _Reply(status, json.dumps(payload).encode(), dict(headers or {}))


def _encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> int | None:
    """The offset a cursor stands for (0 for none), ``None`` when it is not one of ours."""
    if cursor is None:
        return 0
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    prefix, _, number = text.partition(":")
    if prefix != "offset" or not number.isdigit():
        return None
    return int(number)


def _parse_since(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.combine(date.fromisoformat(value), datetime.min.time(), UTC)
    except ValueError:
        raise PeerError(400, "since must be a date YYYY-MM-DD") from None


def _row_time(broker: str, row: Any) -> datetime | None:
    """A row's time when it parses (naive ISO taken as UTC), else ``None``."""
    if not isinstance(row, dict):
        return None
    try:
        if broker == "coinbase":
            value = row.get("created_at")
            if not isinstance(value, str):
                return None
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
        value = row.get("time")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return datetime.fromtimestamp(value / 1000, UTC)
    except (ValueError, OverflowError, OSError):
        return None


def _before(broker: str, row: Any, since: datetime | None) -> bool:
    if since is None:
        return False
    ts = _row_time(broker, row)
    return ts is not None and ts < since


# Sample data

_SYMBOLS = {
    "coinbase": (("BTC-USD", 43_000.0, 0.5), ("ETH-USD", 2_300.0, 5.0), ("SOL-USD", 100.0, 40.0)),
    "binance": (("BTCUSDT", 43_000.0, 0.5), ("ETHUSDT", 2_300.0, 5.0)),
}
_FEE_RATE = {"coinbase": 0.006, "binance": 0.001}
_ROW_KEYS = {
    "coinbase": ("trade_id", "product_id", "side", "size", "price", "fee", "created_at"),
    "binance": ("id", "symbol", "isBuyer", "qty", "price", "commission", "time"),
}


def sample_trades(broker: str, n: int, *, start: datetime, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` well-formed rows in ``broker``'s shape, oldest first from ``start`` (naive: UTC):
    times minutes to hours apart, prices on a per-symbol random walk, sells never beyond what
    was bought. The same arguments give the same rows."""
    if broker not in _SYMBOLS:
        raise ValueError(f"unknown broker {broker!r}; expected one of {', '.join(BROKERS)}")
    rng = random.Random(f"{broker}:{seed}")
    ts = start if start.tzinfo is not None else start.replace(tzinfo=UTC)
    prices = {symbol: base * rng.uniform(0.9, 1.1) for symbol, base, _ in _SYMBOLS[broker]}
    held = {symbol: 0.0 for symbol, _, _ in _SYMBOLS[broker]}
    first_id = rng.randrange(10**8, 9 * 10**8)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        step = timedelta(minutes=rng.uniform(3, 240))
        ts += step
        for symbol in prices:
            hours = step.total_seconds() / 3600
            prices[symbol] *= math.exp(rng.gauss(0.0, 0.008 * math.sqrt(hours)))
        symbol, _, max_size = rng.choice(_SYMBOLS[broker])
        price = prices[symbol]
        sell = held[symbol] > 0 and rng.random() < 0.45
        size = held[symbol] * rng.uniform(0.3, 1.0) if sell else max_size * rng.uniform(0.02, 1.0)
        size = round(size, 6) or 0.000001
        held[symbol] = max(0.0, held[symbol] + (-size if sell else size))
        fee = size * price * _FEE_RATE[broker]
        decimals = 2 if price >= 10 else 4
        if broker == "coinbase":
            trade_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            created = ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            values: tuple[Any, ...] = (trade_id, symbol, "sell" if sell else "buy")
            values += (f"{size:.6f}", f"{price:.{decimals}f}", f"{fee:.6f}", created)
        else:
            values = (first_id + i, symbol, not sell, f"{size:.8f}", f"{price:.8f}", f"{fee:.8f}")
            values += (int(ts.timestamp() * 1000),)
        rows.append(dict(zip(_ROW_KEYS[broker], values, strict=True)))
    return rows
