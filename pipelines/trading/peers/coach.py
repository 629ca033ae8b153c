"""A local stand-in for the AI coach (stdlib ``ThreadingHTTPServer``), for the tests, demos
and benchmarks of the trading family. Every ``/v1`` request must be HMAC-signed
(:mod:`tasks.trading.signing`): otherwise 401 ``{"error": reason}``.

- ``POST /v1/indicators`` ``{"symbol", "ts", "series": [candle...]}`` → the
  :func:`tasks.trading.series.local_indicators` of the series at ``ts``, plus ``symbol``.
- ``POST /v1/bias`` ``{"userId", "trades": [{"tradeId", ...}]}`` → ``{"scores": {tradeId:
  {label: 0..1}}}``: pseudo scores from a hash of the trade id and label, so reproducible.
- ``POST /v1/nlg/reflect`` ``{"features", "label", "tone"}`` → ``{"text"}``: one sentence
  from a template per label and tone (``supportive`` or ``strict``).
- ``GET /_peer/stats`` (no auth): ``{"requests": {path: n}, "rejected": {reason: n},
  "accepted": n}``.
- ``POST /_peer/faults`` (no auth; ``{"clear": true}`` resets): ``latency_ms`` (every ``/v1``
  request waits first), ``down`` (every ``/v1`` connection is closed with no answer),
  ``fail_5xx`` (the next n ``/v1`` requests answer 503).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from pipelines.loopback import (
    LoopbackPeer,
    PeerError,
    content_length,
    json_object,
    quiet_handler,
)
from tasks.trading.series import Candle, local_indicators
from tasks.trading.signing import Verifier

__all__ = ["BIAS_LABELS", "TONES", "CoachPeer", "bias_scores", "reflect_text"]

BIAS_LABELS = ("fomo", "panic_sell", "revenge_trading", "overtrading")
TONES = ("supportive", "strict")
_ROUTES = ("/v1/indicators", "/v1/bias", "/v1/nlg/reflect")
_FAULT_FIELDS = ("latency_ms", "down", "fail_5xx")
_MAX_BODY = 8 * 1024 * 1024
_MAX_TRADES = 5000
_MAX_SERIES = 5000


@dataclass
class _Faults:
    latency_ms: float = 0.0
    down: bool = False
    fail_5xx: int = 0


class _Hangup(Exception):
    """The peer is ``down``: close the connection without an answer."""


class CoachPeer(LoopbackPeer):
    """The AI coach on ``host`` and ``port`` (0: the OS picks a free one), accepting requests
    signed by ``key_id`` with ``secret``; see the module's docstring. Usable as a context
    manager."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, key_id: str = "dev", secret: str = "dev-secret"
    ) -> None:
        super().__init__(host, port)
        self.key_id = key_id
        self._verifier = Verifier({key_id: secret})
        self._lock = threading.Lock()
        self._faults = _Faults()
        self._requests: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._accepted = 0

    def __repr__(self) -> str:
        return f"CoachPeer({self.url}, key_id={self.key_id!r})"

    name = "coach"

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
                setattr(faults, name, _fault_value(name, value))
            self._faults = faults
            return dict(vars(faults))

    def stats(self) -> dict[str, Any]:
        """``{"requests": {path: n}, "rejected": {reason: n}, "accepted": n}`` so far
        (``requests`` counts every ``/v1`` request that arrived, faulted and refused ones too)."""
        with self._lock:
            return {
                "requests": dict(self._requests),
                "rejected": dict(self._rejected),
                "accepted": self._accepted,
            }

    # Serving (called from the handler's threads)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = content_length(handler, _MAX_BODY)
        if length > _MAX_BODY:
            handler.close_connection = True
            self._send(handler, 413, {"error": "body too large"})
            return
        raw = handler.rfile.read(length) if length else b""
        try:
            status, answer = self._route(method, handler.path, handler, raw)
        except _Hangup:
            # No status line at all: the client sees the connection drop, as with a dead host.
            handler.close_connection = True
            return
        except PeerError as exc:
            status, answer = exc.status, {"error": exc.message}
        self._send(handler, status, answer)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:
            handler.close_connection = True  # the client went away (e.g. timed out)

    def _route(
        self, method: str, target: str, handler: BaseHTTPRequestHandler, raw: bytes
    ) -> tuple[int, Any]:
        path = urlsplit(target).path
        if path == "/_peer/stats" and method == "GET":
            return 200, self.stats()
        if path == "/_peer/faults" and method == "POST":
            try:
                return 200, self.faults(**json_object(raw))
            except (TypeError, ValueError) as exc:
                raise PeerError(400, str(exc)) from None
        if not path.startswith("/v1/"):
            raise PeerError(404, f"no route {method} {path}")
        with self._lock:
            self._requests[path if path in _ROUTES else "other"] += 1
            faults = _Faults(**vars(self._faults))
            if faults.fail_5xx > 0 and not faults.down:
                self._faults.fail_5xx -= 1
        if faults.latency_ms > 0:
            time.sleep(faults.latency_ms / 1000)
        if faults.down:
            raise _Hangup
        if faults.fail_5xx > 0:
            raise PeerError(503, "the AI coach is temporarily unavailable")
        # The signature covers the request target exactly as sent, query string included.
        reason = self._verifier.check(method, target, dict(handler.headers.items()), raw)
        with self._lock:
            if reason is not None:
                self._rejected[reason] += 1
            else:
                self._accepted += 1
        if reason is not None:
            raise PeerError(401, reason)
        if method != "POST" or path not in _ROUTES:
            raise PeerError(404, f"no route {method} {path}")
        body = json_object(raw)
        if path == "/v1/indicators":
            return 200, _indicators(body)
        if path == "/v1/bias":
            return 200, _bias(body)
        return 200, {"text": _reflect(body)}


