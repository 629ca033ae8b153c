"""The AI coach client: indicators, bias scores and reflections over HMAC-signed HTTP
(:mod:`tasks.trading.signing`).

Every HTTP try is signed afresh (a new nonce and timestamp), and the HTTP library's
automatic retries are off, so nothing ever resends a signature the coach has seen: a try
after a failure is a new request, never a replay. Outcomes other than an answer are the
family's errors: :class:`PeerUnavailable` (transient) on 5xx, timeouts, connection errors
and unreadable answers; :class:`CoachUnauthorized` (permanent) on 401 with the coach's
reason; :class:`conveyor.errors.PermanentError` on any other status. Messages name the
endpoint, never the secret, a signature or a payload.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from types import TracebackType
from typing import Any, Self

import httpx

from conveyor.errors import PermanentError
from tasks.trading.errors import CoachUnauthorized, PeerUnavailable
from tasks.trading.series import Candle
from tasks.trading.signing import sign
from tasks.trading.transport import http_client

__all__ = ["CoachClient"]

_MAX_REASON = 80


class CoachClient:
    """A synchronous client of the AI coach at ``base_url`` signing as ``key_id`` with
    ``secret``. ``timeout`` (seconds) bounds each request; ``on_request(endpoint, seconds)``,
    when given, is called after every try, answered or not (for metrics). Close it, or use
    it as a context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        key_id: str,
        secret: str,
        timeout: float = 2.0,
        on_request: Callable[[str, float], None] | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._key_id = key_id
        self._secret = secret
        self._on_request = on_request
        self._client = http_client(timeout, self._base_url)

    def __repr__(self) -> str:
        return f"CoachClient({self._base_url}, key_id={self._key_id!r})"

    def indicators(self, symbol: str, ts: datetime, series: Sequence[Candle]) -> dict[str, float]:
        """The coach's indicators for ``symbol`` at ``ts`` over ``series`` (hourly candles up
        to ``ts``): ``rsi_14``, ``return_24h``, ``volatility_24h``, ``volume_z``,
        ``drawdown_24h``."""
        endpoint = "/v1/indicators"
        body = {"symbol": symbol, "ts": _iso(ts), "series": [c.to_json() for c in series]}
        answer = self._post(endpoint, body)
        values: dict[str, float] = {}
        for name, value in answer.items():
            if name == "symbol":
                continue
            values[name] = _finite(value, endpoint, name)
        return values

    def bias(self, user_id: str, trades: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        """The coach's bias scores by trade id, then label (0..1), for ``trades``
        (``{"tradeId", "symbol", "side", "qty", "price", "ts"}``; ``Decimal`` and ``datetime``
        values are sent as JSON numbers and ISO times)."""
        endpoint = "/v1/bias"
        answer = self._post(endpoint, {"userId": user_id, "trades": [dict(t) for t in trades]})
        scores = answer.get("scores")
        if not isinstance(scores, dict):
            raise PeerUnavailable(f"AI coach {endpoint} answered without scores")
        result: dict[str, dict[str, float]] = {}
        for trade_id, by_label in scores.items():
            if not isinstance(by_label, dict):
                raise PeerUnavailable(f"AI coach {endpoint} answered scores that are not objects")
            result[str(trade_id)] = {
                str(label): min(1.0, max(0.0, _finite(score, endpoint, "score")))
                for label, score in by_label.items()
            }
        return result

    def reflect(self, features: Mapping[str, Any], label: str, tone: str = "supportive") -> str:
        """One sentence of coaching for a trade tagged ``label`` with ``features``, in ``tone``
        (``supportive`` or ``strict``)."""
        endpoint = "/v1/nlg/reflect"
        answer = self._post(endpoint, {"features": dict(features), "label": label, "tone": tone})
        text = answer.get("text")
        if not isinstance(text, str):
            raise PeerUnavailable(f"AI coach {endpoint} answered without a text")
        return text

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _post(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One signed try of ``POST endpoint``; its JSON object, or one of the module's errors."""
        try:
            text = json.dumps(payload, default=_json_default, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            # A NaN or an object JSON cannot carry: a bug on our side, no retry can fix it.
            raise PermanentError(f"AI coach {endpoint}: the request is not JSON-serializable") from None
        body = text.encode()
        request = self._client.build_request(
            "POST", endpoint, content=body, headers={"Content-Type": "application/json"}
        )
        # Signed over the target as it goes on the wire, after httpx joined the base URL's path.
        target = request.url.raw_path.decode("ascii")
        request.headers.update(sign(self._key_id, self._secret, "POST", target, body))
        started = time.perf_counter()
        try:
            response = self._client.send(request)
        except httpx.TimeoutException as exc:
            raise PeerUnavailable(f"AI coach {endpoint} timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise PeerUnavailable(
                f"AI coach {endpoint} could not be reached ({type(exc).__name__})"
            ) from None
        finally:
            if self._on_request is not None:
                self._on_request(endpoint, time.perf_counter() - started)
        status = response.status_code
        if status == 401:
            raise CoachUnauthorized(f"AI coach {endpoint} refused the signature: {_reason(response)}")
        if status >= 500:
            raise PeerUnavailable(f"AI coach {endpoint} answered HTTP {status}")
        if status != 200:
            raise PermanentError(
                f"AI coach {endpoint} refused the request (HTTP {status}: {_reason(response)})"
            )
        try:
            answer = response.json()
        except ValueError:
            raise PeerUnavailable(f"AI coach {endpoint} answered a body that is not JSON") from None
        if not isinstance(answer, dict):
            raise PeerUnavailable(f"AI coach {endpoint} answered JSON that is not an object")
        return answer


def _reason(response: httpx.Response) -> str:
    """The peer's short ``error`` string (it never holds our secret: the peer does not know
    which one we used), or ``unknown``."""
    try:
        reason = response.json().get("error")
    except (ValueError, AttributeError):
        return "unknown"
    if not isinstance(reason, str) or not reason:
        return "unknown"
    return reason[:_MAX_REASON]


def _iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, datetime):
        return _iso(value)
    if isinstance(value, date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value: Any, endpoint: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PeerUnavailable(f"AI coach {endpoint} answered a {name} that is not a number")
    return float(value)
