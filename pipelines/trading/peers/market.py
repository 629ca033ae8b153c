"""A local market-data vendor (stdlib ``ThreadingHTTPServer`` + numpy): generated OHLCV for
any symbol, for the tests, demos and benchmarks of the trading family.

- ``GET /v1/ohlcv?symbol=&granularity=1h|1d&from=ISO&to=ISO`` → ``{"symbol", "granularity",
  "candles": [{"t", "o", "h", "l", "c", "v"}]}``, the candles starting in ``[from, to)``.
  ``GET /v1/vendor/ohlcv`` serves the same series (the fallback vendor's route). 400 on a missing or bad
  symbol, granularity or time; 422 on a window starting before :data:`ANCHOR`, ending more
  than 400 days after now, or spanning more than :data:`MAX_CANDLES` candles.
- ``GET /_peer/stats``: ``{"requests": {path: n}}`` (per route, faulted requests too).
- ``POST /_peer/faults`` (``{"clear": true}`` resets): ``latency_ms`` (both routes);
  ``fail_primary`` (true: ``/v1/ohlcv`` answers 503 until cleared); ``vendor_429`` (the next
  n ``/v1/vendor/ohlcv`` requests answer 429 with ``Retry-After: retry_after_s``, default 1);
  and, on either route, ``fail_5xx`` (the next n requests answer 503) and ``storm`` (the
  next n answer 429 with ``Retry-After: retry_after_s``).

**The model.** Per symbol, hourly log returns follow a GARCH(1,1) with standardized
Student-t shocks (:data:`DF` degrees of freedom), ``var[t] = omega + ALPHA * eps[t-1]**2 +
BETA * var[t-1]`` around the unconditional hourly volatility of its class (crypto or stock),
plus a slow pull of the log price towards its starting level (a half-life of 90 days) so
prices stay in a plausible band. Each hour ``o`` is the previous close, ``c = o * exp(r)``,
the wicks reach beyond both by a half-normal multiple of the hour's volatility, and the
volume grows with the shock's size over the unconditional volatility (times log-normal
noise). Crypto (a symbol with ``-``, or ending in USDT, USD or BTC) trades every hour; any
other symbol is a stock, with no candle on Saturdays and Sundays. A day's candle aggregates
its hours.

**Reproducible.** The path starts at :data:`ANCHOR` and is generated forward in blocks of
hours, each block from its own random stream (seeded by SHA-256 of the symbol, the peer's
``seed`` and the block number): any window, and any part of it, always gets the same
numbers, in any process. Paths are cached per symbol (the most recent :data:`CACHE_SYMBOLS`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from pipelines.loopback import (
    LoopbackPeer,
    PeerError,
    content_length,
    quiet_handler,
)
from tasks.trading.series import Candle

__all__ = ["ANCHOR", "MAX_CANDLES", "PRIMARY", "VENDOR", "MarketPeer", "SymbolPath", "is_crypto"]

ANCHOR = datetime(2020, 1, 1, tzinfo=UTC)
MAX_CANDLES = 20_000
HORIZON = timedelta(days=400)
CACHE_SYMBOLS = 32
GRANULARITIES = {"1h": timedelta(hours=1), "1d": timedelta(days=1)}
PRIMARY, VENDOR = "/v1/ohlcv", "/v1/vendor/ohlcv"
ROUTES = (PRIMARY, VENDOR)
DF = 6.0  # Student-t: kurtosis 6 for the shocks, and GARCH's fourth moment stays finite
ALPHA, BETA = 0.06, 0.92
_BLOCK = 4096  # hours per random stream
_ANCHOR_WEEKDAY = ANCHOR.weekday()
_SYMBOL = re.compile(r"^[A-Za-z0-9._/-]{1,40}$")
_CRYPTO_SUFFIXES = ("USDT", "USD", "BTC")
_FAULT_FIELDS = ("latency_ms", "fail_5xx", "storm", "retry_after_s", "fail_primary", "vendor_429")
_COUNTS = ("fail_5xx", "storm", "vendor_429")
_MAX_BODY = 1_000_000


def is_crypto(symbol: str) -> bool:
    """Whether ``symbol`` trades around the clock: it has a ``-`` (``BTC-USD``) or ends in
    USDT, USD or BTC (``ETHUSDT``); anything else is a stock (weekdays only)."""
    upper = symbol.upper()
    return "-" in upper or upper.endswith(_CRYPTO_SUFFIXES)


def _base_asset(symbol: str) -> str:
    upper = symbol.upper()
    if "-" in upper:
        return upper.split("-", 1)[0]
    for suffix in _CRYPTO_SUFFIXES:
        if upper.endswith(suffix) and len(upper) > len(suffix):
            return upper[: -len(suffix)]
    return upper


class SymbolPath:
    """One symbol's generated hourly path from :data:`ANCHOR`, extended on demand. Not
    thread-safe: :class:`MarketPeer` serializes access."""

    def __init__(self, symbol: str, seed: int = 7) -> None:
        self.symbol = symbol
        self.crypto = is_crypto(symbol)
        digest = hashlib.sha256(symbol.upper().encode()).digest()
        self._seed = int.from_bytes(digest[:8], "big") ^ seed
        base = _base_asset(symbol)
        rng = np.random.default_rng([self._seed, 2**32 - 1])
        start = {"BTC": 40_000.0, "ETH": 2_500.0}.get(base, 100.0 * math.exp(rng.uniform(-0.7, 0.7)))
        self._log_p0 = math.log(start)
        self.sigma = 0.007 if self.crypto else 0.004  # unconditional hourly volatility
        self._omega = self.sigma**2 * (1.0 - ALPHA - BETA)
        self._kappa = math.log(2) / (24 * 90)
        self._volume = 1e7 / start  # about ten million quote units an hour
        # State after the generated blocks: log price, σ², ε² of the last open hour.
        self._state = (self._log_p0, self.sigma**2, self.sigma**2)
        self._columns: list[np.ndarray] = []  # per block: (hours, 6) o, h, l, c, v, open

    def hours(self, first: int, last: int) -> np.ndarray:
        """Rows ``(o, h, l, c, v, open)`` of hours ``first`` to ``last`` (exclusive) after
        the anchor; ``open`` is 0.0 for an hour without a candle."""
        while len(self._columns) * _BLOCK < last:
            self._columns.append(self._block(len(self._columns)))
        lo, hi = first // _BLOCK, (last - 1) // _BLOCK + 1
        rows = np.concatenate(self._columns[lo:hi]) if hi > lo else np.empty((0, 6))
        return rows[first - lo * _BLOCK : last - lo * _BLOCK]

    def _block(self, number: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, number])
        shocks = (rng.standard_t(DF, _BLOCK) / math.sqrt(DF / (DF - 2))).tolist()
        wicks = np.abs(rng.standard_normal((2, _BLOCK))).tolist()
        noise = rng.lognormal(0.0, 0.25, _BLOCK).tolist()
        index = np.arange(number * _BLOCK, (number + 1) * _BLOCK)
        weekday = (_ANCHOR_WEEKDAY + index // 24) % 7
        is_open = (np.ones(_BLOCK, bool) if self.crypto else weekday < 5).tolist()
        out = np.zeros((_BLOCK, 6))
        log_p, var, eps2 = self._state
        omega, kappa, sigma, log_p0 = self._omega, self._kappa, self.sigma, self._log_p0
        for k in range(_BLOCK):
            if not is_open[k]:
                continue  # a closed hour draws nothing: the next one opens at this close
            var = omega + ALPHA * eps2 + BETA * var
            vol = math.sqrt(var)
            eps = vol * shocks[k]
            eps2 = eps * eps
            o = math.exp(log_p)
            log_p += eps - kappa * (log_p - log_p0)
            c = math.exp(log_p)
            h = max(o, c) * math.exp(0.5 * vol * wicks[0][k])
            low = min(o, c) * math.exp(-0.5 * vol * wicks[1][k])
            v = self._volume * (0.3 + abs(eps) / sigma) * noise[k]
            out[k] = (o, h, low, c, v, 1.0)
        self._state = (log_p, var, eps2)
        # Rounding is monotone, so h >= max(o, c) >= min(o, c) >= l and o == previous c survive it.
        out[:, :4] = np.round(out[:, :4], 6)
        out[:, 4] = np.round(out[:, 4], 4)
        return out


@dataclass
class _Faults:
    latency_ms: float = 0.0
    fail_5xx: int = 0
    storm: int = 0
    retry_after_s: float = 1.0
    fail_primary: bool = False
    vendor_429: int = 0


class MarketPeer(LoopbackPeer):
    """Generated OHLCV on ``host`` and ``port`` (0: the OS picks a free one), the random
    streams offset by ``seed``; see the module's docstring. Usable as a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int = 7) -> None:
        super().__init__(host, port)
        self.seed = seed
        self._lock = threading.Lock()
        self._paths_lock = threading.Lock()
        self._paths: OrderedDict[str, SymbolPath] = OrderedDict()
        self._faults = _Faults()
        self._requests: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"MarketPeer({self.url}, seed={self.seed})"

    name = "market"

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The handler of this peer's routes."""
        return quiet_handler(self._handle)

    # Control (the same as the /_peer routes)

    def faults(self, **fields: Any) -> dict[str, Any]:
        """Set fault fields (see the module's docstring); ``clear=True`` first resets all.
        Returns the faults now in force. Raises ``ValueError`` on an unknown or bad field."""
        with self._lock:
            faults = _Faults() if fields.pop("clear", False) else _Faults(**vars(self._faults))
            for name, value in fields.items():
                if name not in _FAULT_FIELDS:
                    raise ValueError(f"unknown fault {name!r}; known: {', '.join(_FAULT_FIELDS)}")
                if name == "fail_primary":
                    if not isinstance(value, bool):
                        raise ValueError("fail_primary must be true or false")
                    faults.fail_primary = value
                    continue
                if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                    raise ValueError(f"{name} must be a number >= 0")
                if name in _COUNTS and int(value) != value:
                    raise ValueError(f"{name} must be an integer")
                setattr(faults, name, int(value) if name in _COUNTS else float(value))
            self._faults = faults
            return dict(vars(faults))

    def stats(self) -> dict[str, Any]:
        """``{"requests": {path: n}}``: the ohlcv requests that arrived per route (``/v1/ohlcv``,
        ``/v1/vendor/ohlcv``), faulted ones too."""
        with self._lock:
            return {"requests": dict(self._requests)}

    def candles(
        self, symbol: str, granularity: str, start: datetime, end: datetime, *, now: datetime | None = None
    ) -> list[Candle]:
        """The candles of ``symbol`` starting in ``[start, end)`` (what ``/v1/ohlcv`` serves).
        Raises ``ValueError`` on a bad symbol or granularity, ``OverflowError`` on a window
        the peer refuses (before the anchor, too far ahead, too many candles)."""
        if not _SYMBOL.match(symbol):
            raise ValueError("symbol must be 1-40 characters of A-Z a-z 0-9 . _ / -")
        step = GRANULARITIES.get(granularity)
        if step is None:
            raise ValueError("granularity must be 1h or 1d")
        start, end = _utc(start), _utc(end)
        if end < start:
            raise ValueError("to must not be before from")
        if start < ANCHOR:
            raise OverflowError(f"from must not be before {ANCHOR.isoformat()}")
        if end > (now or datetime.now(UTC)) + HORIZON:
            raise OverflowError(f"to must not be more than {HORIZON.days} days after now")
        first, last = _ceil_div(start - ANCHOR, step), _ceil_div(end - ANCHOR, step)
        if last - first > MAX_CANDLES:
            raise OverflowError(f"the window spans more than {MAX_CANDLES} candles")
        if last <= first:
            return []
        hours_per = int(step / timedelta(hours=1))
        with self._paths_lock:
            path = self._paths.pop(symbol.upper(), None) or SymbolPath(symbol, self.seed)
            self._paths[symbol.upper()] = path
            while len(self._paths) > CACHE_SYMBOLS:
                self._paths.popitem(last=False)
            rows = path.hours(first * hours_per, last * hours_per)
        if hours_per == 1:
            return [_candle(first + k, step, row) for k, row in enumerate(rows.tolist()) if row[5]]
        return _daily(rows, first, step, hours_per)

    # Serving (called from the handler's threads)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = content_length(handler, _MAX_BODY)
        if length > _MAX_BODY:
            handler.close_connection = True  # its unread body would garble the next request
            length = 0
        raw = handler.rfile.read(length) if length > 0 else b""
        headers: dict[str, str] = {}
        try:
            status, answer = self._route(method, handler.path, raw)
        except PeerError as exc:
            status, answer, headers = exc.status, {"error": exc.message}, exc.headers
        data = json.dumps(answer).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:
            handler.close_connection = True  # the client went away (e.g. timed out)

    def _route(self, method: str, target: str, raw: bytes) -> tuple[int, Any]:
        split = urlsplit(target)
        if split.path == "/_peer/stats" and method == "GET":
            return 200, self.stats()
        if split.path == "/_peer/faults" and method == "POST":
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                return 200, self.faults(**body)
            except (TypeError, ValueError) as exc:
                raise PeerError(400, str(exc)) from None
        if split.path not in ROUTES or method != "GET":
            raise PeerError(404, f"no route {method} {split.path}")
        fault, retry_after = self._take_fault(split.path)
        if fault == "429":
            raise PeerError(429, "rate limited", {"Retry-After": f"{retry_after:g}"})
        if fault == "503":
            raise PeerError(503, "market data is temporarily unavailable")
        return 200, self._ohlcv(dict(parse_qsl(split.query)))

    def _take_fault(self, path: str) -> tuple[str | None, float]:
        """Count the request, sleep the latency, and say which fault answers it (``"429"``,
        ``"503"`` or ``None``; a one-shot count is used up by the request it answers) and the
        ``Retry-After`` seconds in force."""
        with self._lock:
            self._requests[path] += 1
            faults = self._faults
            latency, retry_after = faults.latency_ms, faults.retry_after_s
            if path == VENDOR and faults.vendor_429 > 0:
                faults.vendor_429 -= 1
                fault: str | None = "429"
            elif faults.storm > 0:
                faults.storm -= 1
                fault = "429"
            elif path == PRIMARY and faults.fail_primary:
                fault = "503"
            elif faults.fail_5xx > 0:
                faults.fail_5xx -= 1
                fault = "503"
            else:
                fault = None
        if latency > 0:
            time.sleep(latency / 1000)
        return fault, retry_after

    def _ohlcv(self, query: dict[str, str]) -> dict[str, Any]:
        symbol, granularity = query.get("symbol", ""), query.get("granularity", "")
        start, end = _parse_time(query.get("from"), "from"), _parse_time(query.get("to"), "to")
        try:
            candles = self.candles(symbol, granularity, start, end)
        except OverflowError as exc:
            raise PeerError(422, str(exc)) from None
        except ValueError as exc:
            raise PeerError(400, str(exc)) from None
        return {"symbol": symbol, "granularity": granularity, "candles": [c.to_json() for c in candles]}


def _daily(rows: np.ndarray, first_day: int, step: timedelta, hours_per: int) -> list[Candle]:
    candles = []
    for k, day in enumerate(rows.reshape(-1, hours_per, 6)):
        hours = day[day[:, 5] > 0]
        if len(hours):
            t = ANCHOR + (first_day + k) * step
            high, low = float(hours[:, 1].max()), float(hours[:, 2].min())
            candles.append(
                Candle(t, float(hours[0, 0]), high, low, float(hours[-1, 3]), float(hours[:, 4].sum()))
            )
    return candles


def _candle(index: int, step: timedelta, row: list[float]) -> Candle:
    return Candle(ANCHOR + index * step, row[0], row[1], row[2], row[3], row[4])


def _ceil_div(span: timedelta, step: timedelta) -> int:
    return -(-span // step)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _parse_time(value: str | None, name: str) -> datetime:
    if not value:
        raise PeerError(400, f"{name} is required (ISO-8601)")
    try:
        # An unescaped "+" of an offset arrives as a space in a query string.
        return _utc(datetime.fromisoformat(value.strip().replace(" ", "+").replace("Z", "+00:00")))
    except ValueError:
        raise PeerError(400, f"{name} must be an ISO-8601 time") from None