def _indicators(body: dict[str, Any]) -> dict[str, Any]:
    symbol, ts, series = body.get("symbol"), body.get("ts"), body.get("series")
    if not isinstance(symbol, str) or not symbol:
        raise PeerError(400, "symbol must be a non-empty string")
    moment = _parse_time(ts, "ts")
    if not isinstance(series, list) or len(series) > _MAX_SERIES:
        raise PeerError(400, f"series must be a list of at most {_MAX_SERIES} candles")
    candles = []
    for index, item in enumerate(series):
        try:
            candles.append(Candle.from_json(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PeerError(400, f"series[{index}] is not a candle") from None
    return {"symbol": symbol, **local_indicators(candles, moment)}


def _bias(body: dict[str, Any]) -> dict[str, Any]:
    trades = body.get("trades")
    if not isinstance(body.get("userId"), str) or not body["userId"]:
        raise PeerError(400, "userId must be a non-empty string")
    if not isinstance(trades, list) or len(trades) > _MAX_TRADES:
        raise PeerError(400, f"trades must be a list of at most {_MAX_TRADES} trades")
    scores: dict[str, dict[str, float]] = {}
    for index, trade in enumerate(trades):
        trade_id = trade.get("tradeId") if isinstance(trade, dict) else None
        if isinstance(trade_id, bool) or not isinstance(trade_id, str | int) or trade_id == "":
            raise PeerError(400, f"trades[{index}].tradeId must be a string or an integer")
        scores[str(trade_id)] = bias_scores(str(trade_id))
    return {"scores": scores}


def bias_scores(trade_id: str) -> dict[str, float]:
    """The peer's score per label for a trade: SHA-256 of ``label:tradeId`` read as a number
    in 0..1, rounded to 3 decimals (the same trade id always gets the same scores)."""
    scores = {}
    for label in BIAS_LABELS:
        digest = hashlib.sha256(f"{label}:{trade_id}".encode()).digest()
        scores[label] = round(int.from_bytes(digest[:8], "big") / 2**64, 3)
    return scores


def _reflect(body: dict[str, Any]) -> str:
    features, label, tone = body.get("features", {}), body.get("label"), body.get("tone", "supportive")
    if not isinstance(features, dict):
        raise PeerError(400, "features must be an object")
    if not isinstance(label, str) or not label or len(label) > 64:
        raise PeerError(400, "label must be a non-empty string")
    if tone not in TONES:
        raise PeerError(400, f"tone must be one of {', '.join(TONES)}")
    return reflect_text(features, label, tone)


_TEMPLATES: dict[str, tuple[str, str]] = {
    "fomo": (
        "This buy came after {move}; next time, give a fast market a moment and check it fits "
        "your plan before jumping in.",
        "You bought into {move}. Chasing a move is FOMO: set your entry before the market runs, not after.",
    ),
    "panic_sell": (
        "You sold during {move}, a stressful moment; an exit plan made in advance can take the pressure off.",
        "You sold into {move}. Selling on fear locks in losses: decide your stop before you enter.",
    ),
    "revenge_trading": (
        "This trade came {gap} after a loss; a short break before the next trade can help you reset.",
        "You traded again {gap} after a loss. Trying to win it straight back is revenge trading: "
        "step away first.",
    ),
    "overtrading": (
        "This was one of {count} trades in 24 hours; fewer, more deliberate trades are often "
        "easier to manage.",
        "{count} trades in 24 hours is overtrading: set a daily limit and keep to it.",
    ),
    "neutral": (
        "Nothing stood out in this trade: it looks consistent with a steady plan. Keep it up.",
        "No bias flagged on this trade. Stay disciplined and keep following your plan.",
    ),
}
_GENERIC = (
    "This trade shows signs of {name}; pausing to review your plan before the next one can help.",
    "This trade shows signs of {name}. Review your rules before you trade again.",
)


def reflect_text(features: dict[str, Any], label: str, tone: str) -> str:
    """One sentence of coaching for ``label`` in ``tone``, filled from the features it knows
    (``return_24h`` or ``rsi_14``; ``minutes_since_loss`` or ``minutes_since_prev``;
    ``trades_24h``, as :func:`tasks.trading.heuristics.tag` records them; a neutral phrase
    when absent)."""
    supportive, strict = _TEMPLATES.get(label, _GENERIC)
    template = supportive if tone == "supportive" else strict
    minutes = features.get("minutes_since_loss", features.get("minutes_since_prev"))
    return template.format(
        move=_move(features.get("return_24h"), features.get("rsi_14")),
        gap=_gap(minutes),
        count=_count(features.get("trades_24h")),
        name=label.replace("_", " "),
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _move(change_24h: Any, rsi: Any) -> str:
    change, level = _number(change_24h), _number(rsi)
    if change is not None and change != 0:
        return f"a {abs(change) * 100:.1f}% {'rise' if change > 0 else 'fall'} in 24 hours"
    if level is not None and 0 < level <= 100:
        return f"a move that took the RSI to {level:.0f}"
    return "a sharp move"


def _gap(value: Any) -> str:
    minutes = _number(value)
    if minutes is None or minutes < 0:
        return "soon"
    return f"{minutes:.0f} minutes" if round(minutes) != 1 else "1 minute"


def _count(value: Any) -> str:
    count = _number(value)
    return "many" if count is None or count < 0 else f"{count:.0f}"


def _parse_time(value: Any, name: str) -> datetime:
    if not isinstance(value, str):
        raise PeerError(400, f"{name} must be an ISO-8601 time")
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise PeerError(400, f"{name} must be an ISO-8601 time") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _fault_value(name: str, value: Any) -> Any:
    if name == "down":
        if not isinstance(value, bool):
            raise ValueError("down must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{name} must be a number >= 0")
    if name == "latency_ms":
        return float(value)
    if int(value) != value:
        raise ValueError(f"{name} must be an integer")
    return int(value)
